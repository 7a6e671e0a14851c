#include "ckpt/shard/tag_compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <vector>

#include "ckpt/pt/dtype_cast.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/util/error.h"
#include "ckpt/shard/renamed_state.h"

namespace ckpt {

CompareReport CompareTags(const LogicalState& a, const LogicalState& b_as_given, const CompareOptions& opts) {
  CompareReport rep;
  const size_t chunk = opts.chunk;
  const ModelFormat &fa = a.layout().format, &fb = b_as_given.layout().format;
  // The tags may name their tensors differently (the other model family, or HF-style attention fused in one and not
  // in the other): b is then read under a's names.
  std::optional<RenamedState> renamed;
  if (!SameLogicalNames(fa, fb)) {
    ModelFormat as_a = fb;
    as_a.family = fa.family, as_a.fuse_qkv = fa.fuse_qkv, as_a.qkv_linear = fa.qkv_linear;
    as_a.kv_size_multiplier = fa.family == fb.family ? fb.kv_size_multiplier : 1;
    as_a.make_vocab_size_divisible_by = fa.family == ModelFamily::kHfLlama ? 1 : fb.make_vocab_size_divisible_by;
    try {
      renamed.emplace(b_as_given, as_a);
    } catch (const Error& e) {
      rep.differences.push_back({"", std::string("the tags cannot be compared tensor for tensor: ") + e.what()});
      return rep;
    }
  }
  const LogicalState& b = renamed ? static_cast<const LogicalState&>(*renamed) : b_as_given;
  ModelFormat ua = LayoutFree(fa), ub = LayoutFree(fb);  // the padding rule, KV replication and attention tensors are layout, not model
  // With rope, max_position_embeddings is 0 where a tag does not record it: unknown, not different.
  if (!ua.learned_positions && (ua.max_positions == 0 || ub.max_positions == 0)) ub.max_positions = ua.max_positions;
  if (!(ua == ub)) {
    std::string fields;
    const auto ja = ua.ToJson(), jb = ub.ToJson();
    for (const auto& [k, v] : ja.items())
      if (jb.at(k) != v) fields += (fields.empty() ? "" : ", ") + k + " " + v.dump() + " vs " + jb.at(k).dump();
    rep.differences.push_back({"", "the model formats differ (" + fields + "): " + fa.Describe() + " vs " + fb.Describe()});
    return rep;
  }
  if (a.layout().has_optimizer != b.layout().has_optimizer)
    rep.differences.push_back({"", std::string("only ") + (a.layout().has_optimizer ? a.path() : b.path()) + " holds optimizer state"});
  if (a.layout().has_optimizer && b.layout().has_optimizer) {
    if (a.layout().master_weights != b.layout().master_weights)
      rep.differences.push_back({"", "only one tag holds fp32 master weights"});
    if (a.layout().grouping != b.layout().grouping)
      rep.differences.push_back({"", std::string("the optimizer groups differ (") + GroupingRuleName(a.layout().grouping) + " vs " +
                                         GroupingRuleName(b.layout().grouping) + ")"});
    // Hyperparameters: every group's entries but its ids.
    auto hyper = [](const Value& groups) {
      std::vector<Value> out;
      for (const auto& g : groups.as_seq().items) {
        Value c = Value::NewDict();
        for (const auto& [k, v] : g.as_dict().items)
          if (!(k.is_str() && k.as_str() == "params")) c.as_dict().items.emplace_back(k, v);
        out.push_back(c);
      }
      return out;
    };
    const auto ha = hyper(a.ParamGroups()), hb = hyper(b.ParamGroups());
    bool same = ha.size() == hb.size();
    for (size_t i = 0; same && i < ha.size(); ++i) same = DeepEqual(ha[i], hb[i]);
    if (!same) rep.differences.push_back({"", "the optimizer's param_groups hyperparameters differ"});
  }
  // Fingerprints are computed from the data, never taken on a manifest's word: a tag whose
  // rank files were swapped and its file checksums rewritten still records the old ones.
  // Recorded fingerprints are checked against the computed ones.
  rep.recorded_a = a.recorded_fingerprints().has_value();
  rep.recorded_b = b.recorded_fingerprints().has_value();
  const TensorFingerprints fpa = ComputeFingerprints(a, chunk);
  const TensorFingerprints fpb = ComputeFingerprints(b, chunk);
  for (const LogicalState* s : {&a, &b})
    if (s->recorded_fingerprints())
      for (const FingerprintMismatch& m : RecordedMismatches(*s->recorded_fingerprints(), s == &a ? fpa : fpb))
        rep.differences.push_back({m.tensor, m.field + ": " + s->path() + "'s manifest records another fingerprint than its data "
                                                       "have (files changed or swapped after the manifest was written)"});
  std::vector<uint8_t> ba(chunk), bb(chunk);
  // Streams `t` from both tags a chunk at a time into ba and bb; `each(at, n)` sees elements
  // [at, at + n) and returns true to stop.
  auto stream_both = [&](const LogicalTensor& t, const std::function<bool(uint64_t, uint64_t)>& each) {
    const size_t es = ElementSize(t.dtype), per = chunk / es;
    for (uint64_t at = 0; at < t.numel;) {
      const uint64_t n = std::min<uint64_t>(per, t.numel - at);
      Touched ta, tb;
      a.Read(t.name, t.field, at, {ba.data(), n * es}, &ta);
      b.Read(t.name, t.field, at, {bb.data(), n * es}, &tb);
      if (each(at, n)) return;
      at += n;
    }
  };
  // The first element at which the two tags' `t` differ; nullopt when none does.
  auto first_difference = [&](const LogicalTensor& t) -> std::optional<uint64_t> {
    const size_t es = ElementSize(t.dtype);
    std::optional<uint64_t> first;
    stream_both(t, [&](uint64_t at, uint64_t n) {
      if (std::memcmp(ba.data(), bb.data(), n * es) == 0) return false;
      uint64_t i = 0;
      while (std::memcmp(ba.data() + i * es, bb.data() + i * es, es) == 0) ++i;
      first = at + i;
      return true;
    });
    return first;
  };
  // Element by element as numbers: the first element past the tolerance, nullopt when none is;
  // the largest differences go into the report.
  const bool tolerant = opts.rtol > 0 || opts.atol > 0;
  auto first_beyond_tolerance = [&](const LogicalTensor& t) -> std::optional<uint64_t> {
    const size_t es = ElementSize(t.dtype);
    std::optional<uint64_t> beyond;
    stream_both(t, [&](uint64_t at, uint64_t n) {
      const Tensor xa = CastTensor(Tensor::FromBytes(t.dtype, {static_cast<int64_t>(n)}, {ba.data(), n * es}), DType::kFloat64);
      const Tensor xb = CastTensor(Tensor::FromBytes(t.dtype, {static_cast<int64_t>(n)}, {bb.data(), n * es}), DType::kFloat64);
      const double* pa = reinterpret_cast<const double*>(xa.data());
      const double* pb = reinterpret_cast<const double*>(xb.data());
      for (uint64_t i = 0; i < n; ++i) {
        const double d = std::fabs(pa[i] - pb[i]);
        if (!(d <= opts.atol + opts.rtol * std::fabs(pb[i])) && !beyond) beyond = at + i;
        rep.max_abs_diff = std::max(rep.max_abs_diff, d);
        if (pb[i] != 0 && d / std::fabs(pb[i]) > rep.max_rel_diff && d > opts.atol)
          rep.max_rel_diff = d / std::fabs(pb[i]), rep.max_rel_at = t.name + " " + FieldName(t.field);
      }
      return false;  // every element, for the largest differences
    });
    return beyond;
  };
  std::vector<StateField> fields{StateField::kParam};
  if (a.layout().has_optimizer && b.layout().has_optimizer) {
    fields.insert(fields.end(), {StateField::kExpAvg, StateField::kExpAvgSq});
    if (a.layout().master_weights && b.layout().master_weights) fields.push_back(StateField::kMaster);
  }
  for (const LogicalTensor& t : LogicalTensors(a)) {
    if (std::find(fields.begin(), fields.end(), t.field) == fields.end() || !b.Has(t.name, t.field)) continue;
    // Both computed from the data over every logical tensor each tag holds, so both are there.
    const std::string field = FieldName(t.field);
    const TensorFingerprint &x = fpa.at(t.name).at(field), &y = fpb.at(t.name).at(field);
    if (x.dtype != y.dtype) {
      rep.differences.push_back({t.name, field + " is " + x.dtype + " in one tag, " + y.dtype + " in the other"});
      continue;
    }
    if (x.numel != y.numel) {
      rep.differences.push_back({t.name, field + " has " + std::to_string(x.numel) + " elements in one tag, " + std::to_string(y.numel) +
                                             " in the other"});
      continue;
    }
    ++rep.tensors;
    rep.bytes += t.numel * ElementSize(t.dtype);
    if (x.crc32 == y.crc32) continue;
    if (tolerant && CanCast(t.dtype, DType::kFloat64)) {
      if (const auto at = first_beyond_tolerance(t))
        rep.differences.push_back({t.name, field + " differs beyond the tolerance first at element " + std::to_string(*at) + " of " +
                                               std::to_string(t.numel)});
      else
        ++rep.inexact;
      continue;
    }
    if (const auto at = first_difference(t))  // fingerprints computed from equal data are equal, so one is found
      rep.differences.push_back({t.name, field + " differs first at element " + std::to_string(*at) + " of " + std::to_string(t.numel)});
  }
  for (const ParamRule& p : a.params()) {
    if (!a.layout().has_optimizer || !b.layout().has_optimizer) continue;
    // LoRA's frozen base weights have no optimizer state (ckpt/spec/lora.h); the moments' comparison above covers which do.
    const bool stated = a.Has(p.name, StateField::kExpAvg);
    if (stated != b.Has(p.name, StateField::kExpAvg)) rep.differences.push_back({p.name, "optimizer state held by one tag only"});
    else if (stated && !DeepEqual(a.Step(p.name), b.Step(p.name))) rep.differences.push_back({p.name, "optimizer step differs"});
  }
  return rep;
}

}  // namespace ckpt

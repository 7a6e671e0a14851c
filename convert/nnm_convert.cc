#include "convert/nnm_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "ckpt/util/error.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/store/training_state.h"
#include "convert/nnm_optimizer.h"

namespace convert {
namespace {

using ckpt::Dict;
using ckpt::Object;
using ckpt::Error;
using ckpt::Value;

// Buffers are in the state dict but are not parameters: no optimizer state.
bool IsBuffer(const std::string& key) { return key.ends_with(".inv_freq") || key.ends_with("._extra_state"); }

// One model chunk of one rank: (NNM key, value) in state-dict order.
struct Chunk {
  std::string where;  // "<file>: state_dict" for messages
  const Dict* dict;
};

std::vector<Chunk> ModelChunks(const RankInput& in) {
  const Dict& top = in.checkpoint.as_dict();
  const Value* sd = top.Find("state_dict");
  // With the virtual pipeline NNM's model is a list of chunks, saved as model0, model1, ...
  // beside the LightningModule's own state_dict, which then holds no parameter.
  const bool chunked = top.Find("model0") && (!sd || (sd->is_dict() && sd->as_dict().items.empty()));
  if (sd && !chunked) {
    if (!sd->is_dict()) throw Error(in.path + ": 'state_dict' is a " + sd->kind_name() + ", not a dict");
    if (top.Find("model0"))
      throw Error(in.path + ": holds both a 'state_dict' with parameters and virtual pipeline model chunks ('model0', ...); "
                  "which holds the model is ambiguous");
    return {{in.path + ": state_dict", &sd->as_dict()}};
  }
  std::vector<Chunk> chunks;
  for (int i = 0;; ++i) {  // virtual pipeline: model0, model1, ...
    const Value* m = top.Find("model" + std::to_string(i));
    if (!m) break;
    if (!m->is_dict()) throw Error(in.path + ": 'model" + std::to_string(i) + "' is a " + m->kind_name() + ", not a dict");
    // NNM saves each virtual pipeline chunk as state_dict_for_save_checkpoint() gives it, nested
    // dicts ('language_model' -> 'embedding', 'encoder', ...; NNM megatron_gpt_model.py
    // on_save_checkpoint), not the flat names a state_dict holds: refused, naming the cause.
    for (const auto& [k, v] : m->as_dict().items)
      if (v.is_dict())
        throw Error(in.path + ": 'model" + std::to_string(i) + "' is a virtual pipeline model chunk (NNM's " +
                    "virtual_pipeline_model_parallel_size) saved as nested dicts ('" + (k.is_str() ? k.as_str() : k.kind_name()) +
                    "': {...}, as NNM's on_save_checkpoint writes them), which nnm2nxdt-ckpt does not convert; convert a save " +
                    "made without the virtual pipeline, or re-save it with NNM at virtual_pipeline_model_parallel_size null");
    chunks.push_back({in.path + ": model" + std::to_string(i), &m->as_dict()});
  }
  if (chunks.empty()) {
    std::string keys;
    for (const auto& [k, v] : top.items) keys += (keys.empty() ? "" : ", ") + (k.is_str() ? k.as_str() : k.kind_name());
    throw Error(in.path + ": not an NNM checkpoint: no 'state_dict' and no 'model0' (keys: " + keys + ")");
  }
  return chunks;
}

std::string StripModelPrefix(const std::string& k) { return k.starts_with("model.") ? k.substr(6) : k; }

// Old NNM Llama checkpoints keep SwiGLU unmerged: dense_h_to_4h is the gate
// and dense_h_to_4h_2 the up projection (old NNM transformer.py computes
// act(dense_h_to_4h(x)) * dense_h_to_4h_2(x)). For `name` = ...dense_h_to_4h_2.X,
// the merged parameter's name (...dense_h_to_4h.X); else "".
std::string UnmergedSwigluGate(const std::string& name) {
  static const std::string kUp = ".mlp.dense_h_to_4h_2.";
  const size_t at = name.find(kUp);
  if (at == std::string::npos) return "";
  return name.substr(0, at) + ".mlp.dense_h_to_4h." + name.substr(at + kUp.size());
}

// [gate; up] along dim 0, as NNM's chkpt_merge_mlp_weights.py merges each tp
// rank's file (torch.concat([dense_h_to_4h, dense_h_to_4h_2], dim=0)): NxDT's
// fused dense_h_to_4h per rank. Produced as it is written, from the mapped inputs.
Value ConcatRows(const Value& gate, const Value& up, const std::string& where) {
  const ckpt::Tensor &g = gate.as_tensor(), &u = up.as_tensor();
  if (g.dtype() != u.dtype() || g.shape().empty() || g.shape().size() != u.shape().size() ||
      !std::equal(g.shape().begin() + 1, g.shape().end(), u.shape().begin() + 1) || !g.is_contiguous() || !u.is_contiguous())
    throw Error(where + ": the unmerged SwiGLU halves (" + ckpt::ShapeString(g.shape()) + " and " + ckpt::ShapeString(u.shape()) +
                ") cannot be stacked into one dense_h_to_4h");
  std::vector<int64_t> shape = g.shape();
  shape[0] += u.shape()[0];
  const uint64_t a = g.nbytes(), b = u.nbytes();
  auto storage = ckpt::Storage::Generated(a + b, [g, u, a](uint64_t off, std::span<uint8_t> out) {
    for (size_t done = 0; done < out.size();) {
      const uint64_t at = off + done;
      const bool first = at < a;
      const uint8_t* src = first ? g.data() + at : u.data() + (at - a);
      const size_t n = std::min<uint64_t>(out.size() - done, first ? a - at : u.nbytes() - (at - a));
      std::memcpy(out.data() + done, src, n);
      done += n;
    }
  });
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
  return Value(ckpt::Tensor(g.dtype(), shape, strides, 0, storage));
}

// Distinct local layer indices of a chunk; they must run 0..n-1.
int LayerCount(const Chunk& c) {
  std::set<int> seen;
  for (const auto& [k, v] : c.dict->items) {
    int local;
    std::string unused;
    if (k.is_str() && ShiftLayerIndex(k.as_str(), 0, &unused, &local)) seen.insert(local);
  }
  int expect = 0;
  for (int l : seen)
    if (l != expect++) {
      std::string list;
      for (int x : seen) list += (list.empty() ? "" : ",") + std::to_string(x);
      throw Error(c.where + ": layer indices are not contiguous from 0 (" + list + ")");
    }
  return static_cast<int>(seen.size());
}

void CountTensors(const Value& v, std::set<const ckpt::Storage*>& seen, int64_t* tensors, uint64_t* bytes) {
  ckpt::ForEachTensor(v, [&](const ckpt::Tensor& t) {
    ++*tensors;
    if (seen.insert(t.storage().get()).second) *bytes += t.storage()->nbytes();
  });
}

void AddFile(ConvertPlan& plan, const std::string& relpath, Value value, bool weights_only, bool xser,
             const std::string& source, int unit) {
  ckpt::FileToWrite file{relpath, std::move(value), {.weights_only = weights_only, .drop_source_pages = true}};
  std::vector<ckpt::FileToWrite> parts;
  if (xser) parts = ckpt::XserFiles(file);
  else parts.push_back(std::move(file));
  for (auto& part : parts) {
    PlannedFile f;
    f.file = std::move(part);
    f.source = source;
    f.unit = unit;
    std::set<const ckpt::Storage*> seen;
    CountTensors(f.file.value, seen, &f.tensors, &f.bytes);
    plan.files.push_back(std::move(f));
  }
}

// One rank's optimizer inputs (one file, or one per ZeRO-1 dp rank) and the
// grouping NNM used for them.
struct RankOptimizer {
  int unit;
  std::vector<ckpt::ParamInfo> params;
  std::vector<SourceOptimizer> sources;  // by ZeRO-1 dp rank, or the one plain state dict
  ckpt::Grouping from;
  std::string same_stage_copy;  // GPT's tied output copy the conversion adds beside the embedding (pp = 1)
};

// hyper_parameters.cfg.<key> of a Lightning checkpoint, when recorded.
const Value* HyperParameter(const Value& checkpoint, const char* key) {
  const Value* cfg = ckpt::RecordedJobConfig(checkpoint);
  return cfg ? ckpt::ConfigEntry(*cfg, key) : nullptr;
}

std::vector<std::string> NamesOf(const std::vector<ckpt::ParamInfo>& params) {
  std::vector<std::string> names;
  for (const auto& p : params) names.push_back(p.name);
  return names;
}

// The trainer's grouping for one do_layer_norm_weight_decay setting over every
// rank, and the parameters whose decay writing it would stop or start.
struct Target {
  bool do_layer_norm_weight_decay;
  std::vector<ckpt::Grouping> by_rank;  // as `ranks`
  std::vector<std::string> stops, starts;
  bool KeepsDecay() const { return stops.empty() && starts.empty(); }
};

Target TargetFor(const std::vector<RankOptimizer>& ranks, bool do_layer_norm_weight_decay) {
  Target t{do_layer_norm_weight_decay, {}, {}, {}};
  for (const auto& r : ranks) {
    // The conversion's names: NNM's, and at pp = 1 GPT's tied output copy NxDT lists beside the embedding.
    std::vector<std::string> names = NamesOf(r.params);
    if (!r.same_stage_copy.empty()) names.push_back(r.same_stage_copy);
    const ckpt::GroupingRule rule = ckpt::NxdtGroupingRule(do_layer_norm_weight_decay);
    t.by_rank.push_back(ckpt::NxdtGrouping(ckpt::GroupedNames(names, r.same_stage_copy, rule), do_layer_norm_weight_decay));
    std::set<std::string> decays;
    for (const auto& s : t.by_rank.back().order)
      if (t.by_rank.back().group_decays[s.group]) decays.insert(s.name);
    for (const auto& s : r.from.order) {
      const bool was = r.from.group_decays[s.group], now = decays.count(s.name) > 0;
      if (was && !now) t.stops.push_back(s.name);
      if (!was && now) t.starts.push_back(s.name);
    }
  }
  return t;
}

// Chooses the target grouping (ConvertOptions::optimizer_groups) and plans
// every rank's optimizer files, renumbered into it.
void PlanOptimizerFiles(ConvertPlan& plan, const std::vector<RankOptimizer>& ranks, const ConvertOptions& opts, const NnmSource& src) {
  std::set<std::string> found;
  for (const auto& r : ranks) found.insert(r.from.id + ": " + r.from.description);
  for (const auto& f : found) plan.source_grouping += (plan.source_grouping.empty() ? "" : "; ") + f;
  // NxDT's split, or (keep) whichever of the trainer's groupings decays exactly what NNM decayed.
  Target target = TargetFor(ranks, false);
  if (opts.optimizer_groups == OptimizerGroups::kKeep && !target.KeepsDecay()) {
    Target one = TargetFor(ranks, true);
    if (!one.KeepsDecay())
      throw Error(src.root + ": NNM grouped the optimizer as " + plan.source_grouping + ". NxDT's megatron models decay either every " +
                  "parameter (model.do_layer_norm_weight_decay: True) or every parameter but biases (False: NeMo's rule, which "
                  "matches no NxD norm class), and neither keeps what NNM decayed (" +
                  (target.stops.empty() ? target.starts[0] + " would start decaying" : target.stops[0] + " would stop decaying") +
                  "). Pass --optimizer_groups nxdt to regroup as NxDT groups them.");
    target = std::move(one);
  }
  plan.do_layer_norm_weight_decay = target.do_layer_norm_weight_decay;
  const ckpt::Grouping kind = ckpt::NxdtGrouping({}, target.do_layer_norm_weight_decay);
  plan.target_grouping = kind.id + ": " + kind.description;
  if (!target.stops.empty())
    plan.notes.push_back(std::to_string(target.stops.size()) +
                         " parameters that decayed in NNM stop decaying (--optimizer_groups nxdt), e.g. " + target.stops[0]);
  if (!target.starts.empty())
    plan.notes.push_back(std::to_string(target.starts.size()) + " parameters that did not decay in NNM start decaying, e.g. " +
                         target.starts[0]);
  for (size_t i = 0; i < ranks.size(); ++i) {
    const RankOptimizer& r = ranks[i];
    const int t = r.unit % src.grid.tp, p = r.unit / src.grid.tp;
    for (size_t d = 0; d < r.sources.size(); ++d)
      AddFile(plan, ckpt::RankFilePath(ckpt::RankFileKind::kOptim, {static_cast<int>(d), t, p}),
              RegroupOptimizerState(r.sources[d], r.from, target.by_rank[i]), false, opts.save_xser, r.sources[d].path, r.unit);
  }
}

}  // namespace

bool ShiftLayerIndex(const std::string& key, int offset, std::string* out, int* local) {
  static const std::string kLayers = "layers.";
  size_t pos = 0;
  while ((pos = key.find(kLayers, pos)) != std::string::npos) {
    const bool at_segment = pos == 0 || key[pos - 1] == '.';
    size_t end = pos + kLayers.size(), d = end;
    while (d < key.size() && std::isdigit(static_cast<unsigned char>(key[d]))) ++d;
    if (at_segment && d > end && d - end <= 6 && (d == key.size() || key[d] == '.')) {
      *local = std::stoi(key.substr(end, d - end));
      *out = key.substr(0, end) + std::to_string(*local + offset) + key.substr(d);
      return true;
    }
    pos = end;
  }
  *out = key;
  return false;
}

ConvertPlan PlanConversion(const NnmSource& src, const std::vector<RankInput>& inputs, const ConvertOptions& opts) {
  ConvertPlan plan;
  const int tp = src.grid.tp, pp = src.grid.pp;
  plan.grid = src.grid;

  // Step and epoch agree across ranks.
  auto top_int = [&](const RankInput& in, const char* key) -> int64_t {
    const Value* v = in.checkpoint.as_dict().Find(key);
    if (!v) throw Error(in.path + ": has no '" + std::string(key) + "'");
    return ckpt::AsInteger(*v, in.path + ": '" + key + "'");
  };
  for (const auto& in : inputs)
    if (!in.checkpoint.is_dict()) throw Error(in.path + ": holds a " + in.checkpoint.kind_name() + ", not a Lightning checkpoint dict");
  plan.global_step = top_int(inputs[0], "global_step");
  for (const auto& in : inputs)
    if (top_int(in, "global_step") != plan.global_step)
      throw Error(in.path + ": global_step " + std::to_string(top_int(in, "global_step")) + " differs from " + inputs[0].path +
                  " (" + std::to_string(plan.global_step) + "): the ranks are from different saves");
  if (const Value* e = inputs[0].checkpoint.as_dict().Find("epoch")) plan.epoch = ckpt::AsInteger(*e, inputs[0].path + ": 'epoch'");
  if (src.name) {
    plan.consumed_samples = src.name->consumed_samples;
    if (src.name->step != plan.global_step)
      plan.notes.push_back("the file name says step " + std::to_string(src.name->step) + " but global_step is " +
                           std::to_string(plan.global_step) + "; using global_step");
  } else {
    plan.notes.push_back(src.file_name + " does not carry consumed_samples in its name; recorded as 0");
  }

  // Layer counts per (chunk, stage), from tp rank 0; every tp rank must hold the same keys.
  std::vector<std::vector<Chunk>> chunks(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) chunks[i] = ModelChunks(inputs[i]);
  const size_t n_chunks = chunks[0].size();
  plan.layers.assign(n_chunks, std::vector<int>(pp, 0));
  for (int p = 0; p < pp; ++p) {
    const auto& ref = chunks[p * tp];
    for (int t = 0; t < tp; ++t) {
      const auto& mine = chunks[p * tp + t];
      if (mine.size() != n_chunks)
        throw Error(inputs[p * tp + t].path + ": holds " + std::to_string(mine.size()) + " model chunks, " + inputs[0].path +
                    " holds " + std::to_string(n_chunks));
      for (size_t c = 0; c < n_chunks; ++c) {
        std::vector<std::string> a, b;
        for (const auto& [k, v] : ref[c].dict->items) a.push_back(k.is_str() ? k.as_str() : "");
        for (const auto& [k, v] : mine[c].dict->items) b.push_back(k.is_str() ? k.as_str() : "");
        if (a != b) {
          std::string diff;
          for (const auto& k : a)
            if (std::find(b.begin(), b.end(), k) == b.end()) diff += "\n  missing: " + k;
          for (const auto& k : b)
            if (std::find(a.begin(), a.end(), k) == a.end()) diff += "\n  extra: " + k;
          if (diff.empty()) diff = "\n  (same keys in a different order)";
          throw Error(mine[c].where + ": keys differ from tensor-parallel rank 0 (" + ref[c].where + "):" + diff);
        }
        // Megatron splits every tensor evenly (or replicates it), so each key has one shape on every tp rank.
        for (size_t i = 0; i < a.size(); ++i) {
          const Value& x = ref[c].dict->items[i].second;
          const Value& y = mine[c].dict->items[i].second;
          if (x.is_tensor() && y.is_tensor() && x.as_tensor().shape() != y.as_tensor().shape())
            throw Error(mine[c].where + ": '" + a[i] + "' has shape " + ckpt::ShapeString(y.as_tensor().shape()) + " but " +
                        ckpt::ShapeString(x.as_tensor().shape()) + " in " + ref[c].where +
                        ": tensor-parallel shards of one model have equal shapes");
        }
      }
    }
    for (size_t c = 0; c < n_chunks; ++c) plan.layers[c][p] = LayerCount(ref[c]);
  }
  // Megatron's interleaved order: chunk 0 of every stage, then chunk 1, ...
  std::vector<std::vector<int>> offset(n_chunks, std::vector<int>(pp));
  for (size_t c = 0; c < n_chunks; ++c)
    for (int p = 0; p < pp; ++p) offset[c][p] = plan.total_layers, plan.total_layers += plan.layers[c][p];
  // The checkpoint's own record of its layout, when NNM saved one: a missing
  // rank folder would otherwise pass for a smaller model.
  {
    const Value& first = inputs[0].checkpoint;
    auto recorded = [&](const char* key) -> std::optional<int64_t> {  // an interpolation or null is no record
      const Value* v = HyperParameter(first, key);
      return v && v->is_int() ? std::optional<int64_t>(v->as_int()) : std::nullopt;
    };
    const std::optional<int64_t> htp = recorded("tensor_model_parallel_size"), hpp = recorded("pipeline_model_parallel_size"),
                                 hlayers = recorded("num_layers");
    if ((htp && *htp != tp) || (hpp && *hpp != pp))
      throw Error(inputs[0].path + ": hyper_parameters.cfg records tensor_model_parallel_size=" + (htp ? std::to_string(*htp) : "?") +
                  " pipeline_model_parallel_size=" + (hpp ? std::to_string(*hpp) : "?") + ", but " + src.root + " holds the rank files of tp=" +
                  std::to_string(tp) + " pp=" + std::to_string(pp) + " (" + src.folders + "): rank folders are missing or extra");
    if (hlayers && *hlayers != plan.total_layers)
      throw Error(inputs[0].path + ": hyper_parameters.cfg records num_layers=" + std::to_string(*hlayers) + ", but the rank files hold " +
                  std::to_string(plan.total_layers) + " layers");
  }
  if (opts.n_layers > 0 && opts.n_layers != plan.total_layers) {
    std::string per;
    for (size_t c = 0; c < n_chunks; ++c)
      for (int p = 0; p < pp; ++p)
        per += (per.empty() ? "" : ", ") + std::string("stage ") + std::to_string(p) + (n_chunks > 1 ? " chunk " + std::to_string(c) : "") +
               ": " + std::to_string(plan.layers[c][p]);
    throw Error(src.root + ": --n_layers is " + std::to_string(opts.n_layers) + " but the checkpoint holds " +
                std::to_string(plan.total_layers) + " layers (" + per + ")");
  }

  plan.renames.resize(pp);
  std::set<std::string> dropped;
  bool unmerged_swiglu = false;
  std::vector<RankOptimizer> ranks;
  std::vector<std::string> without_optimizer;
  // The source's model files, one per (tp, pp) place, as the target's.
  src.grid.ForEachRankFile(ckpt::RankFileKind::kModel, [&](const ckpt::RankCoord& rank) {
      const int t = rank.tp, p = rank.pp, unit = p * tp + t;
      const RankInput& in = inputs[unit];
      Value model = Value::NewDict(/*ordered=*/true);
      std::vector<ckpt::ParamInfo> params;
      for (size_t c = 0; c < n_chunks; ++c)
        for (const auto& [k, v] : chunks[unit][c].dict->items) {
          if (!k.is_str()) throw Error(chunks[unit][c].where + ": has a " + k.kind_name() + " key");
          if (!v.is_tensor()) {  // untrained_buffer_names and the like
            dropped.insert(k.as_str() + " (a " + v.kind_name() + ")");
            continue;
          }
          std::string name;
          int local;
          ShiftLayerIndex(StripModelPrefix(k.as_str()), offset[c][p], &name, &local);
          // GPT's tied output copy: Megatron-LM's last-stage word_embeddings.weight is NxDT's output layer (ckpt/spec/partition.h).
          if (name == ckpt::kMegatronLmTiedCopy) name = ckpt::kTiedOutputCopy;
          if (const std::string gate = UnmergedSwigluGate(name); !gate.empty()) {
            Value* g = model.as_dict().Find(gate);
            if (!g) throw Error(chunks[unit][c].where + ": '" + k.as_str() + "' (the SwiGLU up projection) comes before or without its gate " + gate);
            *g = ConcatRows(*g, v, chunks[unit][c].where + ": '" + k.as_str() + "'");
            for (auto& pi : params)
              if (pi.name == gate) pi.shape = g->as_tensor().shape();
            unmerged_swiglu = true;
            if (t == 0) plan.renames[p].push_back({k.as_str(), gate + " (rows after the gate's)"});
            continue;
          }
          if (model.as_dict().Find(name)) throw Error(chunks[unit][c].where + ": two entries become " + name);
          if (t == 0) plan.renames[p].push_back({k.as_str(), name});
          model.as_dict().items.emplace_back(Value(name), v);
          if (!IsBuffer(name)) params.push_back({name, v.as_tensor().shape()});
        }
      // One stage of a GPT with tied embeddings: NxDT's state_dict holds the embedding under the output
      // layer's name too (NxDT gpt_model.py; tests/data/upstream/nxdt_megatron); Megatron-LM's has nothing.
      std::string same_stage_copy;
      if (pp == 1 && !model.as_dict().Find(ckpt::kTiedOutputCopy))
        if (const Value* emb = model.as_dict().Find(ckpt::ParamName(ckpt::ModelFormat{}, ckpt::Module::kEmbedding))) {
          model.as_dict().items.emplace_back(Value(std::string(ckpt::kTiedOutputCopy)), *emb);
          same_stage_copy = ckpt::kTiedOutputCopy;
          if (t == 0)
            plan.renames[p].push_back({"model." + ckpt::ParamName(ckpt::ModelFormat{}, ckpt::Module::kEmbedding),
                                       std::string(ckpt::kTiedOutputCopy) + " (GPT's tied output layer, as NxDT's state_dict names it too)"});
        }
      AddFile(plan, ckpt::RankFilePath(ckpt::RankFileKind::kModel, rank), model, true, opts.save_xser, in.path, unit);
      if (opts.weights_only) return;

      RankOptimizer ro{unit, params, {}, {}, same_stage_copy};
      if (src.zero1_dp() > 0) {
        for (int d = 0; d < src.zero1_dp(); ++d) {
          ro.sources.push_back(Zero1Optimizer(in.zero1[d], in.zero1_paths[d], src.zero1_dp()));
        }
      } else {
        bool found = false;
        SourceOptimizer so = PlainOptimizer(in.checkpoint, in.path, &found);
        if (!found) {
          if (const Value* zero = HyperParameter(in.checkpoint, "wrap_with_zero"); zero && zero->is_bool() && zero->as_bool())
            throw Error(in.path + ": hyper_parameters.cfg.wrap_with_zero is True, but no ZeRO-1 optimizer folder (" +
                        "optim/dp_rank_000/) was found beside it: the optimizer state is missing");
          without_optimizer.push_back(in.path);
          return;
        }
        ro.sources.push_back(std::move(so));
      }
      if (unmerged_swiglu)
        throw Error(in.path + ": holds NNM's unmerged SwiGLU (dense_h_to_4h and dense_h_to_4h_2). Its weights merge as NNM's "
                    "chkpt_merge_mlp_weights.py merges them, but its optimizer state keeps the halves apart (that tool leaves it as it "
                    "is too), so it has no place in NxDT's fused dense_h_to_4h: convert with --weights_only");
      for (const auto& so : ro.sources) {
        ckpt::Grouping g = FindSourceGrouping(params, so);
        if (!ro.from.order.empty() && !g.SameTies(ro.from))
          throw Error(so.where + ": grouped as " + g.id + ", but " + ro.sources[0].where + " as " + ro.from.id);
        ro.from = std::move(g);
      }
      ranks.push_back(std::move(ro));
    });
  if (!without_optimizer.empty() && !ranks.empty())
    throw Error(without_optimizer[0] + ": holds no optimizer state, but " + ranks[0].sources[0].path +
                " does: the rank files are from different kinds of save");
  if (!without_optimizer.empty()) {
    if (opts.require_optimizer)
      throw MissingOptimizerState(without_optimizer[0] + ": holds no optimizer state (no 'optimizer_states' and no ZeRO-1 " +
                                  "optim/ folder), and --require_optimizer was given");
    plan.optimizer = false;
    plan.notes.push_back("the input holds no optimizer state (as NNM's HF converter writes it): weights converted; "
                         "shardkit-train resumes with a fresh optimizer at step " + std::to_string(plan.global_step));
  }
  if (!ranks.empty()) PlanOptimizerFiles(plan, ranks, opts, src);
  if (opts.weights_only) plan.optimizer = false;

  for (const auto& d : dropped) plan.notes.push_back("dropped " + d + ": not a tensor, so not model state");
  if (unmerged_swiglu)
    plan.notes.push_back("merged NNM's unmerged SwiGLU: each tp rank's dense_h_to_4h_2 (up) stacked under its dense_h_to_4h (gate), "
                         "as NNM's chkpt_merge_mlp_weights.py does");

  // Said before anything is written: without NNM's model config in the output, later commands need hints.
  if (opts.weights_only || !HyperParameter(inputs[0].checkpoint, "num_attention_heads"))
    plan.format_unrecorded = std::string("the output will not record the model's heads (") +
                             (opts.weights_only ? "--weights_only writes no user_content.pt" :
                                                  inputs[0].path + " holds no hyper_parameters.cfg.num_attention_heads") +
                             "): ckpt-reshard and ckpt-export of it will need --heads (and --kv_heads for grouped-query attention) "
                             "or --config with the job's NxDT config; give nnm2nxdt-ckpt --nnm_config (the NNM job's YAML) or --heads now, and the "
                             "manifest records them";
  if (!opts.weights_only) {  // step and schedule, also for an input without optimizer state
    const Dict& top = inputs[0].checkpoint.as_dict();
    ckpt::UserContent user{.epoch = plan.epoch, .global_step = plan.global_step, .consumed_samples = plan.consumed_samples, .carried = {}};
    // NNM's model config (hyper_parameters.cfg) goes where NxDT keeps its own, so the tag
    // describes its model to ckpt-reshard and ckpt-export (heads, KV heads, rope base, epsilon).
    for (const char* key : {"loops", "lr_schedulers", "pytorch-lightning_version", "hparams_name", "hyper_parameters"})
      if (const Value* v = top.Find(key)) user.carried.emplace_back(key, *v);
    ckpt::SchedulerState sched;
    if (const Value* ls = top.Find("lr_schedulers"); ls && ls->is_seq() && !ls->as_seq().items.empty() && ls->as_seq().items[0].is_dict()) {
      sched = ckpt::SchedulerState::FromValue(ls->as_seq().items[0], inputs[0].path + ": lr_schedulers[0]");
    } else {
      sched.last_epoch = plan.global_step;
      plan.notes.push_back("no lr_schedulers state in " + inputs[0].path + "; scheduler.pt records the step only");
    }
    AddFile(plan, ckpt::kSchedulerFile, sched.ToValue(), false, false, inputs[0].path, -1);
    AddFile(plan, ckpt::kUserContentFile, user.ToValue(), false, false, inputs[0].path, -1);
  }
  return plan;
}

}  // namespace convert

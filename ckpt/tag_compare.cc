#include "ckpt/tag_compare.h"

#include <cstring>
#include <vector>

namespace ckpt {

CompareReport CompareTags(const ShardedTag& a, const ShardedTag& b, size_t chunk) {
  CompareReport rep;
  const ModelFormat &fa = a.layout().format, &fb = b.layout().format;
  ModelFormat ua = fa, ub = fb;  // the padding rule is layout, not model
  ub.make_vocab_size_divisible_by = ua.make_vocab_size_divisible_by;
  if (!(ua == ub)) {
    rep.differences.push_back({"", "the model formats differ: " + fa.Describe() + " vs " + fb.Describe()});
    return rep;
  }
  if (a.layout().has_optimizer != b.layout().has_optimizer)
    rep.differences.push_back({"", std::string("only ") + (a.layout().has_optimizer ? a.path() : b.path()) + " holds optimizer state"});
  std::vector<StateField> fields{StateField::kParam};
  if (a.layout().has_optimizer && b.layout().has_optimizer) {
    fields.insert(fields.end(), {StateField::kExpAvg, StateField::kExpAvgSq});
    if (a.layout().master_weights != b.layout().master_weights)
      rep.differences.push_back({"", "only one tag holds fp32 master weights"});
    else if (a.layout().master_weights)
      fields.push_back(StateField::kMaster);
    if (a.layout().one_group != b.layout().one_group)
      rep.differences.push_back({"", "the optimizer groups differ (one group vs norms and biases apart)"});
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
  std::vector<uint8_t> ba(chunk), bb(chunk);
  for (const ParamRule& p : a.params()) {
    // Rows past the real vocabulary are padding, which layouts pad differently.
    std::vector<int64_t> shape = p.shape;
    if (p.vocab) shape[0] = fa.vocab_size;
    const uint64_t numel = static_cast<uint64_t>(ShapeNumel(shape));
    for (StateField f : fields) {
      if (!a.Has(p.name, f) || !b.Has(p.name, f)) continue;
      const DType da = a.dtype(p.name, f), db = b.dtype(p.name, f);
      if (da != db) {
        rep.differences.push_back({p.name, std::string(FieldName(f)) + " is " + std::string(DTypeName(da)) + " in one tag, " +
                                               std::string(DTypeName(db)) + " in the other"});
        continue;
      }
      const size_t es = ElementSize(da), per = chunk / es;
      ++rep.tensors;
      for (uint64_t at = 0; at < numel;) {
        const uint64_t n = std::min<uint64_t>(per, numel - at);
        Touched ta, tb;
        a.Read(p.name, f, at, {ba.data(), n * es}, &ta);
        b.Read(p.name, f, at, {bb.data(), n * es}, &tb);
        rep.bytes += n * es;
        if (std::memcmp(ba.data(), bb.data(), n * es) != 0) {
          uint64_t i = 0;
          while (std::memcmp(ba.data() + i * es, bb.data() + i * es, es) == 0) ++i;
          rep.differences.push_back({p.name, std::string(FieldName(f)) + " differs first at element " + std::to_string(at + i) + " of " +
                                                 std::to_string(numel)});
          break;
        }
        at += n;
      }
    }
    if (a.layout().has_optimizer && b.layout().has_optimizer && !DeepEqual(a.Step(p.name), b.Step(p.name)))
      rep.differences.push_back({p.name, "optimizer step differs"});
  }
  return rep;
}

}  // namespace ckpt

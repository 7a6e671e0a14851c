#include "convert/nnm_convert.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "ckpt/error.h"
#include "ckpt/xser.h"
#include "libtrain/param_groups.h"

namespace convert {
namespace {

using ckpt::Dict;
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
  if (const Value* sd = top.Find("state_dict")) {
    if (!sd->is_dict()) throw Error(in.path + ": 'state_dict' is a " + sd->kind_name() + ", not a dict");
    return {{in.path + ": state_dict", &sd->as_dict()}};
  }
  std::vector<Chunk> chunks;
  for (int i = 0;; ++i) {  // virtual pipeline: model0, model1, ...
    const Value* m = top.Find("model" + std::to_string(i));
    if (!m) break;
    if (!m->is_dict()) throw Error(in.path + ": 'model" + std::to_string(i) + "' is a " + m->kind_name() + ", not a dict");
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

int64_t IntOf(const Value& v, const std::string& what) {
  if (v.is_int()) return v.as_int();
  if (v.is_tensor()) {
    try {
      return static_cast<int64_t>(ckpt::AsScalar(v));
    } catch (const Error&) {
      // reported below, with `what`
    }
  }
  throw Error(what + " is a " + v.kind_name() + ", not an integer");
}

void CountTensors(const Value& v, std::set<const ckpt::Storage*>& seen, int64_t* tensors, uint64_t* bytes) {
  if (v.is_tensor()) {
    ++*tensors;
    if (seen.insert(v.as_tensor().storage().get()).second) *bytes += v.as_tensor().storage()->nbytes();
  } else if (v.is_seq()) {
    for (const auto& c : v.as_seq().items) CountTensors(c, seen, tensors, bytes);
  } else if (v.is_dict()) {
    for (const auto& [k, c] : v.as_dict().items) CountTensors(c, seen, tensors, bytes);
  }
}

// NNM optimizer ids tied to the parameters they belong to. NxDT builds its
// groups with the same rule over the output model's parameters, which keep
// NNM's module order, so every id keeps its number (and every param_groups
// list stays as it is); what the tie adds is the check of each id against a
// named parameter: the group sizes and the moments' shapes.
struct IdMap {
  std::vector<std::string> name;  // id -> output parameter name
  std::vector<size_t> group_size;
  std::map<std::string, std::vector<int64_t>> shape;
};

// `params`: output names in NNM module order (every chunk, in order) with
// their shapes; `groups`: the NNM param_groups list.
IdMap BuildIdMap(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params, const Value& groups,
                 const std::string& where) {
  if (!groups.is_seq() || groups.as_seq().items.empty() || groups.as_seq().items.size() > 2)
    throw Error(where + ": 'param_groups' must list one or two groups (NNM's weight-decay split), found " +
                (groups.is_seq() ? std::to_string(groups.as_seq().items.size()) : groups.kind_name()));
  const bool one_group = groups.as_seq().items.size() == 1;
  std::vector<std::string> names;
  IdMap m;
  for (const auto& [n, s] : params) names.push_back(n), m.shape[n] = s;
  m.group_size.resize(groups.as_seq().items.size());
  for (const auto& slot : train::OptimizerOrder(names, one_group)) {
    m.name.push_back(slot.name);
    ++m.group_size[slot.group];
  }
  // The groups must list exactly the ids the rule gives them.
  int64_t next = 0;
  for (size_t g = 0; g < groups.as_seq().items.size(); ++g) {
    const Value& gd = groups.as_seq().items[g];
    if (!gd.is_dict()) throw Error(where + ": param_groups[" + std::to_string(g) + "] is a " + gd.kind_name());
    const Value& ids = gd.as_dict().At("params");
    const size_t want = m.group_size[g];
    if (!ids.is_seq() || ids.as_seq().items.size() != want)
      throw Error(where + ": param_groups[" + std::to_string(g) + "] lists " +
                  (ids.is_seq() ? std::to_string(ids.as_seq().items.size()) : ids.kind_name()) + " parameters, but the model state holds " +
                  std::to_string(want) + (g == 0 ? " weights that decay" : " norm weights and biases") +
                  " (NNM groups: weights with decay, then norms and biases; FORMATS.md §3)");
    for (const Value& id : ids.as_seq().items)
      if (IntOf(id, where + ": param_groups[" + std::to_string(g) + "].params item") != next++)
        throw Error(where + ": param_groups[" + std::to_string(g) + "].params is not numbered in order from " +
                    std::to_string(g == 0 ? 0 : m.group_size[0]));
  }
  return m;
}

int64_t CheckId(const IdMap& m, const Value& key, const std::string& where) {
  const int64_t id = IntOf(key, where + " key");
  if (id < 0 || id >= static_cast<int64_t>(m.name.size()))
    throw Error(where + ": parameter id " + std::to_string(id) + " is out of range (the model has " +
                std::to_string(m.name.size()) + " parameters)");
  return id;
}

std::vector<int64_t> ShapeOf(const Value& v, const std::string& where) {
  if (!v.is_seq()) throw Error(where + " is a " + v.kind_name() + ", not a shape");
  std::vector<int64_t> s;
  for (const auto& d : v.as_seq().items) s.push_back(IntOf(d, where));
  return s;
}

// {id: x} with every id checked against the model and sorted; `check`
// validates each entry.
Value CheckedById(const Value& by_id, const IdMap& m, const std::string& where,
                  const std::function<void(int64_t id, const Value&)>& check) {
  if (!by_id.is_dict()) throw Error(where + " is a " + by_id.kind_name() + ", not a dict");
  std::vector<std::pair<int64_t, Value>> out;
  for (const auto& [k, v] : by_id.as_dict().items) {
    const int64_t id = CheckId(m, k, where);
    check(id, v);
    out.emplace_back(id, v);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Value d = Value::NewDict();
  for (auto& [k, v] : out) d.as_dict().items.emplace_back(Value(k), std::move(v));
  return d;
}

// The moments of NNM id `id` must have its parameter's shape (or, sharded by
// ZeRO-1 over `dp` ranks, dim 0 padded to a multiple of dp and split).
void CheckMoments(const IdMap& m, int64_t id, const Value& entry, int dp, const std::string& where) {
  if (!entry.is_dict()) throw Error(where + ": state of parameter " + std::to_string(id) + " is a " + entry.kind_name());
  std::vector<int64_t> want = m.shape.at(m.name[id]);
  if (dp > 1 && !want.empty()) want[0] = (want[0] + dp - 1) / dp;
  for (const char* key : {"exp_avg", "exp_avg_sq"}) {
    const Value* t = entry.as_dict().Find(key);
    if (!t) continue;
    if (!t->is_tensor()) throw Error(where + ": state[" + std::to_string(id) + "]['" + key + "'] is a " + t->kind_name());
    if (t->as_tensor().shape() != want)
      throw Error(where + ": state[" + std::to_string(id) + "]['" + key + "'] has shape " + ckpt::ShapeString(t->as_tensor().shape()) +
                  " but parameter " + std::to_string(id) + " in NNM's group order is " + m.name[id] + " of shape " +
                  ckpt::ShapeString(m.shape.at(m.name[id])) + (dp > 1 ? " (a ZeRO-1 shard of " + std::to_string(dp) + ")" : "") +
                  ": the optimizer state does not belong to this model");
  }
}

Value ConvertOptimizer(const Value& osd, const IdMap& m, const std::string& where) {
  if (!osd.is_dict()) throw Error(where + " is a " + osd.kind_name() + ", not an optimizer state dict");
  Value out = Value::NewDict();
  out.as_dict().Set("state", CheckedById(osd.as_dict().At("state"), m, where + "['state']",
                                      [&](int64_t id, const Value& e) { CheckMoments(m, id, e, 1, where + "['state']"); }));
  out.as_dict().Set("param_groups", osd.as_dict().At("param_groups"));  // checked by BuildIdMap
  return out;
}

Value ConvertZero1(const Value& z, const IdMap& m, int dp, const std::string& where) {
  if (!z.is_dict()) throw Error(where + ": is a " + z.kind_name() + ", not a ZeRO-1 optimizer state dict");
  const Dict& in = z.as_dict();
  if (!in.Find("base_state")) throw Error(where + ": has no 'base_state' (not a ZeRO-1 optimizer file)");
  Value out = Value::NewDict(in.ordered);
  for (const auto& [k, v] : in.items) {
    const std::string key = k.is_str() ? k.as_str() : "";
    if (key == "base_state") {
      out.as_dict().items.emplace_back(k, CheckedById(v, m, where + "['base_state']", [&](int64_t id, const Value& e) {
        CheckMoments(m, id, e, dp, where + "['base_state']");
      }));
    } else if (key == "shape_info") {
      out.as_dict().items.emplace_back(k, CheckedById(v, m, where + "['shape_info']", [&](int64_t id, const Value& s) {
        if (ShapeOf(s, where + "['shape_info'][" + std::to_string(id) + "]") != m.shape.at(m.name[id]))
          throw Error(where + "['shape_info'][" + std::to_string(id) + "] does not match " + m.name[id] + " " +
                      ckpt::ShapeString(m.shape.at(m.name[id])));
      }));
    } else if (key == "sharded_master_weights" || key == "state") {
      out.as_dict().items.emplace_back(k, CheckedById(v, m, where + "['" + key + "']", [](int64_t, const Value&) {}));
    } else {  // param_groups (checked by BuildIdMap) and anything else, as they are
      out.as_dict().items.emplace_back(k, v);
    }
  }
  return out;
}

void AddFile(ConvertPlan& plan, const std::string& relpath, Value value, bool weights_only, bool xser,
             const std::string& source, int unit) {
  std::vector<ckpt::XserPart> parts;
  if (xser) parts = ckpt::SplitForXser(relpath, value);
  else parts.push_back({relpath, std::move(value)});
  for (auto& part : parts) {
    PlannedFile f;
    // xser reference trees hold TensorReference objects: never weights-only.
    const bool refs = xser && !part.value.is_tensor() && part.path == relpath;
    f.file = {part.path, std::move(part.value), {.weights_only = weights_only && !refs && !part.path.ends_with(".info.pt"),
                                                 .drop_source_pages = true}};
    f.source = source;
    f.unit = unit;
    std::set<const ckpt::Storage*> seen;
    CountTensors(f.file.value, seen, &f.tensors, &f.bytes);
    plan.files.push_back(std::move(f));
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
    if (at_segment && d > end && (d == key.size() || key[d] == '.')) {
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
  const int tp = src.tp, pp = src.pp;
  plan.grid = {tp, pp, std::max(1, src.zero1_dp), src.zero1_dp > 0};

  // Step and epoch agree across ranks.
  auto top_int = [&](const RankInput& in, const char* key) -> int64_t {
    const Value* v = in.checkpoint.as_dict().Find(key);
    if (!v) throw Error(in.path + ": has no '" + std::string(key) + "'");
    return IntOf(*v, in.path + ": '" + key + "'");
  };
  for (const auto& in : inputs)
    if (!in.checkpoint.is_dict()) throw Error(in.path + ": holds a " + in.checkpoint.kind_name() + ", not a Lightning checkpoint dict");
  plan.global_step = top_int(inputs[0], "global_step");
  for (const auto& in : inputs)
    if (top_int(in, "global_step") != plan.global_step)
      throw Error(in.path + ": global_step " + std::to_string(top_int(in, "global_step")) + " differs from " + inputs[0].path +
                  " (" + std::to_string(plan.global_step) + "): the ranks are from different saves");
  if (const Value* e = inputs[0].checkpoint.as_dict().Find("epoch")) plan.epoch = IntOf(*e, inputs[0].path + ": 'epoch'");
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
      }
    }
    for (size_t c = 0; c < n_chunks; ++c) plan.layers[c][p] = LayerCount(ref[c]);
  }
  // Megatron's interleaved order: chunk 0 of every stage, then chunk 1, ...
  std::vector<std::vector<int>> offset(n_chunks, std::vector<int>(pp));
  for (size_t c = 0; c < n_chunks; ++c)
    for (int p = 0; p < pp; ++p) offset[c][p] = plan.total_layers, plan.total_layers += plan.layers[c][p];
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
  for (int p = 0; p < pp; ++p)
    for (int t = 0; t < tp; ++t) {
      const int unit = p * tp + t;
      const RankInput& in = inputs[unit];
      Value model = Value::NewDict(/*ordered=*/true);
      std::vector<std::pair<std::string, std::vector<int64_t>>> params;
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
          if (model.as_dict().Find(name)) throw Error(chunks[unit][c].where + ": two entries become " + name);
          if (t == 0) plan.renames[p].push_back({k.as_str(), name});
          model.as_dict().items.emplace_back(Value(name), v);
          if (!IsBuffer(name)) params.emplace_back(name, v.as_tensor().shape());
        }
      const ckpt::RankCoord rank{0, t, p};
      AddFile(plan, "model/" + ckpt::RankFileName(rank), model, true, opts.save_xser, in.path, unit);
      if (opts.weights_only) continue;

      if (src.zero1_dp > 0) {
        // Group sizes come from the ZeRO-1 files' own param_groups.
        for (int d = 0; d < src.zero1_dp; ++d) {
          const std::string& zp = in.zero1_paths[d];
          const Value& z = in.zero1[d];
          if (!z.is_dict() || !z.as_dict().Find("param_groups"))
            throw Error(zp + ": has no 'param_groups' (not a ZeRO-1 optimizer file)");
          const IdMap m = BuildIdMap(params, z.as_dict().At("param_groups"), zp);
          AddFile(plan, "optim/" + ckpt::RankFileName({d, t, p}), ConvertZero1(z, m, src.zero1_dp, zp), false,
                  opts.save_xser, zp, unit);
        }
      } else {
        const Value* states = in.checkpoint.as_dict().Find("optimizer_states");
        if (!states || !states->is_seq() || states->as_seq().items.empty())
          throw Error(in.path + ": has no optimizer state ('optimizer_states' is " +
                      (states ? states->kind_name() + (states->is_seq() ? " of " + std::to_string(states->as_seq().items.size()) : "") : std::string("absent")) +
                      " and there are no ZeRO-1 optim/ folders); pass --weights_only to convert the weights alone");
        const Value& osd = states->as_seq().items[0];
        const std::string where = in.path + ": optimizer_states[0]";
        if (!osd.is_dict() || !osd.as_dict().Find("param_groups") || !osd.as_dict().Find("state"))
          throw Error(where + " is not a torch optimizer state dict (needs 'state' and 'param_groups')");
        const IdMap m = BuildIdMap(params, osd.as_dict().At("param_groups"), where);
        AddFile(plan, "optim/" + ckpt::RankFileName(rank), ConvertOptimizer(osd, m, where), false, opts.save_xser, in.path, unit);
      }
    }
  for (const auto& d : dropped) plan.notes.push_back("dropped " + d + ": not a tensor, so not model state");

  if (!opts.weights_only) {
    const Dict& top = inputs[0].checkpoint.as_dict();
    Value user = Value::NewDict();
    user.as_dict().Set("epoch", Value(plan.epoch));
    user.as_dict().Set("global_step", Value(plan.global_step));
    user.as_dict().Set("consumed_samples", Value(plan.consumed_samples));
    for (const char* key : {"loops", "lr_schedulers", "pytorch-lightning_version"})
      if (const Value* v = top.Find(key)) user.as_dict().Set(key, *v);
    Value sched;
    if (const Value* ls = top.Find("lr_schedulers"); ls && ls->is_seq() && !ls->as_seq().items.empty() && ls->as_seq().items[0].is_dict()) {
      sched = ls->as_seq().items[0];
    } else {
      sched = Value::NewDict();
      sched.as_dict().Set("last_epoch", Value(plan.global_step));
      plan.notes.push_back("no lr_schedulers state in " + inputs[0].path + "; scheduler.pt records the step only");
    }
    AddFile(plan, ckpt::kSchedulerFile, sched, false, false, inputs[0].path, -1);
    AddFile(plan, ckpt::kUserContentFile, user, false, false, inputs[0].path, -1);
  }
  return plan;
}

}  // namespace convert

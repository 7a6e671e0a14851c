#include "convert/nnm_optimizer.h"

#include <algorithm>
#include <map>

#include "ckpt/util/error.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/pt/tensor.h"
#include "convert/nnm_grouping.h"

namespace convert {
namespace {

using ckpt::Error;
using ckpt::Grouping;
using ckpt::Value;

std::string SizesString(const std::vector<size_t>& sizes) {
  std::string s;
  for (size_t n : sizes) s += (s.empty() ? "" : "/") + std::to_string(n);
  return s.empty() ? "none" : s;
}

const ckpt::Dict& DictAt(const Value& v, const std::string& where) {
  if (!v.is_dict()) throw Error(where + " is a " + v.kind_name() + ", not a dict");
  return v.as_dict();
}

std::vector<size_t> FileGroupSizes(const SourceOptimizer& so) {
  return ckpt::ParamGroupSizes(ckpt::OptimizerFileView(so.state_dict, so.where).param_groups(), so.where + ": param_groups");
}

// The shape a moment of a parameter of `shape` has in this file: itself, or
// under ZeRO-1 one of `dp` chunks of dim 0 padded to a multiple of dp.
std::vector<int64_t> StoredShape(std::vector<int64_t> shape, int dp) {
  if (dp > 0 && !shape.empty()) shape[0] = (shape[0] + dp - 1) / dp;
  return shape;
}

// Why `g` does not fit the file; empty when it does.
std::string Misfit(const Grouping& g, const std::vector<size_t>& file_sizes, const std::map<std::string, std::vector<int64_t>>& shapes,
                   const SourceOptimizer& so) {
  if (g.GroupSizes() != file_sizes)
    return "needs " + std::to_string(g.groups) + " group" + (g.groups == 1 ? "" : "s") + " of " + SizesString(g.GroupSizes()) +
           " parameters";
  const ckpt::Dict& top = so.state_dict.as_dict();
  auto check_by_id = [&](const char* key, auto&& check) -> std::string {
    const Value* v = top.Find(key);
    if (!v) return "";
    for (const auto& [k, e] : DictAt(*v, so.where + "['" + key + "']").items) {
      const int64_t id = ckpt::AsInteger(k, so.where + "['" + key + "'] key");
      if (id < 0 || id >= static_cast<int64_t>(g.order.size()))
        return std::string(key) + " has parameter id " + std::to_string(id) + " of " + std::to_string(g.order.size());
      const std::string& name = g.order[id].name;
      std::string why = check(id, name, e);
      if (!why.empty()) return std::string(key) + "[" + std::to_string(id) + "]" + why;
    }
    return "";
  };
  auto tensor_fits = [&](const std::string& name, const Value& t) -> std::string {
    const auto want = StoredShape(shapes.at(name), so.zero1_dp);
    if (!t.is_tensor()) return " is a " + t.kind_name() + ", not a tensor";
    if (t.as_tensor().shape() == want) return "";
    return " has shape " + ckpt::ShapeString(t.as_tensor().shape()) + " but would be " + name + " " + ckpt::ShapeString(want);
  };
  auto moments_fit = [&](int64_t, const std::string& name, const Value& e) -> std::string {
    if (!e.is_dict()) return " is a " + e.kind_name() + ", not a dict of moments";
    for (const char* m : {"exp_avg", "exp_avg_sq"})
      if (const Value* t = e.as_dict().Find(m)) {
        const std::string why = tensor_fits(name, *t);
        if (!why.empty()) return "['" + std::string(m) + "']" + why;
      }
    return "";
  };
  std::string why = check_by_id(ckpt::OptimizerFileView(so.state_dict, so.where).moments_key(), moments_fit);
  if (why.empty() && so.zero1_dp) {
    why = check_by_id("shape_info", [&](int64_t, const std::string& name, const Value& s) -> std::string {
      std::vector<int64_t> dims;
      if (!s.is_seq()) return " is a " + s.kind_name() + ", not a shape";
      for (const auto& d : s.as_seq().items) dims.push_back(ckpt::AsInteger(d, so.where + "['shape_info'] dim"));
      return dims == shapes.at(name) ? "" : " is " + ckpt::ShapeString(dims) + " but would be " + name + " " + ckpt::ShapeString(shapes.at(name));
    });
    if (why.empty())
      why = check_by_id("sharded_master_weights", [&](int64_t, const std::string& name, const Value& t) { return tensor_fits(name, t); });
  }
  return why;
}

// {id: x} renumbered through `to_target` and sorted by the new id.
// `also`: (source id, target id) pairs whose entry is written a second time
// (GPT's tied output copy, from the embedding's).
Value Renumbered(const Value& by_id, const std::vector<int64_t>& to_target, const std::string& where,
                 const std::vector<std::pair<int64_t, int64_t>>& also) {
  std::vector<std::pair<int64_t, Value>> out;
  for (const auto& [k, v] : DictAt(by_id, where).items) {
    const int64_t id = ckpt::AsInteger(k, where + " key");
    if (id < 0 || id >= static_cast<int64_t>(to_target.size()))
      throw Error(where + ": parameter id " + std::to_string(id) + " is out of range (the rank has " + std::to_string(to_target.size()) +
                  " parameters)");
    out.emplace_back(to_target[id], v);
    for (const auto& [from, to] : also)
      if (from == id) out.emplace_back(to, v.is_tensor() ? Value(v.as_tensor().Clone()) : v);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Value d = Value::NewDict(by_id.as_dict().ordered);
  for (auto& [k, v] : out) d.as_dict().items.emplace_back(Value(k), std::move(v));
  return d;
}

// Whether `osd` is an optimizer file of the form asked for: a dict with
// param_groups and the form's moments (state, or ZeRO-1's base_state).
bool IsOptimizerFile(const Value& osd, bool zero1) {
  if (!osd.is_dict()) return false;
  const ckpt::OptimizerFileView file(osd, "");
  return file.top().Find("param_groups") && (zero1 ? file.zero1() : file.top().Find("state") != nullptr);
}

}  // namespace

SourceOptimizer PlainOptimizer(const Value& checkpoint, const std::string& path, bool* found) {
  const Value* states = checkpoint.as_dict().Find("optimizer_states");
  *found = states && !(states->is_seq() && states->as_seq().items.empty()) && !states->is_none();
  if (!*found) return {};
  if (!states->is_seq()) throw Error(path + ": 'optimizer_states' is a " + states->kind_name() + ", not Lightning's list of optimizer states");
  if (states->as_seq().items.size() != 1)
    throw Error(path + ": 'optimizer_states' holds " + std::to_string(states->as_seq().items.size()) +
                " optimizers; NNM trains with one");
  SourceOptimizer so{path, path + ": optimizer_states[0]", states->as_seq().items[0], 0};
  if (!IsOptimizerFile(so.state_dict, /*zero1=*/false))
    throw Error(so.where + " is not a torch optimizer state dict (needs 'state' and 'param_groups')");
  return so;
}

SourceOptimizer Zero1Optimizer(const Value& file, const std::string& path, int dp) {
  if (file.is_dict())
    throw Error(path + ": holds a dict, but NNM's ZeRO-1 optimizer file holds Lightning's 'optimizer_states' list "
                "(its element 0 is the ZeRO-1 state dict); this file was not written by NNM");
  if (!file.is_seq() || file.as_seq().items.size() != 1)
    throw Error(path + ": holds " + (file.is_seq() ? "a list of " + std::to_string(file.as_seq().items.size()) : "a " + file.kind_name()) +
                ", not NNM's one-element 'optimizer_states' list");
  SourceOptimizer so{path, path + ": optimizer_states[0]", file.as_seq().items[0], dp};
  if (!IsOptimizerFile(so.state_dict, /*zero1=*/true))
    throw Error(so.where + " is not a ZeRO-1 optimizer state dict (needs 'base_state' and 'param_groups')");
  return so;
}

Grouping FindSourceGrouping(const std::vector<ckpt::ParamInfo>& params, const SourceOptimizer& so) {
  const std::vector<size_t> sizes = FileGroupSizes(so);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : params) shapes[p.name] = p.shape;
  std::vector<Grouping> fits;
  std::string tried;
  for (auto& g : NnmGroupingCandidates(params)) {
    const std::string why = Misfit(g, sizes, shapes, so);
    if (why.empty()) fits.push_back(std::move(g));
    else tried += "\n  " + g.id + " (" + g.description + "): " + why;
  }
  if (fits.empty())
    throw Error(so.where + ": its " + std::to_string(sizes.size()) + " parameter group(s) of " + SizesString(sizes) +
                " ids fit no grouping NNM builds for this rank's " + std::to_string(params.size()) +
                " parameters, so no optimizer id can be tied to a parameter:" + tried);
  for (const auto& g : fits)
    if (!g.SameTies(fits[0])) {
      size_t i = 0;
      while (i < g.order.size() && g.order[i].name == fits[0].order[i].name) ++i;
      throw Error(so.where + ": groupings " + fits[0].id + " and " + g.id + " both fit its " + SizesString(sizes) +
                  " ids and moment shapes, but tie them differently (id " + std::to_string(i) + " is " + fits[0].order[i].name +
                  " under " + fits[0].id + ", " + g.order[i].name + " under " + g.id +
                  "); refusing to guess.\n  " + fits[0].id + ": " + fits[0].description + "\n  " + g.id + ": " + g.description);
    }
  return fits[0];
}

Value RegroupOptimizerState(const SourceOptimizer& so, const Grouping& from, const Grouping& to) {
  std::map<std::string, int64_t> target_id;
  for (size_t i = 0; i < to.order.size(); ++i) target_id[to.order[i].name] = static_cast<int64_t>(i);
  std::vector<int64_t> to_target;
  std::map<std::string, int64_t> source_id;
  for (const auto& s : from.order) {
    const auto it = target_id.find(s.name);
    if (it == target_id.end()) throw Error(so.where + ": '" + s.name + "' has no place in the grouping written (" + to.id + ")");
    source_id[s.name] = static_cast<int64_t>(to_target.size());
    to_target.push_back(it->second);
  }
  // GPT's tied output copy NxDT lists beside the embedding (pp = 1): the embedding's state, again.
  std::vector<std::pair<int64_t, int64_t>> also;
  for (size_t i = 0; i < to.order.size(); ++i) {
    if (source_id.count(to.order[i].name)) continue;
    const auto emb = source_id.find(ckpt::ParamName(ckpt::ModelFormat{}, ckpt::Module::kEmbedding));  // NNM's: Megatron-style
    if (to.order[i].name != ckpt::kTiedOutputCopy || emb == source_id.end())
      throw Error(so.where + ": holds no state for '" + to.order[i].name + "'");
    also.emplace_back(emb->second, static_cast<int64_t>(i));
  }
  const ckpt::Dict& in = so.state_dict.as_dict();
  Value out = Value::NewDict(in.ordered);
  for (const auto& [k, v] : in.items) {
    const std::string key = k.is_str() ? k.as_str() : "";
    if (key == "param_groups") out.as_dict().items.emplace_back(k, ckpt::ParamGroupsFor(v, to));
    else if (ckpt::OptimizerFileView::KeyedById(key))
      out.as_dict().items.emplace_back(k, Renumbered(v, to_target, so.where + "['" + key + "']", also));
    else out.as_dict().items.emplace_back(k, v);  // anything else, as it is
  }
  return out;
}

}  // namespace convert

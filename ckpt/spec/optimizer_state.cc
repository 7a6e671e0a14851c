#include "ckpt/spec/optimizer_state.h"

#include <algorithm>
#include <set>

#include "ckpt/spec/partition.h"
#include "ckpt/util/error.h"

namespace ckpt {

Value OptimizerFile::ToValue() const {
  Value state = Value::NewDict(), shapes = Value::NewDict(), masters = Value::NewDict();
  bool any_master = false;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamState& p = params[i];
    const Value id(static_cast<int64_t>(i));
    // A parameter without state (LoRA's frozen base: torch's AdamW keeps none without a gradient).
    if (p.exp_avg.is_none()) {
      if (zero1) throw Error("a ZeRO-1 state dict has a shard for every parameter; parameter " + std::to_string(i) + " has no state");
      continue;
    }
    Value s = Value::NewDict();
    s.as_dict().Set("step", p.step);
    s.as_dict().Set("exp_avg", p.exp_avg);
    s.as_dict().Set("exp_avg_sq", p.exp_avg_sq);
    state.as_dict().items.emplace_back(id, std::move(s));
    std::vector<Value> dims;
    for (int64_t d : p.shape) dims.emplace_back(d);
    // A list, not torch.Size: NxD saves through torch_xla's ToXlaTensorArena, which rewrites
    // tuples and torch.Size into lists (NxD parallel_layers/utils.py move_all_tensor_to_cpu).
    shapes.as_dict().items.emplace_back(id, Value::NewSeq(SeqKind::kList, dims));
    if (p.master) masters.as_dict().items.emplace_back(id, *p.master), any_master = true;
  }
  Value out = Value::NewDict();
  auto& d = out.as_dict();
  if (!zero1) {
    if (any_master) throw Error("a plain AdamW state dict has no place for master weights");
    d.Set("state", state);
    d.Set("param_groups", param_groups);
    return out;
  }
  d.Set("state", Value::NewDict());
  d.Set("param_groups", param_groups);
  d.Set("base_state", state);
  d.Set("shape_info", shapes);
  if (any_master) d.Set("sharded_master_weights", masters);
  return out;
}

namespace {

const Dict& DictNamed(const Value& v, const std::string& where) {
  if (!v.is_dict()) throw Error(where + " is a " + v.kind_name() + ", not a dict");
  return v.as_dict();
}

}  // namespace

OptimizerFileView::OptimizerFileView(const Value& file, std::string where) : top_(&DictNamed(file, where)), where_(std::move(where)) {}

std::optional<std::string> OptimizerFileView::UnknownKey() const {
  static const std::set<std::string> kKnown{"state", "param_groups", "base_state", "shape_info", "sharded_master_weights"};
  for (const auto& [k, _] : top_->items) {
    const std::string key = k.is_str() ? k.as_str() : "?";
    if (!kKnown.count(key)) return key;
  }
  return std::nullopt;
}

bool OptimizerFileView::KeyedById(const std::string& key) {
  return key == "state" || key == "base_state" || key == "shape_info" || key == "sharded_master_weights";
}

const Dict& OptimizerFileView::Moments() const {
  const char* key = moments_key();
  return DictNamed(top_->At(key), where_ + ": '" + key + "'");
}

void OptimizerFileView::CheckZero1StateEmpty() const {
  if (!DictNamed(top_->At("state"), where_ + ": 'state'").items.empty())
    throw Error(where_ + ": ZeRO-1 'state' is not empty; its entries have no known place in a re-laid file");
}

const Dict* OptimizerFileView::ShapeInfo() const { return zero1() ? &DictNamed(top_->At("shape_info"), where_ + ": 'shape_info'") : nullptr; }

const Dict* OptimizerFileView::Masters() const {
  const Value* m = top_->Find("sharded_master_weights");
  return m ? &DictNamed(*m, where_ + ": masters") : nullptr;
}

const Dict& OptimizerFileView::AdamWEntry(const Value& e, const std::string& at) {
  const Dict& entry = DictNamed(e, at);
  for (const auto& [k, _] : entry.items)
    if (!k.is_str() || (k.as_str() != "step" && k.as_str() != "exp_avg" && k.as_str() != "exp_avg_sq"))
      throw Error(at + " holds '" + (k.is_str() ? k.as_str() : "?") + "', not AdamW's step, exp_avg and exp_avg_sq");
  return entry;
}

const Value* EntryById(const Dict& by_id, size_t id) {
  for (const auto& [k, v] : by_id.items)
    if (k.is_int() && k.as_int() == static_cast<int64_t>(id)) return &v;
  return nullptr;
}

std::vector<size_t> ParamGroupSizes(const Value& groups, const std::string& where, std::vector<int64_t>* ids_out) {
  if (!groups.is_seq() || groups.as_seq().items.empty())
    throw Error(where + " must list the optimizer's parameter groups, found " +
                (groups.is_seq() ? "an empty list" : "a " + groups.kind_name()));
  std::vector<size_t> sizes;
  std::vector<int64_t> all;
  std::vector<std::string> group_of;
  for (size_t g = 0; g < groups.as_seq().items.size(); ++g) {
    const std::string at = where + "[" + std::to_string(g) + "]";
    const Value& group = groups.as_seq().items[g];
    if (!group.is_dict()) throw Error(at + " is a " + group.kind_name() + ", not a dict");
    const Value& ids = group.as_dict().At("params");
    if (!ids.is_seq()) throw Error(at + ".params is a " + ids.kind_name() + ", not a list of ids");
    for (const Value& id : ids.as_seq().items) all.push_back(AsInteger(id, at + ".params item")), group_of.push_back(at);
    sizes.push_back(ids.as_seq().items.size());
  }
  const int64_t n = static_cast<int64_t>(all.size());
  for (int64_t k = 0; k < n; ++k) {
    const int64_t id = all[k];
    if (id == k || (id > k && id < n && all[id] == id)) continue;
    throw Error(group_of[k] + ".params is not numbered in order (torch numbers group 0's ids from 0, then group 1's; a parameter "
                "listed twice takes its later position's id)");
  }
  if (ids_out) *ids_out = std::move(all);
  return sizes;
}

Value ParamGroupsFor(const Value& source, const Grouping& to) {
  if (!source.is_seq() || source.as_seq().items.empty()) throw Error("param_groups must be a non-empty list");
  const auto& src = source.as_seq().items;
  Value out = Value::List();
  for (int g = 0; g < to.groups; ++g) {
    Value ids = Value::List();
    for (size_t i = 0; i < to.order.size(); ++i)
      if (to.order[i].group == g) ids.as_seq().items.emplace_back(static_cast<int64_t>(i));
    const bool decays = to.group_decays.at(g);
    const Value* from = nullptr;
    for (const Value& s : src) {
      if (!s.is_dict()) throw Error("param_groups holds a " + s.kind_name() + ", not a dict");
      const Value* wd = s.as_dict().Find("weight_decay");
      const bool zero = wd && ((wd->is_float() && wd->as_float() == 0.0) || (wd->is_int() && wd->as_int() == 0));
      if (zero != decays) {
        from = &s;
        break;
      }
    }
    const bool borrowed = from == nullptr;
    if (borrowed) from = &src[0];
    Value pg = Value::NewDict(from->as_dict().ordered);
    pg.as_dict().items = from->as_dict().items;
    if (borrowed && !decays) pg.as_dict().Set("weight_decay", Value(0.0));
    pg.as_dict().Set("params", ids);
    out.as_seq().items.push_back(pg);
  }
  return out;
}

int64_t Zero1SavedAsOneShard(const Value& file) {
  if (!file.is_dict()) return 0;
  const Value* base = file.as_dict().Find("base_state");
  const Value* shapes = file.as_dict().Find("shape_info");
  if (!base || !shapes || !base->is_dict() || !shapes->is_dict()) return 0;
  for (const auto& [id, entry] : base->as_dict().items) {
    if (!id.is_int() || id.as_int() < 0) continue;
    const Value* shape = EntryById(shapes->as_dict(), static_cast<size_t>(id.as_int()));
    const Value* avg = entry.is_dict() ? entry.as_dict().Find("exp_avg") : nullptr;
    if (!shape || !shape->is_seq() || shape->as_seq().items.empty() || !avg || !avg->is_tensor() || avg->as_tensor().shape().empty()) continue;
    const Value& r = shape->as_seq().items[0];
    if (!r.is_int()) continue;
    const int64_t rows = r.as_int(), shard = avg->as_tensor().shape()[0];
    if (shard > 0 && shard < rows) return (rows + shard - 1) / shard;
  }
  return 0;
}

namespace {

// dims of a shape_info entry (a list, or torch.Size as a tuple), or nullopt.
std::optional<std::vector<int64_t>> ShapeInfoDims(const Value* s) {
  if (!s || !s->is_seq() || s->as_seq().items.empty()) return std::nullopt;
  std::vector<int64_t> dims;
  for (const Value& d : s->as_seq().items) {
    if (!d.is_int() || d.as_int() < 0) return std::nullopt;
    dims.push_back(d.as_int());
  }
  return dims;
}

}  // namespace

std::string Zero1OneShardMessage(const std::string& where, int64_t dp) {
  return where + ": NxDT saved a dp=" + std::to_string(dp) +
         " ZeRO-1 optimizer as one shard; the other ranks' moments were never written (NxDT passes zero1_optimizer from "
         "cfg.wrap_with_zero, which NxDT configs do not set). " + kWeightsOnlyAdvice;
}

std::string Zero1ShardProblem(const Value& file, int dp, const std::string& where, const std::function<std::string(int64_t)>& name_of) {
  if (!file.is_dict() || dp < 1) return "";
  const Value* base = file.as_dict().Find("base_state");
  const Value* shapes = file.as_dict().Find("shape_info");
  const Value* masters = file.as_dict().Find("sharded_master_weights");
  if (!base || !base->is_dict()) return "";
  if (!shapes || !shapes->is_dict()) return where + ": a ZeRO-1 file (base_state) without a shape_info dict";
  auto param = [&](int64_t id) { return name_of ? name_of(id) : "parameter id " + std::to_string(id); };
  for (const auto& [key, entry] : base->as_dict().items) {
    if (!key.is_int() || key.as_int() < 0) return where + ": base_state has a key that is not a parameter id";
    const int64_t id = key.as_int();
    const auto dims = ShapeInfoDims(EntryById(shapes->as_dict(), static_cast<size_t>(id)));
    if (!dims) return where + ": " + param(id) + " has no shape_info (a list of dims), so its shards cannot be checked";
    const int64_t rows = (*dims)[0], want = Zero1ShardRows(rows, dp);
    std::vector<std::pair<std::string, const Value*>> fields;
    if (entry.is_dict())
      for (const char* f : {"exp_avg", "exp_avg_sq"}) fields.emplace_back(f, entry.as_dict().Find(f));
    if (masters && masters->is_dict()) fields.emplace_back("sharded_master_weights", EntryById(masters->as_dict(), static_cast<size_t>(id)));
    for (const auto& [field, v] : fields) {
      if (!v || !v->is_tensor()) continue;  // absent or not a tensor: the reader names it
      const std::vector<int64_t>& got = v->as_tensor().shape();
      const std::string at = where + ": " + param(id) + " " + field;
      if (got.size() != dims->size() || !std::equal(got.begin() + (got.empty() ? 0 : 1), got.end(), dims->begin() + 1))
        return at + " has shape " + ShapeString(got) + ", which is no dim-0 shard of its shape_info " + ShapeString(*dims);
      if (got[0] == want) continue;
      // Rows of 1/(dp * cp): sharded over more ranks than the tag has files for.
      for (int64_t cp = 2; got[0] < want && cp <= rows; ++cp) {
        if (Zero1ShardRows(rows, static_cast<int>(dp * cp)) != got[0]) continue;
        return at + " holds " + std::to_string(got[0]) + " of its " + std::to_string(rows) + " rows (shape_info " + ShapeString(*dims) +
               "), where a dp=" + std::to_string(dp) + " ZeRO-1 shard holds " + std::to_string(want) + ": the rows are 1/(dp × cp) = 1/(" +
               std::to_string(dp) + " × " + std::to_string(cp) + "), a context-parallel save (cp=" + std::to_string(cp) +
               "). NxD shards ZeRO-1 over the dp × cp ranks (trainer.py initialize_optimizer_from_class, "
               "get_zero1_sharding_groups) but names each optimizer file by its dp rank alone (checkpoint.py save_checkpoint, "
               "_get_path), so the " + std::to_string(cp) + " cp ranks of each dp rank wrote the same file and " + std::to_string(cp - 1) +
               " of every " + std::to_string(cp) + " shards were lost; the optimizer state does not cover the parameter. " + kWeightsOnlyAdvice;
      }
      return at + " holds " + std::to_string(got[0]) + " of its " + std::to_string(rows) + " rows (shape_info " + ShapeString(*dims) +
             "), not the " + std::to_string(want) + " of a dp=" + std::to_string(dp) + " ZeRO-1 shard (rows padded to a multiple of " +
             std::to_string(dp) + ", one chunk per dp rank): the shards do not cover the parameter";
    }
  }
  return "";
}

}  // namespace ckpt

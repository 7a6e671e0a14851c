#include "ckpt/shard/tag_optimizer.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "ckpt/spec/ep_zero1_state.h"
#include "ckpt/spec/lora.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

std::vector<size_t> NonEmpty(std::vector<size_t> sizes) {
  sizes.erase(std::remove(sizes.begin(), sizes.end(), size_t{0}), sizes.end());
  return sizes;
}

// NeuronEPZero1Optimizer syncs both inner optimizers' param_groups from its
// own before each step (_sync_param_groups), so the expert groups' hyperparameters
// are the non-expert ones', which the reader keeps; a file where they differ would lose some.
void CheckSameHyperparameters(const EpZero1File& file, const std::string& where) {
  const auto& a = file.non_expert.param_groups.as_seq().items;
  const auto& b = file.expert.param_groups.as_seq().items;
  for (size_t g = 0; g < a.size() && g < b.size(); ++g)
    for (const auto& [k, v] : a[g].as_dict().items)
      if (k.is_str() && k.as_str() != "params" && (!b[g].as_dict().Find(k.as_str()) || !DeepEqual(v, *b[g].as_dict().Find(k.as_str()))))
        throw Error(where + ": the expert optimizer's param group " + std::to_string(g) + " has another '" + k.as_str() +
                    "' than the non-expert one's, where NeuronEPZero1Optimizer keeps them equal (shardkit would lose one)");
  if (a.size() != b.size())
    throw Error(where + ": the non-expert and expert optimizers have " + std::to_string(a.size()) + " and " + std::to_string(b.size()) +
                " param groups, where NeuronEPZero1Optimizer filters the same groups for each");
}

// A pipeline stage's parameters, as its optimizer files list them.
struct OptimizerStage {
  int p = 0;
  std::vector<StageParam> params;
  std::vector<std::string> names;
  std::string same_stage_copy;
  const StageParam& Param(const std::string& name) const { return params[std::find(names.begin(), names.end(), name) - names.begin()]; }
};

// One optimizer file being read: where it is, its parts, and its ids' parameters.
struct OptimizerFileRead {
  int t = 0, d = 0;
  std::string rel, where;
  bool zero1 = false;
  const Dict* state = nullptr;
  const Dict* masters = nullptr;
  const Dict* shapes = nullptr;
  Grouping order;
  std::vector<int64_t> file_ids;  // each position's id in the file (torch's: shared by a parameter listed twice)
};

class OptimizerReader {
 public:
  OptimizerReader(TagFiles& files, TagDescription& layout, const std::vector<ParamRule>& params, const std::optional<GroupingRule>& recorded,
                  ExtentIndex& index, TagOptimizerState* out)
      : files_(files), L_(layout), params_(params), recorded_(recorded), index_(index), out_(out) {}

  void Run() {
    for (int p = 0; p < L_.grid.pp; ++p) {
      OptimizerStage stage;
      stage.p = p;
      stage.params = StageParameters(params_, L_.stage_bounds, p, L_.tied_naming, L_.virtual_stages);
      for (const auto& sp : stage.params) stage.names.push_back(sp.name);
      stage.same_stage_copy = SameStageTiedCopy(stage.params);
      for (int t = 0; t < L_.grid.tp; ++t)
        for (int d = 0; d < (L_.grid.zero1 ? L_.grid.dp : 1); ++d) ReadFile(stage, t, d);
    }
  }

 private:
  void ReadFile(const OptimizerStage& stage, int t, int d);
  void ReadEpFile(const OptimizerStage& stage, const OptimizerFileRead& f, const Value& v);
  void IndexMoments(const ParamRule& rule, const AxisCoords& at, int64_t lo, int64_t shards, const ParamState& ps, const OptimizerFileRead& f,
                    const std::string& at_text);
  // The parts a grouping's ids are numbered in: itself, or (NeuronEPZero1Optimizer) its non-expert and expert parts.
  std::vector<Grouping> Parts(const Grouping& g, bool by_experts) const;
  void CheckSharedIds(const OptimizerStage& stage, const OptimizerFileRead& f) const;
  // Indexes id's state; returns the key it claimed in the file's state, or nullopt for a tied copy without state.
  std::optional<int64_t> ReadParam(const OptimizerStage& stage, const OptimizerFileRead& f, size_t id);
  void CheckTiedCopyMoments(const OptimizerFileRead& f, const ParamRule& rule, const Dict& entry, const std::string& at) const;
  Grouping Ids(const Value& groups, const OptimizerStage& stage, const std::string& where, std::vector<int64_t>* file_ids);
  Grouping Choose(const std::vector<std::vector<size_t>>& sizes, bool by_experts, const OptimizerStage& stage, const std::string& where);

  TagFiles& files_;
  TagDescription& L_;
  const std::vector<ParamRule>& params_;
  const std::optional<GroupingRule>& recorded_;
  ExtentIndex& index_;
  TagOptimizerState* out_;
  ExtentIndex::Holders owner_;
  bool first_ = true;
};

void OptimizerReader::ReadFile(const OptimizerStage& stage, int t, int d) {
  OptimizerFileRead f;
  f.t = t, f.d = d;
  f.rel = RankFilePath(RankFileKind::kOptim, {d, t, stage.p}), f.where = files_.Path(f.rel);
  const std::string& where = f.where;
  const Value v = files_.Load(f.rel);
  if (L_.grid.ep > 1) return ReadEpFile(stage, f, v);
  const OptimizerFileView file(v, where);
  f.zero1 = file.zero1();
  if (f.zero1 != L_.grid.zero1)
    throw Error(where + (f.zero1 ? ": is a ZeRO-1 state dict (base_state), but the tag has one optimizer file per stage"
                                 : ": is a plain state dict, but the tag has ZeRO-1 files for " + std::to_string(L_.grid.dp) + " dp ranks"));
  if (const auto key = file.UnknownKey()) throw Error(where + ": holds '" + *key + "', which ckpt-reshard does not know how to re-lay");
  f.order = Ids(file.param_groups(), stage, where, &f.file_ids);
  if (first_) out_->param_groups = file.param_groups(), L_.master_weights = file.top().Find("sharded_master_weights") != nullptr, first_ = false;
  // Shards of another size than dp's (a context-parallel save lost some) are told as such,
  // before a shape check would name one field without why.
  if (f.zero1)
    if (const std::string why = Zero1ShardProblem(v, L_.grid.dp, where, [&](int64_t id) {
          const std::string n = "parameter id " + std::to_string(id);
          return id < static_cast<int64_t>(f.order.order.size()) ? n + " (" + f.order.order[id].name + ")" : n;
        });
        !why.empty())
      throw Error(why);
  if (f.zero1) file.CheckZero1StateEmpty();
  f.state = &file.Moments();
  f.masters = file.Masters();
  if ((f.masters != nullptr) != L_.master_weights) throw Error(where + ": has master weights where other files have none, or the reverse");
  f.shapes = file.ShapeInfo();
  CheckSharedIds(stage, f);
  std::set<int64_t> claimed;
  for (size_t id = 0; id < f.order.order.size(); ++id)
    if (const auto key = ReadParam(stage, f, id)) claimed.insert(*key);
  for (const auto& [k, _] : f.state->items)
    if (!k.is_int() || !claimed.count(k.as_int()))
      throw Error(where + ": holds state for id " + (k.is_int() ? std::to_string(k.as_int()) : "'?'") + ", which none of stage " +
                  std::to_string(stage.p) + "'s " + std::to_string(f.order.order.size()) + " parameters has");
}

// GPT's tied weight listed twice (NeMo's groups at pp = 1): torch gives both positions the
// later one's id, so a plain state dict keys its state once, by that id; a ZeRO-1 one keys its
// shards by position, and NxD's gradient hook leaves the copy's shard without state (both
// observed: tests/data/upstream/nxdt_megatron). The state is read from the embedding's position.
void OptimizerReader::CheckSharedIds(const OptimizerStage& stage, const OptimizerFileRead& f) const {
  for (size_t id = 0; id < f.order.order.size(); ++id) {
    const int64_t shared = f.file_ids[id];
    if (shared == static_cast<int64_t>(id)) continue;
    const StageParam& a = stage.Param(f.order.order[id].name);
    const StageParam& b = stage.Param(f.order.order[shared].name);
    if (!b.tied_copy() || b.rule != a.rule)
      throw Error(f.where + ": param_groups give parameter " + std::to_string(id) + " (" + a.name + ") the id of parameter " +
                  std::to_string(shared) + " (" + b.name + "): torch shares an id only between two names of one tied parameter");
  }
}

std::optional<int64_t> OptimizerReader::ReadParam(const OptimizerStage& stage, const OptimizerFileRead& f, size_t id) {
  const std::string& name = f.order.order[id].name;
  const StageParam& sp = stage.Param(name);
  const ParamRule& rule = *sp.rule;
  const std::string at = f.where + ": parameter id " + std::to_string(id) + " (" + name + ")";
  const int64_t key = f.zero1 ? static_cast<int64_t>(id) : f.file_ids[id];
  const Value* e = EntryById(*f.state, static_cast<size_t>(key));
  if (!e && sp.tied_copy()) return std::nullopt;  // read from the embedding
  // LoRA trains only its adapters: the frozen base weights are listed in
  // param_groups but torch's AdamW keeps no state for them (no gradient).
  if (!e && L_.format.lora.on() && !IsLoraAdapterName(name)) return std::nullopt;
  if (!e) throw Error(at + " has no state");
  const Dict& entry = OptimizerFileView::AdamWEntry(*e, at);
  const auto local = LocalShape(rule, L_.format, L_.grid.tp, f.t);
  auto want = local;
  const int64_t rows = local[0];
  const int64_t shard = f.zero1 ? Zero1ShardRows(rows, L_.grid.dp) : rows;
  want[0] = shard;
  if (f.zero1) {
    const Value* s = EntryById(*f.shapes, id);
    std::vector<int64_t> dims;
    if (s && s->is_seq())
      for (const auto& x : s->as_seq().items) dims.push_back(AsInteger(x, at + " shape_info"));
    if (dims != local) throw Error(at + ": shape_info is " + (s ? ShapeString(dims) : "missing") + ", not its local shape " + ShapeString(local));
  }
  if (sp.tied_copy()) {  // the embedding's state, updated alike: read from the embedding
    CheckTiedCopyMoments(f, rule, entry, at);
    return key;
  }
  if (!out_->steps.count(rule.name)) out_->steps[rule.name] = entry.At("step");
  const std::pair<StateField, const Value*> fields[] = {{StateField::kExpAvg, &entry.At("exp_avg")},
                                                         {StateField::kExpAvgSq, &entry.At("exp_avg_sq")},
                                                         {StateField::kMaster, f.masters ? EntryById(*f.masters, id) : nullptr}};
  for (const auto& [field, val] : fields) {
    if (field == StateField::kMaster && !f.masters) continue;
    const std::string fat = at + " " + FieldName(field);
    if (!val) throw Error(fat + " is missing");
    const Tensor& x = IndexableTensor(*val, fat);
    if (x.shape() != want) throw Error(fat + " has shape " + ShapeString(x.shape()) + ", not " + ShapeString(want));
    index_.AddBoxes(rule, AxisCoords::Tp(L_.grid.tp, f.t), field, x, files_.FileOf(x, f.rel), f.d * shard, std::min((f.d + 1) * shard, rows),
                    owner_, x.dtype(), fat);
  }
  return key;
}

// Beside the embedding (pp = 1), the tied copy's moments must be the embedding's: a copy that
// differs would be lost. Not its master weight: NxD's gradient hook leaves that stale.
void OptimizerReader::CheckTiedCopyMoments(const OptimizerFileRead& f, const ParamRule& rule, const Dict& entry, const std::string& at) const {
  const auto& order = f.order.order;
  const auto emb = std::find_if(order.begin(), order.end(), [&](const OptimizerSlot& s) { return s.name == rule.name; });
  if (emb == order.end()) return;
  const size_t pos = emb - order.begin();
  const Value* theirs = EntryById(*f.state, static_cast<size_t>(f.zero1 ? static_cast<int64_t>(pos) : f.file_ids[pos]));
  for (const char* field : {"exp_avg", "exp_avg_sq"}) {
    const Value* a = entry.Find(field);
    const Value* b = theirs && theirs->is_dict() ? theirs->as_dict().Find(field) : nullptr;
    if (a && b && a->is_tensor() && b->is_tensor() && !SameBytes(a->as_tensor(), b->as_tensor()))
      throw Error(at + ": GPT's tied output layer has an " + field + " that differs from the embedding's (parameter id " +
                  std::to_string(pos) + "): the copy's state would be lost");
  }
}

// Ties the file's ids to parameters: the grouping whose group sizes the
// file's param_groups list (ids numbered 0, 1, ... across groups, as torch
// does). The first file decides among the rules that fit (NxDT's default
// first); every other file must fit the same rule.
Grouping OptimizerReader::Ids(const Value& groups, const OptimizerStage& stage, const std::string& where, std::vector<int64_t>* file_ids) {
  return Choose({NonEmpty(ParamGroupSizes(groups, where + ": param_groups", file_ids))}, false, stage, where);
}

std::vector<Grouping> OptimizerReader::Parts(const Grouping& g, bool by_experts) const {
  if (!by_experts) return {g};
  EpGroupings split = SplitGroupingByExperts(g, [&](const std::string& n) { return IsExpertWeight(L_.format, n); });
  return {std::move(split.non_expert), std::move(split.expert)};
}

// The grouping whose parts (Parts) hold groups of `sizes` (empty groups left out).
Grouping OptimizerReader::Choose(const std::vector<std::vector<size_t>>& sizes, bool by_experts, const OptimizerStage& stage,
                                 const std::string& where) {
  const ModelFormat& f = L_.format;
  std::vector<GroupingRule> rules{GroupingRule::kNxdt, GroupingRule::kNxdtLayerNormDecay};
  if (f.family != ModelFamily::kHfLlama) rules.push_back(GroupingRule::kNameSplit);
  std::string tried;
  // A manifest that records the grouping decides it.
  if (recorded_) rules = {*recorded_};
  for (GroupingRule r : rules) {
    if (!first_ && r != L_.grouping) continue;
    Grouping g = FamilyGrouping(f, GroupedNames(stage.names, stage.same_stage_copy, r), r);
    std::vector<std::vector<size_t>> have;
    for (const Grouping& part : Parts(g, by_experts)) have.push_back(NonEmpty(part.GroupSizes()));
    if (have == sizes) {
      if (first_) L_.grouping = r;
      return g;
    }
    tried += (tried.empty() ? "" : "; ") + g.id + ": " + g.description;
  }
  std::string got;
  for (const auto& part : sizes) {
    if (!got.empty()) got += "] and [";
    for (size_t i = 0; i < part.size(); ++i) got += (i ? ", " : "") + std::to_string(part[i]);
  }
  throw Error(where + ": its param_groups hold groups of sizes [" + got + "]" + (by_experts ? " (non-expert and expert optimizer)" : "") +
              " over the stage's " + std::to_string(stage.names.size()) + " parameters, which " +
              (first_ ? "fit no grouping shardkit knows (" : "do not fit the grouping of the first optimizer file (") + tried + ")");
}

// NxD's NeuronEPZero1Optimizer file of dp rank f.d (ckpt/spec/ep_zero1_state.h):
// its non-expert entries are shard d of dp of the tensor every ep rank holds,
// its expert entries shard d / ep of dp / ep (the expert-dp group) of ep rank
// d % ep's experts (NxD optimizer/zero_redundancy_optimizer.py
// NeuronEPZero1Optimizer: the ep optimizer shards over
// get_expert_data_parallel_replica_groups; parallel_layers/parallel_state.py
// initialize_model_parallel lays ranks [PP, DP_exp, EP, TP]). It holds no
// master weights, so the tag has none.
void OptimizerReader::ReadEpFile(const OptimizerStage& stage, const OptimizerFileRead& f, const Value& v) {
  if (!L_.grid.zero1 || !IsEpZero1File(v)) throw Error(NotEpZero1Message(f.where, L_.grid.ep));
  const EpZero1File file = ParseEpZero1File(v, f.where);
  std::vector<std::vector<size_t>> sizes;
  for (const OptimizerFile* part : {&file.non_expert, &file.expert}) sizes.push_back(NonEmpty(ParamGroupSizes(part->param_groups, f.where)));
  const std::vector<Grouping> parts = Parts(Choose(sizes, true, stage, f.where), true);
  if (first_) out_->param_groups = file.non_expert.param_groups, L_.master_weights = false, first_ = false;
  CheckSameHyperparameters(file, f.where);
  size_t next[2] = {0, 0};  // the next id of each part: EpZero1Entries lists each part's ids in order
  for (const EpZero1Entry& e : EpZero1Entries({parts[0], parts[1]}, L_.grid, f.d)) {
    const ParamState& ps = (e.expert ? file.expert : file.non_expert).params[next[e.expert]++];
    const StageParam& sp = stage.Param(e.name);
    const std::string at = f.where + ": base_state " + std::to_string(e.key) + " (" + e.name + ")";
    if (sp.tied_copy()) throw Error(at + ": a tied copy under expert parallelism, which shardkit does not read");
    AxisCoords coords = AxisCoords::Tp(L_.grid.tp, f.t);
    coords[Axis::kEp] = {L_.grid.ep, e.shard.ep_rank};
    if (!out_->steps.count(sp.rule->name)) out_->steps[sp.rule->name] = ps.step;
    IndexMoments(*sp.rule, coords, e.shard.shard, e.shard.shards, ps, f, at);
  }
}

// Indexes a ZeRO-1 entry's moments: chunk `shard` of `shards` of the local tensor at `at`.
void OptimizerReader::IndexMoments(const ParamRule& rule, const AxisCoords& at, int64_t shard, int64_t shards, const ParamState& ps,
                                   const OptimizerFileRead& f, const std::string& at_text) {
  const auto local = LocalShape(rule, at);
  if (ps.shape != local) throw Error(at_text + ": shape_info is " + ShapeString(ps.shape) + ", not its local shape " + ShapeString(local));
  auto want = local;
  want[0] = Zero1ShardRows(local[0], static_cast<int>(shards));
  for (const auto& [field, val] : {std::pair{StateField::kExpAvg, &ps.exp_avg}, std::pair{StateField::kExpAvgSq, &ps.exp_avg_sq}}) {
    const std::string fat = at_text + " " + FieldName(field);
    const Tensor& x = IndexableTensor(*val, fat);
    if (x.shape() != want) throw Error(fat + " has shape " + ShapeString(x.shape()) + ", not " + ShapeString(want) + " (chunk " +
                                       std::to_string(shard) + " of " + std::to_string(shards) + " of dim 0)");
    index_.AddBoxes(rule, at, field, x, files_.FileOf(x, f.rel), shard * want[0], std::min((shard + 1) * want[0], local[0]), owner_, x.dtype(), fat);
  }
}

}  // namespace

void ReadTagOptimizer(TagFiles& files, TagDescription& layout, const std::vector<ParamRule>& params,
                      const std::optional<GroupingRule>& recorded_grouping, ExtentIndex& index, TagOptimizerState* out) {
  OptimizerReader(files, layout, params, recorded_grouping, index, out).Run();
}

}  // namespace ckpt

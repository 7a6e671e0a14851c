#include "ckpt/spec/ep_zero1_state.h"

#include <algorithm>
#include <set>

#include "ckpt/spec/partition.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

constexpr const char* kIdOffset = "ep_param_id_offset";
constexpr const char* kGroupOffset = "ep_param_group_offset";
constexpr const char* kBaseStateOffset = "ep_base_state_offset";
constexpr const char* kShapeInfoOffset = "ep_shape_info_offset";

// NeuronEPZero1Optimizer._get_offset of a part whose ids run 0 .. n-1: the largest + 1, or 1 when there is none.
int64_t OffsetAfter(size_t n) { return n > 0 ? static_cast<int64_t>(n) : 1; }

const Dict& DictAt(const Dict& top, const char* key, const std::string& where) {
  const Value& v = top.At(key);
  if (!v.is_dict()) throw Error(where + ": '" + key + "' is a " + v.kind_name() + ", not a dict");
  return v.as_dict();
}

// How many ids each part has, and where the expert ids start in the combined keys.
struct PartIds {
  size_t non_expert = 0, expert = 0;
  int64_t offset = 0;
};
// The part and id of a combined key, as NeuronEPZero1Optimizer.load_state_dict's _split_states splits it.
std::pair<bool, size_t> Split(const Value& k, const PartIds& n, const std::string& at) {
  const int64_t key = AsInteger(k, at + " key");
  const bool expert = key >= n.offset;
  const int64_t id = expert ? key - n.offset : key;
  if (id < 0 || id >= static_cast<int64_t>(expert ? n.expert : n.non_expert))
    throw Error(at + " has key " + std::to_string(key) + ", which is no id of the " + (expert ? "expert" : "non-expert") + " optimizer's " +
                std::to_string(expert ? n.expert : n.non_expert) + " parameters");
  return {expert, static_cast<size_t>(id)};
}

std::vector<int64_t> DimsOf(const Value& s, const std::string& at) {
  if (!s.is_seq()) throw Error(at + " is a " + s.kind_name() + ", not a list of dims");
  std::vector<int64_t> dims;
  for (const Value& d : s.as_seq().items) dims.push_back(AsInteger(d, at + " dim"));
  return dims;
}

// param_groups[from, to) as a list of its own, and the parameters its groups list.
Value GroupsPart(const Value& groups, size_t from, size_t to, const std::string& where, size_t* params) {
  Value part = Value::List();
  for (size_t g = from; g < to; ++g) part.as_seq().items.push_back(groups.as_seq().items[g]);
  size_t n = 0;
  for (size_t s : ParamGroupSizes(part, where)) n += s;
  *params = n;
  return part;
}

void CheckKeys(const Dict& top, const std::string& where) {
  static const std::set<std::string> kKnown{kIdOffset, kGroupOffset, kBaseStateOffset, kShapeInfoOffset,
                                            "param_groups", "state", "base_state", "shape_info"};
  for (const auto& [k, _] : top.items)
    if (!k.is_str() || !kKnown.count(k.as_str()))
      throw Error(where + ": holds '" + (k.is_str() ? k.as_str() : "?") + "', which NxD's NeuronEPZero1Optimizer.state_dict does not write" +
                  (k.is_str() && k.as_str() == "sharded_master_weights" ? " (it carries no master weights)" : ""));
  for (const auto& k : kKnown)
    if (!top.Find(k)) throw Error(where + ": missing key '" + k + "' of NxD's NeuronEPZero1Optimizer state dict");
}

void CheckOffset(const Dict& top, const char* key, int64_t want, const std::string& where) {
  const int64_t got = AsInteger(top.At(key), where + ": '" + key + "'");
  if (got != want)
    throw Error(where + ": '" + key + "' is " + std::to_string(got) + ", where NeuronEPZero1Optimizer.state_dict writes " + std::to_string(want) +
                " (the non-expert optimizer's largest id + 1, or 1 when it has none)");
}

}  // namespace

bool IsEpZero1File(const Value& file) { return file.is_dict() && file.as_dict().Find(kGroupOffset) != nullptr; }

std::string NotEpZero1Message(const std::string& where, int ep) {
  return where + ": is not NxD's NeuronEPZero1Optimizer state dict (ep_param_group_offset and its ZeRO-1 parts), which shardkit reads "
                 "as the optimizer state of an expert-parallel (ep " + std::to_string(ep) + ") tag";
}

EpOptimizerBar EpOptimizerBarOf(int ep, bool has_optimizer, bool zero1, bool master_weights) {
  if (ep <= 1 || !has_optimizer) return EpOptimizerBar::kNone;
  if (!zero1) return EpOptimizerBar::kPlain;
  return master_weights ? EpOptimizerBar::kMasterWeights : EpOptimizerBar::kNone;
}

EpZero1File ParseEpZero1File(const Value& file, const std::string& where) {
  if (!file.is_dict()) throw Error(where + " is a " + file.kind_name() + ", not a dict");
  const Dict& top = file.as_dict();
  CheckKeys(top, where);
  const Value& groups = top.At("param_groups");
  if (!groups.is_seq()) throw Error(where + ": 'param_groups' is a " + groups.kind_name() + ", not a list");
  const int64_t split = AsInteger(top.At(kGroupOffset), where + ": '" + kGroupOffset + "'");
  const auto count = static_cast<int64_t>(groups.as_seq().items.size());
  if (split < 1 || split >= count)
    throw Error(where + ": '" + kGroupOffset + "' is " + std::to_string(split) + ", which does not split its " + std::to_string(count) +
                " param_groups into the non-expert and the expert optimizer's");
  EpZero1File out;
  out.non_expert.zero1 = out.expert.zero1 = true;
  PartIds n;
  out.non_expert.param_groups = GroupsPart(groups, 0, split, where + ": non-expert param_groups", &n.non_expert);
  out.expert.param_groups = GroupsPart(groups, split, count, where + ": expert param_groups", &n.expert);
  n.offset = OffsetAfter(n.non_expert);
  if (!DictAt(top, "state", where).items.empty())
    throw Error(where + ": 'state' is not empty, where a ZeRO-1 optimizer keeps its moments in base_state");
  CheckOffset(top, kIdOffset, OffsetAfter(0), where);
  CheckOffset(top, kBaseStateOffset, n.offset, where);
  CheckOffset(top, kShapeInfoOffset, n.offset, where);
  out.non_expert.params.resize(n.non_expert);
  out.expert.params.resize(n.expert);
  auto param = [&](bool expert, size_t id) -> ParamState& { return (expert ? out.expert : out.non_expert).params[id]; };
  std::set<std::pair<bool, size_t>> seen, shaped;
  for (const auto& [k, e] : DictAt(top, "base_state", where).items) {
    const auto [expert, id] = Split(k, n, where + ": base_state");
    const std::string at = where + ": base_state " + std::to_string(AsInteger(k, "key")) + (expert ? " (expert id " : " (non-expert id ") +
                           std::to_string(id) + ")";
    if (!seen.insert({expert, id}).second) throw Error(at + " appears twice");
    const Dict& entry = OptimizerFileView::AdamWEntry(e, at);
    ParamState& p = param(expert, id);
    p.step = entry.At("step"), p.exp_avg = entry.At("exp_avg"), p.exp_avg_sq = entry.At("exp_avg_sq");
  }
  for (const auto& [k, s] : DictAt(top, "shape_info", where).items) {
    const auto [expert, id] = Split(k, n, where + ": shape_info");
    if (!shaped.insert({expert, id}).second) throw Error(where + ": shape_info " + std::to_string(AsInteger(k, "key")) + " appears twice");
    param(expert, id).shape = DimsOf(s, where + ": shape_info " + std::to_string(AsInteger(k, "key")));
  }
  for (bool expert : {false, true})
    for (size_t id = 0; id < (expert ? n.expert : n.non_expert); ++id)
      if (!seen.count({expert, id}) || !shaped.count({expert, id}))
        throw Error(where + ": the " + (expert ? "expert" : "non-expert") + " optimizer's id " + std::to_string(id) + " (key " +
                    std::to_string(expert ? n.offset + static_cast<int64_t>(id) : static_cast<int64_t>(id)) + ") has no " +
                    (seen.count({expert, id}) ? "shape_info" : "base_state entry"));
  return out;
}

Value EpZero1File::ToValue() const {
  for (const OptimizerFile* part : {&non_expert, &expert}) {
    if (!part->zero1) throw Error("NeuronEPZero1Optimizer's two optimizers are ZeRO-1 ones");
    for (const ParamState& p : part->params)
      if (p.master) throw Error("NxD's NeuronEPZero1Optimizer state dict has no place for master weights");
  }
  const Value a = non_expert.ToValue(), b = expert.ToValue();
  const int64_t offset = OffsetAfter(non_expert.params.size());
  Value out = Value::NewDict();
  Dict& d = out.as_dict();
  d.Set(kIdOffset, Value(OffsetAfter(0)));
  d.Set(kGroupOffset, Value(static_cast<int64_t>(a.as_dict().At("param_groups").as_seq().items.size())));
  d.Set(kBaseStateOffset, Value(offset));
  d.Set(kShapeInfoOffset, Value(offset));
  Value groups = Value::List(a.as_dict().At("param_groups").as_seq().items);
  for (const Value& g : b.as_dict().At("param_groups").as_seq().items) groups.as_seq().items.push_back(g);
  d.Set("param_groups", groups);
  d.Set("state", Value::NewDict());
  for (const char* key : {"base_state", "shape_info"}) {
    Value merged = Value::NewDict();
    merged.as_dict().items = a.as_dict().At(key).as_dict().items;
    for (const auto& [k, v] : b.as_dict().At(key).as_dict().items) merged.as_dict().items.emplace_back(Value(offset + k.as_int()), v);
    d.Set(key, merged);
  }
  return out;
}

EpGroupings SplitGroupingByExperts(const Grouping& all, const std::function<bool(const std::string&)>& expert) {
  EpGroupings out{all, all};
  out.non_expert.order.clear(), out.expert.order.clear();
  // `all` lists group 0's parameters, then group 1's: so does each part, as torch numbers its ids.
  for (const OptimizerSlot& s : all.order) (expert(s.name) ? out.expert : out.non_expert).order.push_back(s);
  out.non_expert.id += "/non-expert", out.expert.id += "/experts";
  return out;
}

namespace {
void CheckEpGrid(const RankGrid& g, int dp_rank) {
  if (g.ep < 1 || g.dp % g.ep != 0 || dp_rank < 0 || dp_rank >= g.dp)
    throw Error("dp rank " + std::to_string(dp_rank) + " of a grid with dp " + std::to_string(g.dp) + ", ep " + std::to_string(g.ep) +
                ": NxD lays ep inside dp, so ep must divide dp");
}
}  // namespace

EpZero1Shard NonExpertShardOf(const RankGrid& g, int dp_rank) {
  CheckEpGrid(g, dp_rank);
  return {0, dp_rank, g.dp};
}

EpZero1Shard ExpertShardOf(const RankGrid& g, int dp_rank) {
  CheckEpGrid(g, dp_rank);
  return {dp_rank % g.ep, dp_rank / g.ep, g.dp / g.ep};
}

std::vector<EpZero1Entry> EpZero1Entries(const EpGroupings& g, const RankGrid& grid, int dp_rank) {
  std::vector<EpZero1Entry> out;
  const EpZero1Shard non_expert = NonExpertShardOf(grid, dp_rank), expert = ExpertShardOf(grid, dp_rank);
  for (size_t i = 0; i < g.non_expert.order.size(); ++i) out.push_back({static_cast<int64_t>(i), g.non_expert.order[i].name, false, non_expert});
  const int64_t offset = OffsetAfter(g.non_expert.order.size());
  for (size_t i = 0; i < g.expert.order.size(); ++i)
    out.push_back({offset + static_cast<int64_t>(i), g.expert.order[i].name, true, expert});
  return out;
}

std::string EpZero1ShardProblem(const Value& file, int dp, int ep, const std::string& where) {
  if (ep < 1 || dp % ep != 0) return where + ": a grid of dp " + std::to_string(dp) + " and ep " + std::to_string(ep) + ", where NxD lays ep inside dp";
  if (!IsEpZero1File(file))  // an optimizer state dict of another form, or an xser info.pt
    return file.is_dict() && file.as_dict().Find("param_groups") ? NotEpZero1Message(where, ep) : Zero1ShardProblem(file, dp, where);
  EpZero1File parts;
  try {
    parts = ParseEpZero1File(file, where);
  } catch (const Error& e) {
    return e.what();
  }
  if (std::string why = Zero1ShardProblem(parts.non_expert.ToValue(), dp, where + " (non-expert optimizer)"); !why.empty()) return why;
  return Zero1ShardProblem(parts.expert.ToValue(), dp / ep, where + " (expert optimizer, over expert-dp)");
}

std::optional<std::string> EpNamedOptimFile(const std::vector<std::string>& optim_names) {
  std::optional<std::string> first;
  for (const std::string& n : optim_names) {
    const auto c = ParseAnyRankFileName(n);
    if (!c || !c->ep) continue;
    if (*c == RankCoord{.dp = 0, .tp = 0, .pp = 0, .ep = 0}) return n;
    if (!first || n < *first) first = n;
  }
  return first;
}

int EpSizeOfNames(const std::vector<std::string>& names) {
  int ep = 1;
  for (const std::string& n : names)
    if (const auto c = ParseAnyRankFileName(n); c && c->ep) ep = std::max(ep, *c->ep + 1);
  return ep;
}

std::string EpZero1LostMessage(const std::string& where, const Value& ep0_file, int ep, bool xser) {
  if (!ep0_file.is_dict() || !ep0_file.as_dict().Find("base_state")) return "";
  const int64_t dp = Zero1SavedAsOneShard(ep0_file);
  const std::string dp_text = dp > 0 ? "dp=" + std::to_string(dp) : "dp > 1";
  const std::string ep_text = "ep=" + std::to_string(ep);
  const std::string seen = xser ? "the X.pt files of ep ranks above 0 have no tensors in their .tensors/ folders, and NxD's loader reads ep "
                                  "rank 0's tensors in their place (silently wrong)"
                                : "optim/ holds ep rank 0's files alone (NxD's loader fails on the others)";
  return where + ": NxDT saved an expert-parallel (" + ep_text + ") " + dp_text +
         " ZeRO-1 optimizer of an MoE model (NxD's NeuronEPZero1Optimizer) as a non-ZeRO-1 one, so only dp rank 0 of each dp group wrote it: " + seen +
         ". Lost: the moments of the experts of " + (ep == 2 ? std::string("ep rank 1") : "ep ranks 1.." + std::to_string(ep - 1)) + " and of every non-expert shard but dp rank 0's. "
         "NxDT's NLPCheckpointIO passes zero1_optimizer from cfg.wrap_with_zero, which NxDT configs do not set, and NxD's save_checkpoint then "
         "names the files by ep rank (optim/dp_rank_00_ep_rank_EE_...) and writes them from the first rank of each dp group. " +
         kWeightsOnlyAdvice;
}

}  // namespace ckpt

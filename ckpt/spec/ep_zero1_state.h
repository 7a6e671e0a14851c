// NxD's ZeRO-1 optimizer under expert parallelism (ep > 1): the state dict
// of NeuronEPZero1Optimizer (NxD optimizer/zero_redundancy_optimizer.py) in
// the typed form of ckpt/spec/optimizer_state.h, where each entry lies in
// the logical state, and NxDT's save route that loses part of it.
//
// NeuronEPZero1Optimizer holds two NeuronZero1Optimizers: one over the
// non-expert parameters, sharded over the dp group, and one over the expert
// weights (those NxD marks expert_model_parallel: moe_parallel_layers.py
// ExpertFusedLinear), sharded over the expert-data-parallel group. Each
// numbers its own ids from 0. Its state_dict combines them: the four offsets
// ep_param_id_offset, ep_param_group_offset, ep_base_state_offset,
// ep_shape_info_offset first; `param_groups` the non-expert optimizer's, then
// the expert one's; `state`, `base_state` and `shape_info` the non-expert
// ids, then the expert ids plus the offset (_get_offset: the largest
// non-expert id + 1, or 1 when there is none). The inner optimizers'
// sharded_master_weights are not carried (state_dict builds the dict from
// those keys alone), so such a file holds no master weights. Its optim file
// is named by dp rank alone (trainer/checkpoint.py _get_path(dp=True)).
// Checked against tests/data/upstream/nxd_mixtral (NxD's own files).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/pt/value.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/spec/rank_grid.h"

namespace ckpt {

// One dp rank's optim file of a NeuronEPZero1Optimizer, split as its
// load_state_dict splits it: each part a ZeRO-1 file with ids from 0.
struct EpZero1File {
  OptimizerFile non_expert, expert;
  // The combined state dict, as NeuronEPZero1Optimizer.state_dict builds it
  // (key order and offsets included).
  Value ToValue() const;
};

// Whether `file` is such a combined state dict (it holds ep_param_group_offset).
bool IsEpZero1File(const Value& file);

// The refusal of optim file `where` of an expert-parallel (ep `ep`) tag when
// it is not such a combined state dict (a plain ZeRO-1 or torch optimizer
// file): the one message the tag reader and ckpt-verify give.
std::string NotEpZero1Message(const std::string& where, int ep);

// What keeps an optimizer from being written at ep `ep` (> 1: NxD's
// NeuronEPZero1Optimizer, which is ZeRO-1 and whose state_dict carries no
// master weights), checked in this order: kPlain, a target optimizer that is
// not ZeRO-1; kMasterWeights, a source optimizer holding fp32 master weights.
// kNone at ep 1, without an optimizer, or when neither holds. The reshard
// engine (ckpt-reshard --ep) and the trainer's resume_reshard both ask it;
// each words its own refusal.
enum class EpOptimizerBar { kNone, kPlain, kMasterWeights };
EpOptimizerBar EpOptimizerBarOf(int ep, bool has_optimizer, bool zero1, bool master_weights);

// Parses a combined state dict. Throws ckpt::Error naming `where` and the key
// for anything state_dict does not write: a missing or extra key, offsets
// other than those _get_offset gives, a non-empty `state`, ids that do not
// run 0, 1, ... over each part's param_groups, an entry without AdamW's
// step, exp_avg and exp_avg_sq or without its shape_info.
EpZero1File ParseEpZero1File(const Value& file, const std::string& where);

// The groupings of the two inner optimizers: `all` (the grouping NxDT gives
// the stage's parameters, ckpt/spec/optimizer_groups.h) with each group
// filtered by `expert` and by its negation, empty groups kept
// (NeuronEPZero1Optimizer.__init__: recursive_filter of the param groups by
// _is_ep_param, NxD utils/model_utils.py).
struct EpGroupings {
  Grouping non_expert, expert;
};
EpGroupings SplitGroupingByExperts(const Grouping& all, const std::function<bool(const std::string&)>& expert);

// Which ZeRO-1 chunk of a local tensor's dim 0 a file holds, and whose
// experts. NxD lays ep inside dp (parallel_layers/parallel_state.py): dp rank
// d has ep rank d % ep and expert-dp rank d / ep of dp / ep.
struct EpZero1Shard {
  int ep_rank = 0;   // whose experts the local tensor holds (0 for non-expert parameters)
  int shard = 0;     // the chunk (Zero1ShardRows rows, padded) of dim 0 ...
  int shards = 1;    // ... of this many: dp (non-expert) or dp / ep (expert)
  bool operator==(const EpZero1Shard&) const = default;
};
EpZero1Shard NonExpertShardOf(const RankGrid& g, int dp_rank);
EpZero1Shard ExpertShardOf(const RankGrid& g, int dp_rank);

// One entry of dp rank d's file: its key in the combined base_state and
// shape_info, the parameter, and the chunk it holds.
struct EpZero1Entry {
  int64_t key = 0;
  std::string name;
  bool expert = false;
  EpZero1Shard shard;
};
// Every entry of dp rank `dp_rank`'s file in key order: the non-expert ids of
// `g.non_expert`, then the expert ids of `g.expert` past _get_offset.
std::vector<EpZero1Entry> EpZero1Entries(const EpGroupings& g, const RankGrid& grid, int dp_rank);

// The problem of `file`, dp rank's optim file of an expert-parallel tag of
// dp `dp` and ep `ep`, or "": a combined state dict (IsEpZero1File) that
// ParseEpZero1File refuses, or a ZeRO-1 shard whose rows are not its chunk
// (Zero1ShardProblem) of dp (non-expert) or dp / ep (expert) chunks. An
// optimizer state dict of another form (it holds param_groups: a plain
// ZeRO-1 or torch optimizer file) is NotEpZero1Message's, as the tag reader
// refuses it; any other file (an xser info.pt) is Zero1ShardProblem's over dp.
// Messages name `where`.
std::string EpZero1ShardProblem(const Value& file, int dp, int ep, const std::string& where);

// NxDT's lossy save of an expert-parallel ZeRO-1 optimizer. NxDT
// nlp_overrides.py NLPCheckpointIO.save_checkpoint passes zero1_optimizer
// from cfg.wrap_with_zero, which no NxDT config sets, so NxD
// trainer/checkpoint.py save_checkpoint takes the state dict for a
// non-ZeRO-1 optimizer: at ep > 1 it names the files by ep rank
// (optim/dp_rank_00_ep_rank_EE_tp_rank_TT_pp_rank_PP.pt, _get_path(ep=True))
// and writes them from the first rank of each dp group (groups =
// get_data_parallel_replica_groups()), which is dp rank 0, ep rank 0: a plain
// tag holds ep rank 0's files alone (NxD's loader fails on ep rank 1's), an
// xser tag also ep rank 1's X.pt whose .tensors/ folder stays empty (_save
// writes tensors only from emp_rank 0), which NxD's loader fills from ep
// rank 0's folder, silently wrong. Run: tests/data/upstream/nxd_mixtral
// (nxdt_ep2_pt, nxdt_ep2_xser).
//
// The optim/ rank file of ep rank 0 (tp 0, pp 0) when `optim_names` (the rank
// file names optim/ holds) are named by ep rank, else nullopt.
std::optional<std::string> EpNamedOptimFile(const std::vector<std::string>& optim_names);
// The ep size rank file names tell: 1 + the largest ep rank among `names`
// (model/ and optim/ rank files), 1 when none carries one.
int EpSizeOfNames(const std::vector<std::string>& names);
// When `ep0_file` (that file, loaded) holds ZeRO-1 state, the message naming
// `where` (the optim/ folder), what was lost and what to do; "" otherwise.
// `ep`: the job's ep size (its model files'); `xser`: the tag's container.
std::string EpZero1LostMessage(const std::string& where, const Value& ep0_file, int ep, bool xser);

}  // namespace ckpt

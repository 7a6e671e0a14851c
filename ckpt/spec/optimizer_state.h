// The optimizer file schemas NxDT reads, in one typed form: torch's AdamW
// state dict ({"state": {id: {step, exp_avg, exp_avg_sq}}, "param_groups"})
// and torch-xla ZeRO-1's ({"state": {}, "param_groups", "base_state": {id:
// shards}, "shape_info": {id: torch.Size}, optional
// "sharded_master_weights"}). Ids are positions in the grouping's order.
// One writer (OptimizerFile::ToValue) and one parser (OptimizerFileView),
// which the tag reader (ckpt/shard/tag_optimizer.h), nnm2nxdt-ckpt
// (convert/nnm_optimizer.h) and the trainer (libtrain/optimizer.h) read
// every optimizer file through.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/pt/value.h"

namespace ckpt {

struct ParamState {
  Value step;                     // as torch keeps it (a 0-d float32 tensor)
  Value exp_avg, exp_avg_sq;      // the whole local tensor, or this dp rank's ZeRO-1 shard
  std::optional<Value> master;    // ZeRO-1 sharded_master_weights
  std::vector<int64_t> shape;     // the unsharded local shape (ZeRO-1's shape_info)
};

struct OptimizerFile {
  bool zero1 = false;
  Value param_groups;               // ParamGroupsFor
  std::vector<ParamState> params;   // by optimizer id; exp_avg None: no state (plain AdamW only)
  Value ToValue() const;
};

// One optimizer file viewed in place as the schemas above lay it out: which
// form it is, and each part, checked when asked for (so each reader keeps the
// order of its own checks). Pure: no copies, no I/O; `file` must outlive it.
// Messages name `where` and the key.
class OptimizerFileView {
 public:
  // Throws "<where> is a <kind>, not a dict" unless `file` is a dict.
  OptimizerFileView(const Value& file, std::string where);
  const Dict& top() const { return *top_; }
  const std::string& where() const { return where_; }
  // torch-xla ZeRO-1's form: the file holds base_state.
  bool zero1() const { return top_->Find("base_state") != nullptr; }
  // Where the moments lie by id: "base_state" (ZeRO-1) or "state".
  const char* moments_key() const { return zero1() ? "base_state" : "state"; }
  // The first top-level key neither form has ("?" for a key that is not a string), or nullopt.
  std::optional<std::string> UnknownKey() const;
  // param_groups; throws "missing key 'param_groups'" when absent.
  const Value& param_groups() const { return top_->At("param_groups"); }
  // The moments by id (moments_key()); throws "<where>: '<key>' is a <kind>, not a dict".
  const Dict& Moments() const;
  // Throws unless a ZeRO-1 file's own `state` is an empty dict (its entries would have no place).
  void CheckZero1StateEmpty() const;
  // ZeRO-1's shape_info (null for a plain file), sharded_master_weights (null
  // when absent); each throws when present but not a dict.
  const Dict* ShapeInfo() const;
  const Dict* Masters() const;
  // One parameter's entry of Moments(): throws naming `at` unless it is a dict
  // holding AdamW's step, exp_avg and exp_avg_sq only.
  static const Dict& AdamWEntry(const Value& entry, const std::string& at);
  // Whether a top-level key holds entries by parameter id (state, base_state,
  // shape_info, sharded_master_weights), which a renumbering rewrites.
  static bool KeyedById(const std::string& key);

 private:
  const Dict* top_;
  std::string where_;
};

// The entry for optimizer id `id` in a {id: value} dict (state, base_state,
// shape_info, sharded_master_weights); nullptr when absent.
const Value* EntryById(const Dict& by_id, size_t id);

// When `file` (a tag's only ZeRO-1 optimizer file of its tp/pp rank, no other
// dp rank's beside it) holds shards with fewer rows than its shape_info says,
// the dp degree it was sharded over (rows / shard rows); else 0. That is how
// NxDT saves a ZeRO-1 optimizer at dp > 1: NxDT nlp_overrides.py
// NLPCheckpointIO.save_checkpoint passes zero1_optimizer from the NNM key
// cfg.wrap_with_zero, which no NxDT config sets, so NxD trainer/checkpoint.py
// save_checkpoint writes dp rank 0's file only and the other ranks' moments
// are lost; NxD load_checkpoint then hands that one shard to every rank.
int64_t Zero1SavedAsOneShard(const Value& file);
// What a user can still do with a tag whose optimizer lost moments (the end of each such message).
inline constexpr const char* kWeightsOnlyAdvice =
    "The model weights are complete: take them with a fresh optimizer by --weights_only (ckpt-reshard, ckpt-export) or "
    "model.weight_init_only: True (shardkit-train, as NxDT)";
// The message for such a file.
std::string Zero1OneShardMessage(const std::string& where, int64_t dp);

// Whether the ZeRO-1 `file` of a tag sharded over `dp` ranks covers each of
// its parameters: torch-xla's ZeroRedundancyOptimizer pads dim 0 of every
// state to a multiple of the sharding group's size and keeps one chunk per
// rank (Zero1ShardRows), so each base_state exp_avg, exp_avg_sq and
// sharded_master_weights entry must hold ceil(rows / dp) rows of its
// shape_info, and its shape_info's other dims. Returns "" when it does; else
// the first entry that does not, naming `where` and the parameter
// (`name_of(id)`, or "parameter id N" when not given). When the rows are
// ceil(rows / (dp * cp)) for some cp > 1, the message says dp × cp: NxD
// shards a ZeRO-1 optimizer over dp * cp ranks under context parallelism
// (trainer/trainer.py initialize_optimizer_from_class takes
// parallel_state.get_zero1_sharding_groups when cp > 1), while
// trainer/checkpoint.py save_checkpoint names each file by its dp rank alone
// (_get_path's cp argument is never set), so the cp ranks of one dp rank
// write the same file and all but one cp rank's shards are lost.
std::string Zero1ShardProblem(const Value& file, int dp, const std::string& where,
                              const std::function<std::string(int64_t id)>& name_of = {});

// The sizes of the groups a `param_groups` list holds, after checking that
// their ids run 0, 1, ... across the groups in order, as torch numbers them.
// A parameter a group lists twice (NeMo lists GPT's tied weight under the
// embedding and the output layer) has, in torch's numbering, the later
// position's id at both positions (Optimizer.state_dict's pack_group; run:
// tests/data/upstream/nxdt_megatron): position k holds k, or an id j > k whose
// own position holds j. `ids`, when given, receives the id of every position.
// Throws ckpt::Error naming `where`.
std::vector<size_t> ParamGroupSizes(const Value& param_groups, const std::string& where, std::vector<int64_t>* ids = nullptr);

// `param_groups` for the grouping `to`, hyperparameters from `source` (a
// param_groups list): a decaying group takes the first source group whose
// weight_decay is not 0, a non-decaying one the first whose weight_decay is 0;
// without such a group, source group 0's (weight_decay set to 0 for a
// non-decaying group). Every group of `to` is written, empty ones too (NeMo's
// rule has none; NxDT's HF-style models keep theirs).
Value ParamGroupsFor(const Value& source, const Grouping& to);

}  // namespace ckpt

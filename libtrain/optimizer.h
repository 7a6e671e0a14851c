// AdamW with parameter groups as NxDT makes them (ckpt::FamilyGrouping: for
// Megatron-style models NeMo's rule, biases apart with weight decay 0 and
// everything else decaying, one group with do_layer_norm_weight_decay or
// without biases), torch.optim.AdamW's update rule,
// and state dicts in torch.optim's format (parameter ids numbered over group
// 0, then group 1) or, with zero1, torch-xla's ZeRO-1 format for one
// data-parallel rank, as NxDT writes it. With master_weights (NxDT's
// mixed_precision) the update runs on float32 master copies and the model's
// parameters become their bfloat16 rounding. Gradient clipping by global norm as
// torch.nn.utils.clip_grad_norm_ (ReduceAndClip). Learning-rate schedules as NeMo's
// CosineAnnealing and NxDT's LinearAnnealingWithWarmUp compute them.
//
// Data parallelism: given the data-parallel group, ReduceAndClip sums the
// ranks' gradients before clipping by the global norm. Without zero1 every
// rank then holds the whole reduced gradient and takes the same step. With
// zero1 each parameter is padded on dim 0 to a multiple of dp and cut in dp
// chunks (ckpt::Zero1ShardRows); gradients are reduce-scattered, each rank
// keeps moments and master weights for its chunk only and updates those rows,
// and the parameters are all-gathered after the step, as NxD's ZeRO-1 does.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/pt/value.h"
#include "ckpt/spec/ep_zero1_state.h"
#include "libtrain/model.h"

namespace train {

struct AdamWConfig {
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  bool do_layer_norm_weight_decay = false;
  // Float32 master weights for bfloat16 parameters (ModelConfig::bf16_params).
  bool master_weights = false;
  // State dicts in ZeRO-1's layout: {state: {}, param_groups, base_state:
  // {id: {step, exp_avg, exp_avg_sq}}, shape_info: {id: torch.Size}} and,
  // with master_weights_in_ckpt, sharded_master_weights: {id: float32}.
  bool zero1 = false;
  bool master_weights_in_ckpt = false;
};

class Comm;

// Expert parallelism (ep->size() > 1): the expert weights' gradients are
// summed over `expert_dp` instead of dp, their ZeRO-1 state cut over it
// (NxD's NeuronEPZero1Optimizer), and the global norm adds the other ep
// ranks' experts over `ep`. Both nullptr: no expert parallelism.
struct ExpertGroups {
  Comm* expert_dp = nullptr;
  Comm* ep = nullptr;
};

class AdamW {
 public:
  // Master weights, if any, start as copies of the model's parameters.
  // `dp`: the data-parallel group (nullptr: one rank).
  AdamW(const Model& m, const AdamWConfig& c, Comm* dp = nullptr, const ExpertGroups& experts = {});
  // Sums the gradients over the data-parallel group (all-reduce, or
  // reduce-scatter into this rank's chunks with zero1), multiplies them by
  // `scale`, and clips them to the global L2 norm `max_norm` (no clipping when
  // max_norm <= 0). Returns the global norm before clipping. Call before Step.
  double ReduceAndClip(Model& m, double scale, double max_norm);
  // One update of every parameter from its gradient at learning rate `lr`
  // (with zero1 over several ranks: of this rank's rows, then all-gathered).
  void Step(Model& m, double lr);
  int64_t steps() const { return step_; }

  // Master weights copied from the model's parameters again (after the model
  // loaded a checkpoint).
  void ResetMasterWeights(const Model& m);

  // torch.optim.AdamW.state_dict(): {"state": {id: {step, exp_avg,
  // exp_avg_sq}}, "param_groups": [...]}, or the ZeRO-1 layout with zero1;
  // `lr` is recorded in the groups. Under expert parallelism (zero1 only),
  // NxD's NeuronEPZero1Optimizer layout (ckpt/spec/ep_zero1_state.h): the
  // non-expert parameters' ZeRO-1 file and the experts', combined.
  ckpt::Value StateDict(double lr) const;
  // Whether StateDict holds fp32 master weights (ZeRO-1 with master_weights_in_ckpt).
  // Never under expert parallelism: NeuronEPZero1Optimizer's state dict has no place for them.
  bool SavesMasterWeights() const { return c_.zero1 && c_.master_weights_in_ckpt && !master_.empty() && !ep_; }
  // Reads either layout (NeuronEPZero1Optimizer's under expert parallelism,
  // and only then). Returns true when it held master weights and they
  // were taken; without them the master weights stay as they are (copies of
  // the bfloat16 parameters, as NxD resumes). Throws ckpt::Error naming what
  // does not fit the model, including param_groups that number the
  // parameters differently from this run's grouping. State grouped by name
  // (ckpt::GroupingRule::kNameSplit: shardkit's trainer before it followed
  // NeMo, NxD's llama example) is read by name into this run's grouping;
  // regrouped() then names it.
  bool LoadStateDict(const ckpt::Value& sd);
  const std::string& regrouped() const { return regrouped_; }

  // Parameter names by optimizer id.
  const std::vector<std::string>& order() const { return order_; }

 private:
  // A parameter's dim-0 rows (each of row_elems values), cut into chunks of
  // shard_rows rows (ckpt::Zero1ShardRows): chunk k is rows [lo, hi); the last chunks
  // may hold fewer real rows, or none). The state tensors hold one chunk, its
  // padding rows zero.
  struct Slot {
    std::vector<int64_t> shape;  // the parameter's
    int64_t rows = 1, row_elems = 1, shard_rows = 1;
    int own = 0;  // the chunk this rank's state covers
    int group = 0;  // its ReduceGroup
    std::pair<int64_t, int64_t> Chunk(int k) const {
      const int64_t lo = std::min(rows, k * shard_rows);
      return {lo, std::min(rows, lo + shard_rows)};
    }
  };
  bool Sharded() const { return c_.zero1 && dp_size_ > 1; }
  // This rank's gradient of optimizer id i after ReduceAndClip: its chunk's
  // reduced rows (padded) under ZeRO-1, else the model's whole gradient.
  std::span<float> Gradient(Model& m, size_t i);
  // The file's optimizer id of each of ours: the same ids, or those of the
  // name split. Throws ckpt::Error when the file's groups fit neither.
  std::vector<size_t> FileIds(const ckpt::Value& param_groups, bool zero1);
  // The ids `in` picks as one optimizer's file, numbered from 0 in id order,
  // every group of the grouping listed; a group's dict (GroupDict) lists `ids`.
  ckpt::OptimizerFile FileOfIds(const std::function<bool(size_t)>& in, double lr) const;
  ckpt::Value GroupDict(int g, const ckpt::Value& ids, double lr) const;
  // A NeuronEPZero1Optimizer file's two parts as one ZeRO-1 file in this
  // run's ids (LoadFile reads it); throws when the parts do not fit this run.
  ckpt::OptimizerFile Combined(const ckpt::EpZero1File& file) const;
  bool LoadFile(const ckpt::Value& sd);

  AdamWConfig c_;
  Comm* dp_ = nullptr;
  int dp_size_ = 1, dp_rank_ = 0;
  std::vector<std::string> order_;  // id -> name
  std::vector<int> group_;          // id -> group index
  std::vector<bool> group_decays_;  // group index -> weight decay applies
  ckpt::ModelFormat format_;
  bool Megatron() const { return format_.family != ckpt::ModelFamily::kHfLlama; }  // NeMo's groups (is_expert)
  std::vector<std::string> names_;  // module order
  std::string regrouped_;
  std::pair<std::string, std::string> mirror_;  // a tied copy without a slot, and the parameter it copies
  std::string copy_slot_;                       // a tied copy with a slot of its own (pp = 1)
  void MirrorTiedCopy(Model& m) const;
  std::vector<Slot> slot_;          // id -> where its state lies
  std::vector<ckpt::Tensor> m_, v_, master_;  // master_ empty without master_weights
  std::vector<std::vector<float>> grad_shard_;  // with Sharded(): this rank's reduced gradient rows
  // The ranks a parameter's gradient is summed over: 0 the dp group (every
  // parameter without expert parallelism), 1 the expert-dp group (the expert
  // weights under it); ids: its parameters, segment: their chunks' floats.
  struct ReduceGroup {
    Comm* comm = nullptr;
    int size = 1, rank = 0;
    std::vector<size_t> ids;
    size_t segment = 0;
  };
  ReduceGroup reduce_[2];
  Comm* ep_ = nullptr;  // under expert parallelism, the ep group
  void AllReduceGroup(Model& m, const ReduceGroup& g);
  void ReduceScatterGroup(Model& m, const ReduceGroup& g);
  std::vector<size_t> offset_;   // id -> offset of its ZeRO-1 chunk in its group's bucket segment
  int64_t step_ = 0;
};

// The L2 norm of the whole model's parameters (every rank's slices, each
// tensor-parallel replica once); under expert parallelism `ep` (the ep
// group) adds the other ep ranks' experts.
double ParamNorm(Model& m, Comm* ep = nullptr);

struct ScheduleConfig {
  std::string name = "CosineAnnealing";  // or LinearAnnealingWithWarmUp
  int64_t warmup_steps = 0, constant_steps = 0, max_steps = 1;
  double min_lr = 0;
};

// The learning rate for 0-based optimizer step `step`.
double LrAt(const ScheduleConfig& s, double base_lr, int64_t step);

}  // namespace train

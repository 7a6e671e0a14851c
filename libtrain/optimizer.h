// AdamW with parameter groups as NxDT makes them (group 0: weights, with
// weight decay; group 1: norm weights and biases, weight decay 0; a single
// group when do_layer_norm_weight_decay), torch.optim.AdamW's update rule,
// and state dicts in torch.optim's format (parameter ids numbered over group
// 0, then group 1) or, with zero1, torch-xla's ZeRO-1 format for one
// data-parallel rank, as NxDT writes it. With master_weights (NxDT's
// mixed_precision) the update runs on float32 master copies and the model's
// parameters become their bfloat16 rounding. Gradient clipping by global norm as
// torch.nn.utils.clip_grad_norm_. Learning-rate schedules as NeMo's
// CosineAnnealing and NxDT's LinearAnnealingWithWarmUp compute them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/value.h"
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

class AdamW {
 public:
  // Master weights, if any, start as copies of the model's parameters.
  AdamW(const Model& m, const AdamWConfig& c);
  // One update of every parameter from its gradient at learning rate `lr`.
  void Step(Model& m, double lr);
  int64_t steps() const { return step_; }

  // Master weights copied from the model's parameters again (after the model
  // loaded a checkpoint).
  void ResetMasterWeights(const Model& m);

  // torch.optim.AdamW.state_dict(): {"state": {id: {step, exp_avg,
  // exp_avg_sq}}, "param_groups": [...]}, or the ZeRO-1 layout with zero1;
  // `lr` is recorded in the groups.
  ckpt::Value StateDict(double lr) const;
  // Reads either layout. Returns true when it held master weights and they
  // were taken; without them the master weights stay as they are (copies of
  // the bfloat16 parameters, as NxD resumes). Throws ckpt::Error naming what
  // does not fit the model, including param_groups that number the
  // parameters differently from this run's grouping.
  bool LoadStateDict(const ckpt::Value& sd);

  // Parameter names by optimizer id.
  const std::vector<std::string>& order() const { return order_; }

 private:
  void CheckGroups(const ckpt::Value& param_groups) const;

  AdamWConfig c_;
  std::vector<std::string> order_;  // id -> name
  std::vector<int> group_;          // id -> group index
  std::vector<ckpt::Tensor> m_, v_, master_;  // master_ empty without master_weights
  int64_t step_ = 0;
};

// Scales every gradient so their global L2 norm is at most `max_norm` (no-op
// when max_norm <= 0). Returns the norm before clipping.
double ClipGradNorm(Model& m, double max_norm);
double ParamNorm(Model& m);

struct ScheduleConfig {
  std::string name = "CosineAnnealing";  // or LinearAnnealingWithWarmUp
  int64_t warmup_steps = 0, constant_steps = 0, max_steps = 1;
  double min_lr = 0;
};

// The learning rate for 0-based optimizer step `step`.
double LrAt(const ScheduleConfig& s, double base_lr, int64_t step);

}  // namespace train

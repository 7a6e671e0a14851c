// The optimizer's parameter groups as NNM and NxDT build them (Megatron's
// _get_params_for_weight_decay_optimization): group 0 holds the weights that
// decay; group 1, with weight_decay 0, holds norm weights and every bias. With
// do_layer_norm_weight_decay there is one group of everything. Optimizer
// parameter ids number group 0's members, then group 1's, each in module
// (state-dict) order. The training core's AdamW and the checkpoint converter
// both take the order from here.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace train {

// Norm weights (any module whose name ends in "norm") and biases.
bool IsNoWeightDecay(std::string_view param_name);

struct OptimizerSlot {
  std::string name;
  int group;
};

// Optimizer ids -> parameters, from the parameters in module order.
std::vector<OptimizerSlot> OptimizerOrder(const std::vector<std::string>& params_in_module_order,
                                          bool do_layer_norm_weight_decay);

}  // namespace train

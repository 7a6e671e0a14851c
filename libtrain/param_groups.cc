#include "libtrain/param_groups.h"

namespace train {

bool IsNoWeightDecay(std::string_view name) {
  const size_t dot = name.rfind('.');
  const std::string_view leaf = dot == std::string_view::npos ? name : name.substr(dot + 1);
  if (leaf == "bias") return true;
  const std::string_view module = dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
  return module.ends_with("norm");
}

std::vector<OptimizerSlot> OptimizerOrder(const std::vector<std::string>& params, bool do_layer_norm_weight_decay) {
  std::vector<OptimizerSlot> order;
  for (int g = 0; g < 2; ++g)
    for (const auto& p : params)
      if ((g == 1) == (IsNoWeightDecay(p) && !do_layer_norm_weight_decay)) order.push_back({p, g});
  return order;
}

}  // namespace train

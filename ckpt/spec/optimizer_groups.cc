#include "ckpt/spec/optimizer_groups.h"

#include <functional>
#include <set>

namespace ckpt {

std::string_view ModuleOf(std::string_view name) {
  const size_t dot = name.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
}

std::string_view LeafOf(std::string_view name) {
  const size_t dot = name.rfind('.');
  return dot == std::string_view::npos ? name : name.substr(dot + 1);
}

Grouping TwoGroups(std::string id, std::string description, const std::vector<std::string>& names,
                   const std::function<bool(size_t)>& in_group_1, bool drop_empty) {
  Grouping g{std::move(id), std::move(description), 0, {}, {}};
  for (int group = 0; group < 2; ++group) {
    const size_t before = g.order.size();
    for (size_t i = 0; i < names.size(); ++i)
      if (in_group_1(i) == (group == 1)) g.order.push_back({names[i], g.groups});
    if (drop_empty && g.order.size() == before) continue;
    g.groups++;
    g.group_decays.push_back(group == 0);
  }
  return g;
}

Grouping OneGroup(std::string id, std::string description, const std::vector<std::string>& names) {
  Grouping g{std::move(id), std::move(description), 1, {}, {true}};
  for (const auto& n : names) g.order.push_back({n, 0});
  return g;
}

bool NamedNormOrBias(std::string_view name) { return LeafOf(name) == "bias" || ModuleOf(name).ends_with("norm"); }

const char* GroupingRuleName(GroupingRule r) {
  switch (r) {
    case GroupingRule::kNxdt: return "nxdt";
    case GroupingRule::kNxdtLayerNormDecay: return "nxdt-layer-norm-decay";
    case GroupingRule::kNameSplit: return "name-split";
  }
  return "?";
}

bool ParseGroupingRule(std::string_view s, GroupingRule* r) {
  for (GroupingRule c : {GroupingRule::kNxdt, GroupingRule::kNxdtLayerNormDecay, GroupingRule::kNameSplit})
    if (s == GroupingRuleName(c)) return *r = c, true;
  return false;
}

std::vector<size_t> Grouping::GroupSizes() const {
  std::vector<size_t> sizes(groups, 0);
  for (const auto& s : order) ++sizes[s.group];
  return sizes;
}

bool Grouping::Decays(const std::string& name) const {
  for (const auto& s : order)
    if (s.name == name) return group_decays.at(s.group);
  return false;
}

bool Grouping::SameTies(const Grouping& o) const {
  if (order.size() != o.order.size()) return false;
  for (size_t i = 0; i < order.size(); ++i)
    if (order[i].name != o.order[i].name || order[i].group != o.order[i].group) return false;
  return groups == o.groups && group_decays == o.group_decays;
}

Grouping NxdtGrouping(const std::vector<std::string>& params, bool do_layer_norm_weight_decay) {
  // NeMo v2.1.0 utils.py get_all_params_for_weight_decay_optimization: module.parameters() in one group.
  if (do_layer_norm_weight_decay)
    return OneGroup("nxdt-all-params",
                    "NxDT's megatron models with model.do_layer_norm_weight_decay: True (NeMo "
                    "get_all_params_for_weight_decay_optimization): one group, everything decays",
                    params);
  // get_params_for_weight_decay_optimization: `name.endswith('bias')` over each module's own
  // _parameters (the leaf name); no NxD norm is an apex class; empty groups filtered out.
  return TwoGroups("nxdt-biases-apart",
                   "NxDT's megatron models with model.do_layer_norm_weight_decay: False (NeMo "
                   "get_params_for_weight_decay_optimization): norm weights decay, only biases are apart (weight_decay 0.0)",
                   params, [&](size_t i) { return LeafOf(params[i]).ends_with("bias"); }, /*drop_empty=*/true);
}

std::vector<std::string> GroupedNames(std::vector<std::string> names, const std::string& same_stage_copy, GroupingRule rule) {
  if (rule == GroupingRule::kNxdtLayerNormDecay && !same_stage_copy.empty()) std::erase(names, same_stage_copy);
  return names;
}

Grouping NameSplit(const std::vector<std::string>& params) {
  return TwoGroups("name-split",
                   "by name: norm weights and biases apart (NxD's llama example; shardkit's trainer before it followed NeMo)",
                   params, [&](size_t i) { return NamedNormOrBias(params[i]); }, /*drop_empty=*/true);
}

Grouping NxdtHfGrouping(const std::vector<std::string>& params, bool do_layer_norm_weight_decay) {
  // model_utils.py: no_decay = ["bias"] (+ ["LayerNorm", "norm"]), matched as substrings of the name.
  auto apart = [&](size_t i) {
    const std::string& n = params[i];
    return n.find("bias") != std::string::npos ||
           (do_layer_norm_weight_decay && (n.find("LayerNorm") != std::string::npos || n.find("norm") != std::string::npos));
  };
  Grouping g = TwoGroups("nxdt-hf", std::string("NxDT's HF-style models: two groups, ") +
                                        (do_layer_norm_weight_decay ? "norms and biases in group 1 (do_layer_norm_weight_decay: True)"
                                                                    : "only biases in group 1 (do_layer_norm_weight_decay: False)"),
                         params, apart);
  return g;  // two groups, an empty one too
}

}  // namespace ckpt

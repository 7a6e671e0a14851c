// Optimizer parameter groups: which parameters decay, and how optimizer ids
// number them. torch numbers a state dict's ids over group 0's parameters,
// then group 1's, each in the order the group lists them; every rule here
// lists them in module (state-dict) order, so a rule and the parameters in
// module order fix every id.
//
// Two sides use this:
//  - The target (what NxDT and the training core build), GroupingRule below:
//    NxDT's megatron models call NeMo v2.1.0's
//    get_params_for_weight_decay_optimization, or with
//    model.do_layer_norm_weight_decay get_all_params_for_weight_decay_optimization
//    (NxDT lightning_modules/model/megatron/megatron_gpt_model.py
//    setup_optimizer_param_groups; NeMo v2.1.0
//    nemo/collections/nlp/modules/common/megatron/utils.py). NeMo matches
//    norms by apex class, which NxD's RMSNorm and LayerNorm are not, so only
//    biases stay apart, and empty groups are dropped. NxDT's HF-style models
//    group by name instead (NxdtHfGrouping). Both were run on CPU:
//    tests/data/upstream/nxdt_megatron/ and tests/data/upstream/hf_llama/.
//  - What NNM wrote: convert/nnm_grouping.h (NnmGroupingCandidates).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace ckpt {

struct OptimizerSlot {
  std::string name;
  int group;
};

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
};

// One way of grouping a rank's parameters.
struct Grouping {
  std::string id;           // short, for messages and reports: "nnm-rmsnorm", ...
  std::string description;  // what it is and where it comes from
  int groups = 0;           // group count, empty groups included
  std::vector<OptimizerSlot> order;  // optimizer id -> parameter and group
  std::vector<bool> group_decays;    // per group: weight decay applies (else the group's weight_decay is 0.0)

  std::vector<size_t> GroupSizes() const;
  bool Decays(const std::string& name) const;  // in a group that decays
  bool SameTies(const Grouping& o) const;      // every id tied to the same parameter in the same group
};

// Building groupings (here, and for readers of other writers' groupings,
// convert/nnm_grouping.h). Names are parameter names, "a.b.weight":
std::string_view ModuleOf(std::string_view name);  // "a.b"
std::string_view LeafOf(std::string_view name);    // "weight"
// Group 0 (decays) then group 1 (does not), each in the order of `names`.
// With `drop_empty` (NeMo's filter), an empty group is left out.
Grouping TwoGroups(std::string id, std::string description, const std::vector<std::string>& names,
                   const std::function<bool(size_t)>& in_group_1, bool drop_empty = false);
Grouping OneGroup(std::string id, std::string description, const std::vector<std::string>& names);
// The name rule other NeMo versions and NxD's llama example use: biases and
// parameters of modules whose name ends in "norm" are apart.
bool NamedNormOrBias(std::string_view name);

// Which grouping a tag's optimizer files follow.
enum class GroupingRule {
  kNxdt,               // NxDT's, model.do_layer_norm_weight_decay: False
  kNxdtLayerNormDecay,  // NxDT's, model.do_layer_norm_weight_decay: True
  // By name: biases and parameters of modules named "*norm" apart. NxD's own
  // llama example groups so (examples/training/llama/training_utils.py
  // get_param_groups_by_weight_decay: "bias" or "norm" in the name; the tags
  // in tests/data/upstream/nxd_tags), and so did shardkit's trainer before it
  // followed NeMo. Read and carried through; the trainer reads it by name.
  kNameSplit,
};
// NxDT's rule for a model.do_layer_norm_weight_decay setting.
inline GroupingRule NxdtGroupingRule(bool do_layer_norm_weight_decay) {
  return do_layer_norm_weight_decay ? GroupingRule::kNxdtLayerNormDecay : GroupingRule::kNxdt;
}
const char* GroupingRuleName(GroupingRule r);  // "nxdt", "nxdt-layer-norm-decay", "name-split"
bool ParseGroupingRule(std::string_view s, GroupingRule* r);

// NxDT's grouping of a Megatron-style model's parameters (module order; a
// tied parameter listed under each name holding it): NeMo v2.1.0's
// get_params_for_weight_decay_optimization with no apex norm class: group 0
// every parameter whose name does not end in "bias" (norm weights and
// position embeddings decay too), group 1 (weight_decay 0.0) the biases;
// with do_layer_norm_weight_decay, get_all_params_for_weight_decay_optimization:
// one group. NeMo drops empty groups, so a model without biases (Llama) has one
// group whatever the flag says. NeMo's expert groups are always empty here (no
// MoE).
Grouping NxdtGrouping(const std::vector<std::string>& params, bool do_layer_norm_weight_decay);

// The names NeMo's functions list for one stage (module order, GPT's tied
// output copy under its own name): get_all_params_for_weight_decay_optimization
// (kNxdtLayerNormDecay) takes module.parameters(), each parameter once, so a
// copy held on the stage of the parameter it copies (pp = 1) is left out;
// get_params_for_weight_decay_optimization walks each module's own
// parameters and lists it under both names (tests/data/upstream/nxdt_megatron).
std::vector<std::string> GroupedNames(std::vector<std::string> stage_names, const std::string& same_stage_copy, GroupingRule rule);

// kNameSplit: group 0 decaying, group 1 (weight_decay 0) biases and
// parameters of modules whose name ends in "norm"; empty groups dropped.
Grouping NameSplit(const std::vector<std::string>& params);

// What NxDT builds for its HF-style models ("nxdt-hf"; NxDT
// lightning_modules/model/hf_models/base_model.py
// setup_optimizer_param_groups, utils/model_utils.py
// get_param_groups_by_weight_decay, run on CPU: tests/data/upstream/hf_llama/
// optimizer_groups.json): always two groups, empty ones kept; group 1 holds
// every name containing "bias", and with do_layer_norm_weight_decay also
// "LayerNorm" or "norm" (so True keeps norms *out* of decay).
Grouping NxdtHfGrouping(const std::vector<std::string>& params, bool do_layer_norm_weight_decay);

}  // namespace ckpt

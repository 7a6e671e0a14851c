// Optimizer parameter groups: which parameters decay, and how optimizer ids
// number them. torch numbers a state dict's ids over group 0's parameters,
// then group 1's, each in the order the group lists them; every rule here
// lists them in module (state-dict) order, so a rule and the parameters in
// module order fix every id.
//
// Two sides use this:
//  - The target (what NxDT and the training core build): NxDT's default
//    split, group 0 for weights that decay and group 1 (weight_decay 0) for
//    norm weights and every bias, decided by name; with
//    `model.do_layer_norm_weight_decay` one group of everything.
//  - The source (what NNM wrote): NNM's rule decides by module *class*, not by
//    name (get_params_for_weight_decay_optimization in NNM's
//    nemo/collections/nlp/modules/common/megatron/utils.py). A module that is
//    an apex.normalization FusedLayerNorm, FastLayerNorm or MixedFusedRMSNorm
//    puts all its parameters in group 1; any other module puts its `bias` in
//    group 1 and the rest in group 0. GPT's MixedFusedLayerNorm passes that
//    check; Llama's norm, apex.transformer.layers.layer_norm.FastRMSNorm
//    (imported as MixedFusedRMSNorm in NNM's transformer.py), does not, so a
//    Llama's norm weights decay and its group 1 is empty. A file does not
//    record classes, so NnmGroupingCandidates lists every grouping NNM can
//    produce and the caller keeps the ones the file's group sizes and moment
//    shapes fit.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ckpt {

// NxDT's split: norm weights (any module whose name ends in "norm") and biases.
bool IsNoWeightDecay(std::string_view param_name);

struct OptimizerSlot {
  std::string name;
  int group;
};

// NxDT's optimizer ids -> parameters, from the parameters in module order.
std::vector<OptimizerSlot> OptimizerOrder(const std::vector<std::string>& params_in_module_order,
                                          bool do_layer_norm_weight_decay);

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

  std::vector<size_t> GroupSizes() const;
  bool Decays(const std::string& name) const;  // in group 0 of a two-group split, or the one group
  bool SameTies(const Grouping& o) const;      // every id tied to the same parameter in the same group
};

// Every grouping NNM can produce for these parameters (module order, every
// model chunk of the rank in order):
//  - "nnm-rmsnorm": NNM's class rule with a norm class outside apex.normalization
//    (Llama's FastRMSNorm): only biases in group 1, which may be empty;
//  - "nnm-layernorm": NNM's class rule with apex.normalization's classes (GPT's
//    MixedFusedLayerNorm): every parameter of a norm module, and every bias, in
//    group 1. A file names no classes; a norm module is told by its structure:
//    every NNM norm class holds a 1-D `weight` (and maybe a `bias`), which no
//    other NNM module does;
//  - "one-group": `do_layer_norm_weight_decay` (get_all_params_for_weight_decay_optimization);
//  - "name-based": biases, and parameters of modules whose name ends in
//    "norm", in group 1: the convention of other NeMo versions and of NxDT.
std::vector<Grouping> NnmGroupingCandidates(const std::vector<ParamInfo>& params);

// What shardkit's trainer builds over Megatron-style parameters: "nxdt-split"
// (two groups, name-based: norm weights and biases apart) or, with
// do_layer_norm_weight_decay, "nxdt-one-group". Not yet NxDT's own rule for
// its megatron models: NxDT calls NeMo v2.1.0's
// get_params_for_weight_decay_optimization, which matches norms by apex class,
// so NxD's norms decay and only biases go apart (issue #23, to be confirmed by
// running NeMo's code and adopted with fixtures).
Grouping NxdtGrouping(const std::vector<std::string>& params, bool do_layer_norm_weight_decay);

// What NxDT builds for its HF-style models ("nxdt-hf"; NxDT
// lightning_modules/model/hf_models/base_model.py
// setup_optimizer_param_groups, utils/model_utils.py
// get_param_groups_by_weight_decay, run on CPU: tests/data/upstream/hf_llama/
// optimizer_groups.json): always two groups, empty ones kept; group 1 holds
// every name containing "bias", and with do_layer_norm_weight_decay also
// "LayerNorm" or "norm" (so True keeps norms *out* of decay).
Grouping NxdtHfGrouping(const std::vector<std::string>& params, bool do_layer_norm_weight_decay);

}  // namespace ckpt

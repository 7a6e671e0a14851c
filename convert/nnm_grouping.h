// The optimizer groupings NNM writes. NNM's rule decides by module *class*,
// not by name (get_params_for_weight_decay_optimization in NNM's
// nemo/collections/nlp/modules/common/megatron/utils.py). A module that is an
// apex.normalization FusedLayerNorm, FastLayerNorm or MixedFusedRMSNorm puts
// all its parameters in group 1; any other module puts its `bias` in group 1
// and the rest in group 0. GPT's MixedFusedLayerNorm passes that check;
// Llama's norm, apex.transformer.layers.layer_norm.FastRMSNorm (imported as
// MixedFusedRMSNorm in NNM's transformer.py), does not, so a Llama's norm
// weights decay and its group 1 is empty. A file does not record classes, so
// NnmGroupingCandidates lists every grouping NNM can produce and the caller
// keeps the ones the file's group sizes and moment shapes fit. What NxDT
// builds, the target, is ckpt/spec/optimizer_groups.h's.
#pragma once

#include <vector>

#include "ckpt/spec/optimizer_groups.h"

namespace convert {

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
std::vector<ckpt::Grouping> NnmGroupingCandidates(const std::vector<ckpt::ParamInfo>& params);

}  // namespace convert

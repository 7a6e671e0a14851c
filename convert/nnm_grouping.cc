#include "convert/nnm_grouping.h"

#include <set>
#include <string>
#include <string_view>

namespace convert {

using ckpt::Grouping;
using ckpt::LeafOf;
using ckpt::ModuleOf;
using ckpt::NamedNormOrBias;
using ckpt::OneGroup;
using ckpt::ParamInfo;
using ckpt::TwoGroups;

std::vector<Grouping> NnmGroupingCandidates(const std::vector<ParamInfo>& params) {
  std::vector<std::string> names;
  std::set<std::string_view> norm_modules;  // modules holding a 1-D `weight`: NNM's norm classes
  for (const auto& p : params) {
    names.push_back(p.name);
    if (LeafOf(p.name) == "weight" && p.shape.size() == 1) norm_modules.insert(ModuleOf(p.name));
  }
  auto is_bias = [&](size_t i) { return LeafOf(names[i]) == "bias"; };
  std::vector<Grouping> out;
  out.push_back(TwoGroups("nnm-rmsnorm",
                          "NNM's class rule with a norm outside apex.normalization's classes, as NNM's Llama builds it "
                          "(FastRMSNorm): norm weights decay, only biases are in group 1",
                          names, is_bias));
  out.push_back(TwoGroups("nnm-layernorm",
                          "NNM's class rule with apex.normalization's norm classes, as NNM's GPT builds it "
                          "(MixedFusedLayerNorm): norm parameters and biases are in group 1",
                          names, [&](size_t i) { return is_bias(i) || norm_modules.count(ModuleOf(names[i])) > 0; }));
  out.push_back(OneGroup("one-group", "one group, everything decays (do_layer_norm_weight_decay)", names));
  out.push_back(TwoGroups("name-based",
                          "by name: biases and parameters of modules named '*norm' are in group 1 (other NeMo versions)",
                          names, [&](size_t i) { return NamedNormOrBias(names[i]); }));
  return out;
}

}  // namespace convert

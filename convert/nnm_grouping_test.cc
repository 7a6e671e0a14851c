// NNM's groupings: what its class rule puts apart, told from names and shapes.
#include "convert/nnm_grouping.h"

#include <gtest/gtest.h>

namespace convert {
namespace {

using ckpt::Grouping;
using ckpt::ParamInfo;

const Grouping& Find(const std::vector<Grouping>& all, const std::string& id) {
  for (const auto& g : all)
    if (g.id == id) return g;
  throw std::runtime_error("no grouping " + id);
}

std::vector<std::string> Names(const Grouping& g) {
  std::vector<std::string> out;
  for (const auto& s : g.order) out.push_back(s.name);
  return out;
}

TEST(NnmGrouping, NnmLlamaNormsDecayAndGroupOneIsEmpty) {
  const std::vector<ParamInfo> llama = {{"emb.weight", {8, 4}},
                                        {"layers.0.input_layernorm.weight", {4}},
                                        {"layers.0.self_attention.query_key_value.weight", {12, 4}},
                                        {"layers.0.post_attention_layernorm.weight", {4}},
                                        {"final_layernorm.weight", {4}}};
  const auto all = NnmGroupingCandidates(llama);
  const Grouping& rms = Find(all, "nnm-rmsnorm");
  EXPECT_EQ(rms.GroupSizes(), (std::vector<size_t>{5, 0}));
  EXPECT_TRUE(rms.Decays("final_layernorm.weight"));
  const Grouping& ln = Find(all, "nnm-layernorm");
  EXPECT_EQ(ln.GroupSizes(), (std::vector<size_t>{2, 3}));
  EXPECT_EQ(Names(ln), (std::vector<std::string>{"emb.weight", "layers.0.self_attention.query_key_value.weight",
                                                 "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
                                                 "final_layernorm.weight"}));
  EXPECT_TRUE(ln.SameTies(Find(all, "name-based")));  // NNM names every norm module "*norm"
  EXPECT_FALSE(ln.SameTies(rms));
  EXPECT_EQ(Find(all, "one-group").GroupSizes(), (std::vector<size_t>{5}));
}

TEST(NnmGrouping, NnmLayerNormTellsNormModulesByStructureNotName) {
  // A norm module named without "norm" and a matrix named "*_norm": the class
  // rule and the name rule disagree on both, with the same group sizes.
  const std::vector<ParamInfo> odd = {{"w.weight", {4, 4}}, {"ln_a.weight", {4}}, {"x_norm.weight", {4, 4}}};
  const auto all = NnmGroupingCandidates(odd);
  const Grouping& ln = Find(all, "nnm-layernorm");
  const Grouping& name = Find(all, "name-based");
  EXPECT_EQ(ln.GroupSizes(), name.GroupSizes());
  EXPECT_FALSE(ln.SameTies(name));
  EXPECT_EQ(Names(ln), (std::vector<std::string>{"w.weight", "x_norm.weight", "ln_a.weight"}));
  EXPECT_EQ(Names(name), (std::vector<std::string>{"w.weight", "ln_a.weight", "x_norm.weight"}));
}

TEST(NnmGrouping, GptNormBiasesGoWithTheirNormUnderTheClassRule) {
  const std::vector<ParamInfo> gpt = {{"layers.0.input_layernorm.weight", {4}}, {"layers.0.input_layernorm.bias", {4}},
                                      {"layers.0.dense.weight", {4, 4}}, {"layers.0.dense.bias", {4}}};
  const auto all = NnmGroupingCandidates(gpt);
  EXPECT_EQ(Find(all, "nnm-layernorm").GroupSizes(), (std::vector<size_t>{1, 3}));
  // FastRMSNorm-like classes outside the check: the weight decays, the bias does not.
  EXPECT_EQ(Names(Find(all, "nnm-rmsnorm")), (std::vector<std::string>{"layers.0.input_layernorm.weight", "layers.0.dense.weight",
                                                                        "layers.0.input_layernorm.bias", "layers.0.dense.bias"}));
}

}  // namespace
}  // namespace convert

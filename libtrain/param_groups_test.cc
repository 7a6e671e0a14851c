#include "libtrain/param_groups.h"

#include <gtest/gtest.h>

namespace train {
namespace {

TEST(ParamGroups, NormsAndBiasesDoNotDecay) {
  EXPECT_TRUE(IsNoWeightDecay("language_model.encoder.layers.3.input_layernorm.weight"));
  EXPECT_TRUE(IsNoWeightDecay("language_model.encoder.final_layernorm.bias"));
  EXPECT_TRUE(IsNoWeightDecay("language_model.encoder.layers.0.self_attention.dense.bias"));
  EXPECT_FALSE(IsNoWeightDecay("language_model.encoder.layers.0.self_attention.dense.weight"));
  EXPECT_FALSE(IsNoWeightDecay("language_model.embedding.word_embeddings.weight"));
  // "norm" must end the module name, not just appear in it.
  EXPECT_FALSE(IsNoWeightDecay("language_model.normalizer.weight"));
}

TEST(ParamGroups, IdsNumberGroupZeroThenGroupOneInModuleOrder) {
  const std::vector<std::string> params = {"emb.weight", "l0.input_layernorm.weight", "l0.dense.weight", "l0.dense.bias",
                                           "final_layernorm.weight", "out.weight"};
  const auto two = OptimizerOrder(params, false);
  std::vector<std::string> names;
  std::vector<int> groups;
  for (const auto& s : two) names.push_back(s.name), groups.push_back(s.group);
  EXPECT_EQ(names, (std::vector<std::string>{"emb.weight", "l0.dense.weight", "out.weight", "l0.input_layernorm.weight",
                                             "l0.dense.bias", "final_layernorm.weight"}));
  EXPECT_EQ(groups, (std::vector<int>{0, 0, 0, 1, 1, 1}));
  const auto one = OptimizerOrder(params, true);
  ASSERT_EQ(one.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(one[i].name, params[i]);
    EXPECT_EQ(one[i].group, 0);
  }
}

}  // namespace
}  // namespace train

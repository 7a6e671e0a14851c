#include "ckpt/spec/optimizer_groups.h"

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace ckpt {
namespace {

std::vector<std::string> NamesOf(const Grouping& g) {
  std::vector<std::string> out;
  for (const auto& s : g.order) out.push_back(s.name);
  return out;
}

const std::vector<std::string> kGptParams = {"emb.weight",           "pos.weight",     "l0.input_layernorm.weight",
                                             "l0.input_layernorm.bias", "l0.dense.weight", "l0.dense.bias",
                                             "final_layernorm.weight", "final_layernorm.bias", "out.weight"};

TEST(OptimizerGroups, NxdtMegatronKeepsOnlyBiasesApartAsNeMoDoes) {
  // NeMo v2.1.0 get_params_for_weight_decay_optimization with no apex norm class.
  const Grouping g = NxdtGrouping(kGptParams, false);
  EXPECT_EQ(NamesOf(g), (std::vector<std::string>{"emb.weight", "pos.weight", "l0.input_layernorm.weight", "l0.dense.weight",
                                                  "final_layernorm.weight", "out.weight", "l0.input_layernorm.bias",
                                                  "l0.dense.bias", "final_layernorm.bias"}));
  EXPECT_EQ(g.GroupSizes(), (std::vector<size_t>{6, 3}));
  EXPECT_EQ(g.group_decays, (std::vector<bool>{true, false}));
  EXPECT_TRUE(g.Decays("l0.input_layernorm.weight"));
  EXPECT_FALSE(g.Decays("l0.dense.bias"));
  // get_all_params_for_weight_decay_optimization: one group in module order.
  const Grouping one = NxdtGrouping(kGptParams, true);
  EXPECT_EQ(NamesOf(one), kGptParams);
  EXPECT_EQ(one.group_decays, (std::vector<bool>{true}));
}

// NeMo v2.1.0's functions run over NxDT's own GPT and Llama on CPU
// (tests/data/upstream/nxdt_megatron): every position of every group is the
// parameter NxdtGrouping puts there (a tied parameter is listed under each
// name holding it), and the groups decay alike.
TEST(OptimizerGroups, NxdtGroupingIsWhatNeMoBuildsForNxdtsModels) {
  std::ifstream in(std::string(SHARDKIT_TEST_DATA) + "/upstream/nxdt_megatron/megatron_groups.json");
  ASSERT_TRUE(in) << "missing fixture tests/data/upstream/nxdt_megatron/megatron_groups.json";
  const nlohmann::json j = nlohmann::json::parse(in);
  int checked = 0;
  for (const char* model : {"gpt", "llama"}) {
    const nlohmann::json& m = j.at("models").at(model);
    std::vector<std::string> params, once;  // every name holding a parameter; each parameter once (named_parameters)
    for (const auto& e : m.at("model").at("state_dict")) {
      if (e.at("kind") != "parameter") continue;
      params.push_back(e.at("key"));
      bool seen = false;
      for (const auto& other : e.at("same_object_as"))
        seen |= std::find(once.begin(), once.end(), other.get<std::string>()) != once.end();
      if (!seen) once.push_back(e.at("key"));
    }
    for (bool flag : {false, true}) {
      const nlohmann::json& want = m.at("groups").at(flag ? "do_layer_norm_weight_decay=true" : "do_layer_norm_weight_decay=false").at("groups");
      // get_all_params_for_weight_decay_optimization takes module.parameters(): a tied parameter once;
      // the other walks each module's own parameters: once per module holding it.
      const Grouping g = NxdtGrouping(flag ? once : params, flag);
      ASSERT_EQ(g.groups, static_cast<int>(want.size())) << model << " flag " << flag;
      size_t at = 0;
      for (int gi = 0; gi < g.groups; ++gi) {
        const nlohmann::json& wg = want[gi];
        EXPECT_EQ(g.group_decays[gi], wg.at("options").value("weight_decay", 0.01) != 0.0) << model << " group " << gi;
        EXPECT_EQ(g.GroupSizes()[gi], wg.at("params").size()) << model << " flag " << flag << " group " << gi;
        for (const auto& holders : wg.at("params")) {
          ASSERT_LT(at, g.order.size());
          const std::vector<std::string> names_here = holders.get<std::vector<std::string>>();
          EXPECT_NE(std::find(names_here.begin(), names_here.end(), g.order[at].name), names_here.end())
              << model << " flag " << flag << " position " << at << ": " << g.order[at].name;
          ++at, ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 60);
}

TEST(OptimizerGroups, NxdtMegatronDropsTheEmptyBiasGroup) {
  const std::vector<std::string> llama = {"emb.weight", "l0.input_layernorm.weight", "l0.qkv.weight", "final_layernorm.weight", "out.weight"};
  for (bool flag : {false, true}) {
    const Grouping g = NxdtGrouping(llama, flag);
    EXPECT_EQ(g.groups, 1) << flag;
    EXPECT_EQ(NamesOf(g), llama) << flag;
    EXPECT_EQ(g.group_decays, (std::vector<bool>{true})) << flag;
  }
}

TEST(OptimizerGroups, NameSplitKeepsNormsAndBiasesApart) {
  const Grouping old = NameSplit(kGptParams);
  EXPECT_EQ(old.GroupSizes(), (std::vector<size_t>{4, 5}));
  EXPECT_FALSE(old.Decays("l0.input_layernorm.weight"));
  EXPECT_TRUE(old.Decays("pos.weight"));
  for (GroupingRule r : {GroupingRule::kNxdt, GroupingRule::kNxdtLayerNormDecay, GroupingRule::kNameSplit}) {
    GroupingRule back;
    ASSERT_TRUE(ParseGroupingRule(GroupingRuleName(r), &back));
    EXPECT_EQ(back, r);
  }
  GroupingRule x;
  EXPECT_FALSE(ParseGroupingRule("nxdt-split", &x));
}

TEST(OptimizerGroups, NxdtHfKeepsBothGroupsEvenEmpty) {
  const std::vector<std::string> hf = {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"};
  const Grouping g = NxdtHfGrouping(hf, false);
  EXPECT_EQ(g.GroupSizes(), (std::vector<size_t>{3, 0}));
  EXPECT_EQ(NxdtHfGrouping(hf, true).GroupSizes(), (std::vector<size_t>{2, 1}));
}

}  // namespace
}  // namespace ckpt

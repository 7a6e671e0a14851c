#include "ckpt/spec/tag_paths.h"

#include <gtest/gtest.h>

#include "ckpt/testing/test_util.h"

namespace ckpt {

TEST(TagPaths, RankFileNamesRoundTripWithMinimumWidth) {
  EXPECT_EQ(RankFileName({0, 3, 1}), "dp_rank_00_tp_rank_03_pp_rank_01.pt");
  EXPECT_EQ(RankFileName({100, 7, 12}), "dp_rank_100_tp_rank_07_pp_rank_12.pt");
  EXPECT_EQ(ParseRankFileName("dp_rank_100_tp_rank_07_pp_rank_12.pt"), (RankCoord{100, 7, 12}));
  EXPECT_NE(testing::ErrorOf([] { ParseRankFileName("dp_rank_01_ep_rank_02_tp_rank_03_pp_rank_04.pt"); }).find("expert-parallel"), std::string::npos);
  EXPECT_FALSE(ParseRankFileName("tp_rank_00_pp_rank_000").has_value());
  EXPECT_FALSE(ParseRankFileName("dp_rank_00_tp_rank_00_pp_rank_00.pt.info.pt").has_value());
}

TEST(TagPaths, GridListsModelAndOptimFiles) {
  RankGrid g{2, 2, 3, true};
  EXPECT_EQ(g.ModelFiles().size(), 4u);
  EXPECT_EQ(g.OptimFiles().size(), 12u);
  EXPECT_EQ(g.OptimFiles().back(), "optim/dp_rank_02_tp_rank_01_pp_rank_01.pt");
  g.zero1 = false;
  EXPECT_EQ(g.OptimFiles().size(), 4u);
}

TEST(TagPaths, TagNamesFollowNxdt) {
  TagName t{"megatron_llama", 5, 5120, false};
  EXPECT_EQ(FormatTagName(t), "megatron_llama--step=5-consumed_samples=5120.0.ckpt");
  t.last = true;
  EXPECT_EQ(FormatTagName(t), "megatron_llama--step=5-consumed_samples=5120.0-last.ckpt");
  auto p = ParseTagName("megatron_llama--step=1085-consumed_samples=69632.0-last.ckpt");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->name, "megatron_llama");
  EXPECT_EQ(p->step, 1085);
  EXPECT_EQ(p->consumed_samples, 69632.0);
  EXPECT_TRUE(p->last);
  EXPECT_FALSE(ParseTagName("random_dir").has_value());
}

}  // namespace ckpt

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

// NxD trainer/checkpoint.py _get_path: "_dp_rank_{:02d}", then "_ep_rank_{:02d}" with ep, tp, pp.
TEST(TagPaths, ExpertParallelNamesCarryTheEpRankAfterDp) {
  RankCoord c{0, 3, 1};
  c.ep = 2;
  EXPECT_EQ(RankFileName(c), "dp_rank_00_ep_rank_02_tp_rank_03_pp_rank_01.pt");
  EXPECT_EQ(ParseAnyRankFileName("dp_rank_00_ep_rank_02_tp_rank_03_pp_rank_01.pt"), c);
  EXPECT_EQ(ParseAnyRankFileName("dp_rank_01_tp_rank_03_pp_rank_01.pt"), (RankCoord{1, 3, 1}));
  EXPECT_FALSE(ParseAnyRankFileName("dp_rank_00_ep_rank__tp_rank_03_pp_rank_01.pt").has_value());
  const std::string why = testing::ErrorOf([] { ParseRankFileName("dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"); });
  EXPECT_NE(why.find("MoE"), std::string::npos) << why;
}

// ep inside dp (NxD parallel_state.py: DP=1 is DP_EXP=0, EP=1): model files per ep rank, dp 0's names.
TEST(TagPaths, ExpertParallelGridListsOneModelFilePerEpRank) {
  RankGrid g{2, 1, 4, true};
  g.ep = 2;
  EXPECT_EQ(g.ModelFiles(), (std::vector<std::string>{"model/dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_ep_rank_00_tp_rank_01_pp_rank_00.pt",
                                                      "model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00.pt"}));
  EXPECT_EQ(g.OptimFiles().size(), 8u);  // ZeRO-1's names carry no ep (_get_path(dp=True))
  EXPECT_EQ(g.FileOf(RankFileKind::kModel, {3, 1, 0}), "model/dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00.pt");
  EXPECT_EQ(g.FileOf(RankFileKind::kModel, {2, 1, 0}), "model/dp_rank_00_ep_rank_00_tp_rank_01_pp_rank_00.pt");
  EXPECT_EQ(g.AxisCoordsOf({3, 0, 0})[Axis::kEp], (AxisPlace{2, 1}));
  EXPECT_EQ(g.ToString(), "tp 2, pp 1, dp 4, ep 2 (ZeRO-1)");
  g.ep = 1;
  EXPECT_EQ(g.ModelFiles().front(), "model/dp_rank_00_tp_rank_00_pp_rank_00.pt");
}

// NxD names the ep rank in every model file, and only at ep size > 1 (trainer/checkpoint.py _get_path).
TEST(TagPaths, EpRanksAreNamedInEveryModelFileOrNone) {
  RankCoord e0{0, 0, 0}, e1{0, 1, 0};
  e0.ep = 0, e1.ep = 1;
  EXPECT_EQ(EpNamingProblem({e0, e1}), "");
  EXPECT_EQ(EpNamingProblem({RankCoord{0, 0, 0}, RankCoord{0, 1, 0}}), "");
  EXPECT_TRUE(EpNamingProblem({RankCoord{0, 0, 0}, e1}).starts_with("an expert-parallel rank file (_ep_rank_) beside model files without an ep rank"));
  EXPECT_TRUE(EpNamingProblem({e0}).starts_with("an expert-parallel rank file (_ep_rank_) of ep rank 0 alone"));
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

#include "ckpt/spec/rank_grid.h"

#include <gtest/gtest.h>

#include <set>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

// NxD's parallel_state builds the groups from rank ranges: a tensor-parallel
// group is tp consecutive ranks, a data-parallel group takes every tp-th rank
// within one stage's block of tp*dp ranks, a pipeline group every (tp*dp)-th
// rank. Those groups, written out for tp 2, dp 2, pp 2 (8 ranks):
TEST(RankGrid, GroupsAreNxDParallelStateGroups) {
  const RankGrid g{.tp = 2, .pp = 2, .dp = 2};
  ASSERT_EQ(g.world_size(), 8);
  EXPECT_EQ(g.TpGroup(5), (std::vector<int>{4, 5}));
  EXPECT_EQ(g.DpGroup(5), (std::vector<int>{5, 7}));
  EXPECT_EQ(g.PpGroup(5), (std::vector<int>{1, 5}));
  EXPECT_EQ(g.CoordOf(5), (RankCoord{.dp = 0, .tp = 1, .pp = 1}));
  EXPECT_EQ(g.CoordOf(6), (RankCoord{.dp = 1, .tp = 0, .pp = 1}));
}

TEST(RankGrid, CoordinatesAreABijection) {
  const RankGrid g{.tp = 4, .pp = 3, .dp = 2};
  std::set<std::tuple<int, int, int>> seen;
  for (int r = 0; r < g.world_size(); ++r) {
    const RankCoord c = g.CoordOf(r);
    EXPECT_EQ(g.RankOf(c), r);
    EXPECT_TRUE(c.tp < 4 && c.pp < 3 && c.dp < 2);
    seen.insert({c.dp, c.tp, c.pp});
    for (int q : g.TpGroup(r)) EXPECT_EQ(g.CoordOf(q).pp, c.pp);
  }
  EXPECT_EQ(seen.size(), 24u);
}

TEST(RankGrid, ForWorldDerivesDpOrNamesWhatDoesNotDivide) {
  EXPECT_EQ(RankGrid::ForWorld(8, 2, 2, true, "x"), (RankGrid{.tp = 2, .pp = 2, .dp = 2, .zero1 = true}));
  try {
    RankGrid::ForWorld(6, 4, 1, false, "conf.yaml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("conf.yaml: tensor_model_parallel_size (4) * pipeline_model_parallel_size (1) = 4 does not divide the world size (6)"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(RankGrid::ForWorld(4, 0, 1, false, "x"), Error);
}

TEST(RankGrid, FilesOfATag) {
  const RankGrid g{.tp = 2, .pp = 1, .dp = 2, .zero1 = true};
  EXPECT_EQ(g.ModelFiles(), (std::vector<std::string>{"model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_01_pp_rank_00.pt"}));
  EXPECT_EQ(g.OptimFiles().size(), 4u);
  EXPECT_EQ(g.OptimFiles()[2], "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt");
  EXPECT_EQ(g.ToString(), "tp 2, pp 1, dp 2 (ZeRO-1)");
}

}  // namespace
}  // namespace ckpt

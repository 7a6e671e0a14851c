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
  EXPECT_EQ(g.Group(5, {Axis::kTp}), (std::vector<int>{4, 5}));
  EXPECT_EQ(g.Group(5, {Axis::kDp}), (std::vector<int>{5, 7}));
  EXPECT_EQ(g.Group(5, {Axis::kPp}), (std::vector<int>{1, 5}));
  EXPECT_EQ(g.CoordOf(5), (RankCoord{.dp = 0, .tp = 1, .pp = 1}));
  EXPECT_EQ(g.CoordOf(6), (RankCoord{.dp = 1, .tp = 0, .pp = 1}));
}

// Expert parallelism inside dp: tp 2, dp 4, ep 2 (8 ranks; dp rank d at
// ranks 2d, 2d + 1). The ep groups are consecutive dp ranks {0, 1}, {2, 3}
// (same dp / ep); the expert-dp groups dp ranks {0, 2}, {1, 3} (same dp % ep).
TEST(RankGrid, ExpertGroupsLieInsideDp) {
  const RankGrid g{.tp = 2, .pp = 1, .dp = 4, .ep = 2};
  EXPECT_EQ(g.ExpertGroup(5, ExpertAxis::kEp), (std::vector<int>{5, 7}));        // dp 2 and 3, tp 1
  EXPECT_EQ(g.ExpertGroup(5, ExpertAxis::kExpertDp), (std::vector<int>{1, 5}));  // dp 0 and 2, tp 1
  EXPECT_EQ(g.ExpertGroup(2, ExpertAxis::kEp), (std::vector<int>{0, 2}));
  const RankGrid one{.tp = 2, .pp = 1, .dp = 2};
  EXPECT_EQ(one.ExpertGroup(3, ExpertAxis::kEp), (std::vector<int>{3}));
  EXPECT_EQ(one.ExpertGroup(3, ExpertAxis::kExpertDp), one.Group(3, {Axis::kDp}));
}

TEST(RankGrid, CoordinatesAreABijection) {
  const RankGrid g{.tp = 4, .pp = 3, .dp = 2};
  std::set<std::tuple<int, int, int>> seen;
  for (int r = 0; r < g.world_size(); ++r) {
    const RankCoord c = g.CoordOf(r);
    EXPECT_EQ(g.RankOf(c), r);
    EXPECT_TRUE(c.tp < 4 && c.pp < 3 && c.dp < 2);
    seen.insert({c.dp, c.tp, c.pp});
    for (int q : g.Group(r, {Axis::kTp})) EXPECT_EQ(g.CoordOf(q).pp, c.pp);
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

// Groups over several axes come from the same generator: NxD's
// model-parallel group is {tp, pp}, the ranks of one dp rank
// (parallel_state.py initialize_model_parallel), and the groups over any set
// of axes partition the world.
TEST(RankGrid, GroupsOverAnySetOfAxesPartitionTheWorld) {
  const RankGrid g{.tp = 2, .pp = 2, .dp = 3};
  EXPECT_EQ(g.Group(3, {Axis::kTp, Axis::kPp}), (std::vector<int>{2, 3, 8, 9}));
  EXPECT_EQ(g.Group(3, {Axis::kTp, Axis::kDp}), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(g.Group(7, {}), (std::vector<int>{7}));
  EXPECT_EQ(g.Group(7, {Axis::kTp, Axis::kDp, Axis::kPp}).size(), 12u);
  EXPECT_EQ(g.Group(7, {Axis::kEp}), (std::vector<int>{7}));  // an axis the grid does not lay out: size 1
  for (std::initializer_list<Axis> axes : {std::initializer_list<Axis>{Axis::kDp}, {Axis::kPp, Axis::kDp}}) {
    std::vector<int> seen(g.world_size(), 0);
    for (int r = 0; r < g.world_size(); ++r)
      if (g.Group(r, axes).front() == r)
        for (int q : g.Group(r, axes)) ++seen[q];
    EXPECT_EQ(seen, std::vector<int>(g.world_size(), 1));
  }
  const AxisCoords at = g.AxisCoordsOf(g.CoordOf(9));
  EXPECT_EQ(at[Axis::kTp], (AxisPlace{2, 1}));
  EXPECT_EQ(at[Axis::kDp], (AxisPlace{3, 1}));
  EXPECT_EQ(at[Axis::kPp], (AxisPlace{2, 1}));
  EXPECT_EQ(at[Axis::kEp], (AxisPlace{1, 0}));
}

TEST(RankGrid, EachRankFileOnceAndTheFileEachRankWrites) {
  RankGrid g{.tp = 2, .pp = 2, .dp = 3, .zero1 = true};
  std::vector<RankCoord> optim;
  g.ForEachRankFile(RankFileKind::kOptim, [&](const RankCoord& c) { optim.push_back(c); });
  ASSERT_EQ(optim.size(), 12u);
  EXPECT_EQ(optim[1], (RankCoord{.dp = 0, .tp = 1, .pp = 0}));
  EXPECT_EQ(optim[2], (RankCoord{.dp = 0, .tp = 0, .pp = 1}));
  EXPECT_EQ(optim[4], (RankCoord{.dp = 1, .tp = 0, .pp = 0}));
  std::vector<RankCoord> of_place;
  g.ForEachRankFile(RankFileKind::kOptim, {.dp = 2, .tp = 1, .pp = 1}, [&](const RankCoord& c) { of_place.push_back(c); });
  EXPECT_EQ(of_place, (std::vector<RankCoord>{{0, 1, 1}, {1, 1, 1}, {2, 1, 1}}));
  EXPECT_EQ(g.FileOf(RankFileKind::kOptim, {.dp = 2, .tp = 1, .pp = 0}), "optim/dp_rank_02_tp_rank_01_pp_rank_00.pt");
  EXPECT_EQ(g.FileOf(RankFileKind::kModel, {.dp = 2, .tp = 1, .pp = 0}), "model/dp_rank_00_tp_rank_01_pp_rank_00.pt");
  g.zero1 = false;
  of_place.clear();
  g.ForEachRankFile(RankFileKind::kOptim, {.dp = 2, .tp = 1, .pp = 1}, [&](const RankCoord& c) { of_place.push_back(c); });
  EXPECT_EQ(of_place, (std::vector<RankCoord>{{0, 1, 1}}));
  EXPECT_EQ(g.FileOf(RankFileKind::kOptim, {.dp = 2, .tp = 1, .pp = 0}), "optim/dp_rank_00_tp_rank_01_pp_rank_00.pt");
  EXPECT_EQ(g.OptimFiles().size(), 4u);
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

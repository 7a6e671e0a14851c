#include "ckpt/spec/shard_spec.h"

#include <gtest/gtest.h>

#include <vector>

namespace ckpt {
namespace {

AxisCoords At(int ep_size, int ep, int tp_size, int tp) {
  AxisCoords c = AxisCoords::Tp(tp_size, tp);
  c[Axis::kEp] = {ep_size, ep};
  return c;
}

// Mixtral's expert MLP input (NxDT's 3-D experts x hidden x 2 ffn weight):
// experts split over ep, the fused [gate; up] columns over tp with stride 2.
ShardSpec Experts(int64_t experts, int64_t hidden, int64_t ffn) {
  return ShardSpec::Whole({experts, hidden, 2 * ffn}, {Axis::kDp})
      .Split(0, {.axis = Axis::kEp})
      .Split(2, {.axis = Axis::kTp, .kind = SplitKind::kStrided, .parts = 2});
}

TEST(ShardSpec, ThreeDimensionalExpertBoxesOverEpAndTp) {
  const ShardSpec s = Experts(4, 8, 6);
  const std::vector<Box> boxes = BoxesOf(s, At(2, 1, 3, 2));
  // Experts [2, 4); gate columns [4, 6) and up columns [10, 12), local [0, 2) and [2, 4).
  ASSERT_EQ(boxes.size(), 2u);
  EXPECT_EQ(boxes[0], (Box{{2, 0, 4}, {2, 8, 2}, {0, 0, 0}}));
  EXPECT_EQ(boxes[1], (Box{{2, 0, 10}, {2, 8, 2}, {0, 0, 2}}));
  EXPECT_EQ(LocalShapeOf(s, At(2, 1, 3, 2)), (std::vector<int64_t>{2, 8, 4}));
  EXPECT_EQ(DimRuns(s, 1, At(2, 1, 3, 2)), (std::vector<ckpt::Run>{{0, 0, 8}}));
}

TEST(ShardSpec, BoxesOfEveryRankTileTheGlobalTensorOnce) {
  const ShardSpec s = Experts(4, 3, 6);
  std::vector<int> seen(4 * 3 * 12, 0);
  for (int e = 0; e < 2; ++e)
    for (int t = 0; t < 3; ++t) {
      const std::vector<int64_t> local = LocalShapeOf(s, At(2, e, 3, t));
      std::vector<int> local_seen(local[0] * local[1] * local[2], 0);
      for (const Box& b : BoxesOf(s, At(2, e, 3, t)))
        for (int64_t i = 0; i < b.size[0]; ++i)
          for (int64_t j = 0; j < b.size[1]; ++j)
            for (int64_t k = 0; k < b.size[2]; ++k) {
              ++seen[((b.offset[0] + i) * 3 + b.offset[1] + j) * 12 + b.offset[2] + k];
              ++local_seen[((b.local[0] + i) * local[1] + b.local[1] + j) * local[2] + b.local[2] + k];
            }
      EXPECT_EQ(local_seen, std::vector<int>(local_seen.size(), 1)) << "ep " << e << " tp " << t;
    }
  EXPECT_EQ(seen, std::vector<int>(seen.size(), 1));
}

TEST(ShardSpec, WholeSpecIsOneBoxAndScalarOneEmptyBox) {
  EXPECT_EQ(BoxesOf(ShardSpec::Whole({5, 2}), AxisCoords::Tp(4, 3)), (std::vector<Box>{{{0, 0}, {5, 2}, {0, 0}}}));
  EXPECT_EQ(BoxesOf(ShardSpec::Whole({}), AxisCoords::Tp(4, 3)), (std::vector<Box>{Box{}}));
}

TEST(ShardSpec, HeadSplitReplicatesKvHeadsConsecutiveOrInterleaved) {
  // [Q; K; V], 8 query heads and 2 KV heads of 2 rows, KV replicated x2 over tp 4.
  HeadSplit h{{{8, 2, false}, {2, 2, true}, {2, 2, true}}, 2, 2, KvOrder::kInterleaved};
  ShardSpec s = ShardSpec::Whole({24, 3}).Split(0, {.kind = SplitKind::kHeads, .heads = h});
  // Interleaved (NxD Trn1): rank 1 holds KV head 1 and query block 1 * 2 + 0 = 2: heads 4, 5.
  EXPECT_EQ(KvHeadsOf(h, 4, 1), (std::vector<int64_t>{1}));
  EXPECT_EQ(QueryHeadsOf(h, 8, 4, 1), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(DimRuns(s, 0, AxisCoords::Tp(4, 1)), (std::vector<ckpt::Run>{{0, 8, 4}, {4, 18, 2}, {6, 22, 2}}));
  // Consecutive (NxD Trn2): rank 1 holds KV head 0 and query heads 2, 3.
  s.dims[0]->heads.order = KvOrder::kConsecutive;
  EXPECT_EQ(DimRuns(s, 0, AxisCoords::Tp(4, 1)), (std::vector<ckpt::Run>{{0, 4, 4}, {4, 16, 2}, {6, 20, 2}}));
  EXPECT_EQ(LocalShapeOf(s, AxisCoords::Tp(4, 1)), (std::vector<int64_t>{8, 3}));
}

TEST(ShardSpec, KvMultiplierZeroReplicatesAsTheAxisNeeds) {
  // Megatron's key_value: 2 groups of 4 rows; at tp 4 each group is on two consecutive ranks.
  const HeadSplit h{{{2, 4, true}}, 2, 0, KvOrder::kConsecutive};
  const ShardSpec s = ShardSpec::Whole({8, 5}).Split(0, {.kind = SplitKind::kHeads, .heads = h});
  EXPECT_EQ(DimRuns(s, 0, AxisCoords::Tp(4, 2)), (std::vector<ckpt::Run>{{0, 4, 4}}));
  EXPECT_EQ(DimRuns(s, 0, AxisCoords::Tp(4, 1)), (std::vector<ckpt::Run>{{0, 0, 4}}));
  // At tp 2 or 1 the groups are split, not replicated: whole runs merged.
  EXPECT_EQ(DimRuns(s, 0, AxisCoords::Tp(2, 1)), (std::vector<ckpt::Run>{{0, 4, 4}}));
  EXPECT_EQ(DimRuns(s, 0, AxisCoords::Tp(1, 0)), (std::vector<ckpt::Run>{{0, 0, 8}}));
}

TEST(ShardSpec, FirstReplicaIsIndexZeroAlongEveryReplicatedAxis) {
  const ShardSpec s = ShardSpec::Whole({4}, {Axis::kTp, Axis::kDp});
  AxisCoords c = AxisCoords::Tp(2, 0);
  c[Axis::kDp] = {2, 0};
  EXPECT_TRUE(IsFirstReplica(s, c));
  c[Axis::kDp].index = 1;
  EXPECT_FALSE(IsFirstReplica(s, c));
  c = AxisCoords::Tp(2, 1);
  EXPECT_FALSE(IsFirstReplica(s, c));
  EXPECT_TRUE(IsFirstReplica(ShardSpec::Whole({4}, {Axis::kDp}), c));
}

// A box's runs stop at its innermost edge unless it spans the tensor's inner dimensions.
TEST(BoxWalk, RunsFollowTheBoxAndTheTensor) {
  const std::vector<int64_t> shape{4, 6};
  EXPECT_EQ(FlatIndex({2, 3}, shape), 15);
  std::vector<int64_t> p;
  PointOf(15, shape, p);
  EXPECT_EQ(p, (std::vector<int64_t>{2, 3}));
  // Columns [2, 5) of rows [1, 3): three elements a row.
  EXPECT_EQ(RunInBox({1, 2}, {2, 3}, shape, {1, 3}), 2);
  // Whole rows [1, 3): the run goes on to the box's last row.
  EXPECT_EQ(RunInBox({1, 0}, {2, 6}, shape, {1, 3}), 9);
  EXPECT_EQ(RunInBox({}, {}, {}, {}), 1);
  std::vector<int64_t> q{1, 4};
  AdvanceInBox({1, 2}, {2, 3}, q, 2);  // past the row's end: the next row's second column of the box
  EXPECT_EQ(q, (std::vector<int64_t>{2, 3}));
}

}  // namespace
}  // namespace ckpt

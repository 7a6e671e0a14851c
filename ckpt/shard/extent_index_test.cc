// ExtentIndex: rank tensors' runs indexed, covered, compared and read back as logical tensors.
#include "ckpt/shard/extent_index.h"

#include <gtest/gtest.h>

#include <cstring>

#include "ckpt/spec/partition.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::Arange;
using testing::ErrorOf;

// tp rank t's local tensor of a logical `rows` x `cols` arange split by `split` over `tp`.
Tensor Local(const ParamRule& r, const ModelFormat& f, int tp, int t) {
  const Tensor whole = Arange(r.shape);
  Tensor x = Tensor::Zeros(DType::kFloat32, LocalShape(r, f, tp, t));
  const float* src = reinterpret_cast<const float*>(whole.data());
  float* dst = reinterpret_cast<float*>(x.mutable_data());
  const int64_t cols = r.shape[1], lcols = x.shape()[1];
  for (const Run& run : LocalRuns(r, f, tp, t))
    for (int64_t i = 0; i < run.count; ++i)
      for (int64_t row = 0; row < x.shape()[0]; ++row)
        for (int64_t c = 0; c < lcols; ++c) {
          if (r.split == SplitDim::kRows && row == run.local + i) dst[row * lcols + c] = src[(run.logical + i) * cols + c];
          if (r.split == SplitDim::kColumns && c == run.local + i) dst[row * lcols + c] = src[row * cols + run.logical + i];
          if (r.split == SplitDim::kReplicated) dst[row * lcols + c] = src[row * cols + c];
        }
  return x;
}

// A rule as a family's table makes it: with its spec.
ParamRule Rule(const std::string& name, std::vector<int64_t> shape, SplitDim split) {
  ParamRule r{.name = name, .shape = shape, .split = split};
  r.spec = TensorParallelSpec(shape, split, FusedRows::kPlain, ModelFormat{});
  return r;
}

std::vector<float> ReadAll(const ExtentIndex& idx, const std::string& name, uint64_t begin, uint64_t n) {
  std::vector<uint8_t> out(n * 4);
  idx.Read(name, StateField::kParam, begin, out, nullptr);
  std::vector<float> got(n);
  std::memcpy(got.data(), out.data(), out.size());
  return got;
}

TEST(ExtentIndex, RowAndColumnSplitsReadBackAsTheLogicalTensor) {
  const ModelFormat f;
  for (SplitDim split : {SplitDim::kRows, SplitDim::kColumns}) {
    const ParamRule r = Rule("w", {4, 6}, split);
    ExtentIndex idx;
    ExtentIndex::Holders owner;
    std::vector<Tensor> locals;
    for (int t = 0; t < 2; ++t) locals.push_back(Local(r, f, 2, t));
    for (int t = 0; t < 2; ++t)
      idx.AddBoxes(r, AxisCoords::Tp(2, t), StateField::kParam, locals[t], nullptr, 0, locals[t].shape()[0], owner, DType::kFloat32, "w");
    idx.CheckCovered("tag", {r});
    const auto all = ReadAll(idx, "w", 0, 24);
    for (int i = 0; i < 24; ++i) ASSERT_EQ(all[i], static_cast<float>(i)) << "element " << i;
    EXPECT_EQ(ReadAll(idx, "w", 7, 3), (std::vector<float>{7, 8, 9}));
  }
}

TEST(ExtentIndex, AMissingRankIsAGapNamedByItsElements) {
  const ModelFormat f;
  const ParamRule r = Rule("w", {4, 3}, SplitDim::kRows);
  ExtentIndex idx;
  ExtentIndex::Holders owner;
  const Tensor x = Local(r, f, 2, 1);  // rows 2..3 only
  idx.AddBoxes(r, AxisCoords::Tp(2, 1), StateField::kParam, x, nullptr, 0, 2, owner, DType::kFloat32, "w");
  EXPECT_EQ(ErrorOf([&] { idx.CheckCovered("tag", {r}); }), "tag: w (param): the rank files do not cover elements 0..6 of it");
}

TEST(ExtentIndex, ReplicasMustEqualTheirFirstHolder) {
  const ModelFormat f;
  const ParamRule r = Rule("norm", {1, 4}, SplitDim::kReplicated);
  ExtentIndex idx;
  ExtentIndex::Holders owner;
  Tensor a = Local(r, f, 2, 0), b = Local(r, f, 2, 1);
  idx.AddBoxes(r, AxisCoords::Tp(2, 0), StateField::kParam, a, nullptr, 0, 1, owner, DType::kFloat32, "norm");
  idx.AddBoxes(r, AxisCoords::Tp(2, 1), StateField::kParam, b, nullptr, 0, 1, owner, DType::kFloat32, "norm");
  idx.CheckCovered("tag", {r});
  EXPECT_EQ(ErrorOf([&] { idx.CompareReplicas("tag", f); }), "");
  reinterpret_cast<float*>(b.mutable_data())[2] = 9;
  EXPECT_EQ(ErrorOf([&] { idx.CompareReplicas("tag", f); }),
            "tag: 'norm' (param): tp ranks 0 and 1 hold different copies of logical elements 0..3, which both replicate (NxD keeps "
            "replicas equal); --trust_first_replica reads tp rank 0's");
}

TEST(ExtentIndex, ADtypeOtherRanksDoNotHoldIsRefused) {
  const ModelFormat f;
  const ParamRule r = Rule("w", {2, 2}, SplitDim::kRows);
  ExtentIndex idx;
  ExtentIndex::Holders owner;
  const Tensor x = Local(r, f, 2, 0);
  idx.AddBoxes(r, AxisCoords::Tp(2, 0), StateField::kParam, x, nullptr, 0, 1, owner, DType::kFloat32, "w0");
  EXPECT_EQ(ErrorOf([&] { idx.AddBoxes(r, AxisCoords::Tp(2, 1), StateField::kParam, x, nullptr, 0, 1, owner, DType::kBFloat16, "w1"); }),
            "w1 is bfloat16 but other ranks hold float32");
  DType d;
  ASSERT_TRUE(idx.FindDType("w", StateField::kParam, &d));
  EXPECT_EQ(d, DType::kFloat32);
  EXPECT_FALSE(idx.FindDType("w", StateField::kExpAvg, &d));
}

// The local tensor of the rank at `at`, filled box by box from a logical arange.
Tensor BoxLocal(const ParamRule& r, const AxisCoords& at) {
  Tensor x = Tensor::Zeros(DType::kFloat32, LocalShapeOf(r.spec, at));
  float* dst = reinterpret_cast<float*>(x.mutable_data());
  for (const Box& b : LocalBoxes(r, at)) {
    std::vector<int64_t> g = b.offset, l = b.local;
    for (int64_t i = 0, n = ShapeNumel(b.size); i < n; ++i) {
      dst[FlatIndex(l, x.shape())] = static_cast<float>(FlatIndex(g, r.shape));
      AdvanceInBox(b.offset, b.size, g, 1), AdvanceInBox(b.local, b.size, l, 1);
    }
  }
  return x;
}

// The index holds a box per rank (and ZeRO-1 shard), never an entry per row:
// a column split's entry count stays the same however many rows it has.
TEST(ExtentIndex, AColumnSplitIsABoxPerRankWhateverItsRows) {
  const ModelFormat f;
  for (int64_t rows : {4, 64, 4096}) {
    const ParamRule r = Rule("w", {rows, 8}, SplitDim::kColumns);
    ExtentIndex idx;
    ExtentIndex::Holders owner;
    std::vector<Tensor> locals;
    for (int t = 0; t < 2; ++t) locals.push_back(Local(r, f, 2, t));
    for (int t = 0; t < 2; ++t)  // two ZeRO-1 shards of each rank's rows
      for (int d = 0; d < 2; ++d) {
        const int64_t half = rows / 2;
        const Tensor shard = locals[t].Narrow0(d * half, (d + 1) * half);
        idx.AddBoxes(r, AxisCoords::Tp(2, t), StateField::kParam, shard, nullptr, d * half, std::min<int64_t>((d + 1) * half, rows), owner, DType::kFloat32, "w");
      }
    idx.CheckCovered("tag", {r});
    EXPECT_EQ(idx.BoxCount("w", StateField::kParam), 4u) << rows << " rows";
    const auto all = ReadAll(idx, "w", 0, static_cast<uint64_t>(rows * 8));
    for (int64_t i = 0; i < rows * 8; ++i) ASSERT_EQ(all[i], static_cast<float>(i)) << "element " << i << " of " << rows << " rows";
  }
}

// Mixtral's expert weights: experts over ep on dim 0, [gate || up] over tp on dim 2 with stride 2.
TEST(ExtentIndex, ThreeDimensionalExpertBoxesReadBackAsTheLogicalTensor) {
  ParamRule r{.name = "gate_up", .shape = {4, 3, 8}, .split = SplitDim::kExperts};
  r.spec = ExpertSpec(r.shape, ExpertWeight::kGateUp);
  ExtentIndex idx;
  ExtentIndex::Holders owner;
  std::vector<Tensor> locals;
  for (int e = 0; e < 2; ++e)
    for (int t = 0; t < 2; ++t) {
      AxisCoords at = AxisCoords::Tp(2, t);
      at[Axis::kEp] = {2, e};
      locals.push_back(BoxLocal(r, at));
      idx.AddBoxes(r, at, StateField::kParam, locals.back(), nullptr, 0, 2, owner, DType::kFloat32, "gate_up");
    }
  idx.CheckCovered("tag", {r});
  EXPECT_EQ(idx.BoxCount("gate_up", StateField::kParam), 8u);  // 2 ep x 2 tp ranks x [gate; up]
  const auto all = ReadAll(idx, "gate_up", 0, 96);
  for (int i = 0; i < 96; ++i) ASSERT_EQ(all[i], static_cast<float>(i)) << "element " << i;
  EXPECT_EQ(ReadAll(idx, "gate_up", 29, 5), (std::vector<float>{29, 30, 31, 32, 33}));
}

}  // namespace
}  // namespace ckpt

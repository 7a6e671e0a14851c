// CompareTags: two tags in any layouts, tensor by tensor, by fingerprint and
// then element by element to name where they differ, bit for bit or within a
// tolerance.
#include "ckpt/shard/tag_compare.h"

#include <gtest/gtest.h>

#include "ckpt/shard/fake_state.h"
#include "ckpt/shard/sharded_tag.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::FakeState;
using testing::SmallLlama;
using testing::TempDir;
using testing::WriteFake;

const char* kDense = "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight";  // [hidden 32, ffn 48]

// `src` written at tp 1 and at tp 2 pp 2, opened from disk.
std::pair<std::unique_ptr<ShardedTag>, std::unique_ptr<ShardedTag>> TwoLayouts(const TempDir& dir, const FakeState& a,
                                                                              const FakeState& b) {
  ReshardArgs one, four;
  one.tp = 1, one.pp = 1, four.tp = 2, four.pp = 2;
  WriteFake(a, dir / "a", one);
  WriteFake(b, dir / "b", four);
  return {ShardedTag::Open(Env::Default(), dir / "a"), ShardedTag::Open(Env::Default(), dir / "b")};
}

TEST(TagCompare, OneStateInTwoLayoutsIsEqual) {
  TempDir dir("tag_compare");
  const FakeState src(dir / "src", SmallLlama());
  const auto [a, b] = TwoLayouts(dir, src, src);
  const CompareReport r = CompareTags(*a, *b);
  EXPECT_TRUE(r.differences.empty()) << r.differences[0].name << ": " << r.differences[0].what;
  EXPECT_EQ(r.tensors, src.params().size());
  EXPECT_EQ(r.inexact, 0u);
  EXPECT_TRUE(r.recorded_a && r.recorded_b);  // both manifests record fingerprints, checked against the data
}

TEST(TagCompare, AChangedElementIsNamedWithItsIndex) {
  TempDir dir("tag_compare");
  const FakeState src(dir / "src", SmallLlama());
  FakeState changed(dir / "changed", SmallLlama());
  changed.Change(kDense, 1000, -FakeState::ValueOf(kDense, 1000) - 1.0f);
  const auto [a, b] = TwoLayouts(dir, src, changed);
  const CompareReport r = CompareTags(*a, *b);
  ASSERT_EQ(r.differences.size(), 1u);
  EXPECT_EQ(r.differences[0].name, kDense);
  EXPECT_EQ(r.differences[0].what, "param differs first at element 1000 of 1536");
}

TEST(TagCompare, AToleranceAcceptsRoundingButNotMore) {
  TempDir dir("tag_compare");
  const FakeState src(dir / "src", SmallLlama());
  FakeState changed(dir / "changed", SmallLlama());
  const float v = FakeState::ValueOf(kDense, 7);  // a large value: one float32 step is many units
  changed.Change(kDense, 7, std::nextafter(v, 2 * v));
  const auto [a, b] = TwoLayouts(dir, src, changed);
  const double step = std::nextafter(v, 2 * v) - v;
  // rtol above one float32 step: equal within rounding, reported as inexact with its size.
  const CompareReport within = CompareTags(*a, *b, {.rtol = 2 * step / v});
  EXPECT_TRUE(within.differences.empty());
  EXPECT_EQ(within.inexact, 1u);
  EXPECT_DOUBLE_EQ(within.max_abs_diff, step);
  // Below it, the element is a difference.
  const CompareReport below = CompareTags(*a, *b, {.rtol = step / v / 4});
  ASSERT_EQ(below.differences.size(), 1u);
  EXPECT_EQ(below.differences[0].name, kDense);
}

}  // namespace
}  // namespace ckpt

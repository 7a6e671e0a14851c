#include "libtrain/indexed_dataset.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace train {
namespace {

std::vector<std::vector<int32_t>> Docs() { return {{1, 2, 3}, {4, 5}, {}, {6, 7, 8, 9, 10, 11}, {12}}; }

TEST(IndexedDataset, WriteThenReadAcrossSequenceBoundaries) {
  ckpt::testing::TempDir d("idx");
  IndexedDataset::Write(d / "text", Docs());
  IndexedDataset ds(d / "text");
  EXPECT_EQ(ds.num_sequences(), 5);
  EXPECT_EQ(ds.num_tokens(), 12);
  EXPECT_EQ(ds.size(3), 6);
  std::vector<int32_t> out(7);
  ds.ReadTokens(2, 7, out.data());  // crosses the empty document
  EXPECT_EQ(out, (std::vector<int32_t>{3, 4, 5, 6, 7, 8, 9}));
  EXPECT_THROW(ds.ReadTokens(10, 3, out.data()), ckpt::Error);
  IndexedDataset::Write(d / "big", {{70000, 1}});  // needs int32
  std::vector<int32_t> two(2);
  IndexedDataset(d / "big").ReadTokens(0, 2, two.data());
  EXPECT_EQ(two, (std::vector<int32_t>{70000, 1}));
}

std::string ErrorFor(const std::string& prefix) {
  try {
    IndexedDataset ds(prefix);
  } catch (const ckpt::Error& e) {
    return e.what();
  }
  return "";
}

TEST(IndexedDataset, BadFilesAreNamed) {
  ckpt::testing::TempDir d("idx");
  EXPECT_EQ(ErrorFor(d / "none"), d / "none.idx" + ": missing (data_prefix '" + d / "none" + "' needs .idx and .bin)");
  IndexedDataset::Write(d / "t", Docs());
  std::filesystem::resize_file(d / "t.idx", 40);
  EXPECT_NE(ErrorFor(d / "t").find("t.idx: truncated"), std::string::npos) << ErrorFor(d / "t");
  IndexedDataset::Write(d / "t", Docs());
  std::filesystem::resize_file(d / "t.bin", 10);
  EXPECT_NE(ErrorFor(d / "t").find("t.bin: sequence 3 (6 tokens at byte 10) lies outside the 10-byte file"), std::string::npos)
      << ErrorFor(d / "t");
  std::ofstream(d / "t.idx", std::ios::binary) << "NOTANINDEXFILE_________________________";
  EXPECT_NE(ErrorFor(d / "t").find("bad magic"), std::string::npos);
}

TEST(SampleSource, DeterministicWindowsAndBlending) {
  ckpt::testing::TempDir d("idx");
  std::vector<int32_t> a(401), b(401);
  for (int i = 0; i < 401; ++i) a[i] = i, b[i] = 1000 + i;
  IndexedDataset::Write(d / "a", {a});
  IndexedDataset::Write(d / "b", {b});
  std::shared_ptr<TokenSource> da = std::make_shared<IndexedDataset>(d / "a"), db = std::make_shared<IndexedDataset>(d / "b");
  SampleSource one({da}, {1.0}, 8, 42);
  EXPECT_EQ(one.samples_per_epoch(0), 50);
  // One epoch visits every window exactly once; each sample is 9 consecutive tokens.
  std::map<int32_t, int> starts;
  std::vector<int32_t> s(9);
  for (int i = 0; i < 50; ++i) {
    one.Sample(i, s.data());
    for (int j = 1; j < 9; ++j) ASSERT_EQ(s[j], s[0] + j);
    EXPECT_EQ(s[0] % 8, 0);
    ++starts[s[0]];
  }
  EXPECT_EQ(starts.size(), 50u);
  // The same seed gives the same order; another seed another one.
  SampleSource again({da}, {1.0}, 8, 42), other({da}, {1.0}, 8, 43);
  std::vector<int32_t> x(9), y(9), z(9);
  int differ = 0;
  for (int i = 0; i < 20; ++i) {
    one.Sample(i, x.data());
    again.Sample(i, y.data());
    other.Sample(i, z.data());
    EXPECT_EQ(x, y);
    differ += x != z;
  }
  EXPECT_GT(differ, 10);
  // Blending 3:1 gives exact 3:1 shares, and random access agrees with sequential.
  SampleSource blend({da, db}, {3.0, 1.0}, 8, 7);
  int from_b = 0;
  std::vector<std::vector<int32_t>> seq_order;
  for (int i = 0; i < 400; ++i) {
    blend.Sample(i, s.data());
    from_b += s[0] >= 1000;
    seq_order.push_back(s);
  }
  EXPECT_EQ(from_b, 100);
  blend.Sample(123, s.data());
  EXPECT_EQ(s, seq_order[123]);
  EXPECT_NO_THROW(SampleSource({da}, {1.0}, 400, 1));  // 401 tokens make one sample of 400 + 1
  EXPECT_THROW(SampleSource({da}, {1.0}, 401, 1), ckpt::Error);  // but not one of 401 + 1
}

TEST(SampleSource, SourcesWithTheSameSeedDoNotShareOrders) {
  ckpt::testing::TempDir d("idx");
  std::vector<int32_t> big(401), small(81);
  for (int i = 0; i < 401; ++i) big[i] = i;
  for (int i = 0; i < 81; ++i) small[i] = 5000 + i;
  IndexedDataset::Write(d / "big", {big});
  IndexedDataset::Write(d / "small", {small});
  SampleSource a({std::make_shared<IndexedDataset>(d / "big")}, {1.0}, 8, 42);
  SampleSource b({std::make_shared<IndexedDataset>(d / "small")}, {1.0}, 8, 42);
  std::vector<int32_t> s(9);
  std::map<int32_t, int> seen;
  for (int i = 0; i < 10; ++i) {
    a.Sample(i, s.data());  // fills the big source's 50-window order first
    b.Sample(i, s.data());  // must use its own 10-window order
    EXPECT_GE(s[0], 5000);
    ++seen[s[0]];
  }
  EXPECT_EQ(seen.size(), 10u);  // one epoch of the small source: every window once
}

}  // namespace
}  // namespace train

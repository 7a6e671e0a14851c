#include "ckpt/shard/stream_budget.h"

#include <gtest/gtest.h>

#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

constexpr uint64_t MiB = uint64_t{1} << 20;

// Every stream's two chunks and slack fit in what the budget leaves: 100 MiB over 4 streams is 25
// MiB each, (25 - 4) / 2 = 10.5 MiB a chunk, rounded down to pages.
TEST(StreamBudget, StreamsShareWhatTheBudgetLeaves) {
  EXPECT_EQ(StreamChunk(120 * MiB, 20 * MiB, 4), 10 * MiB + MiB / 2);
  EXPECT_EQ(StreamChunk(120 * MiB, 20 * MiB, 1), 48 * MiB);
  for (int streams : {1, 2, 3, 5, 17}) {
    const uint64_t chunk = StreamChunk(256 * MiB, 30 * MiB, streams);
    EXPECT_EQ(chunk % 4096, 0u) << streams;
    EXPECT_LE(streams * (2 * chunk + kStreamSlack), 226 * MiB) << streams;
  }
}

TEST(StreamBudget, ChunksStayBetween256KiBAnd64MiB) {
  EXPECT_EQ(StreamChunk(uint64_t{64} << 30, 0, 1), kMaxStreamChunk);
  EXPECT_EQ(StreamChunk(10 * MiB + 9 * MiB / 2, 10 * MiB, 1), kMinStreamChunk);  // one slice exactly: 2 x 256 KiB + 4 MiB
}

TEST(StreamBudget, ABudgetUnderOneSlicePerStreamIsRefusedWithWhatWouldDo) {
  const std::string e = testing::ErrorOf([] { StreamChunk(40 * MiB, 20 * MiB, 5); });  // 5 x 4.5 MiB > 20 MiB
  EXPECT_NE(e.find("--memory_budget 40.0 MiB is smaller than one slice"), std::string::npos) << e;
  EXPECT_NE(e.find("each of 5 writing thread(s) needs 4.5 MiB"), std::string::npos) << e;
  EXPECT_NE(e.find("give at least 42.5 MiB"), std::string::npos) << e;
  EXPECT_TRUE(testing::ErrorOf([] { StreamChunk(40 * MiB, 20 * MiB, 4); }).empty());
}

}  // namespace
}  // namespace ckpt

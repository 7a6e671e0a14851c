#include "libtrain/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include "ckpt/util/error.h"

namespace train {
namespace {

PipelineStep F(int64_t mb, int chunk) { return {true, mb, chunk}; }
PipelineStep B(int64_t mb, int chunk) { return {false, mb, chunk}; }

// pp 2, V 2, 4 micro-batches, as Megatron's forward_backward_pipelining_with_interleaving runs them
// (worked by hand from its code): 8 virtual micro-batches per rank; warmup (pp - rank - 1) * 2 +
// (V - 1) * pp = 4 on rank 0 and 2 on rank 1; forward k is chunk (k % 4) / 2 and micro-batch
// (k / 4) * 2 + k % 2, backward k the same with the chunk reversed; the steady phase runs forward
// k + warmup then backward k.
TEST(InterleavedSchedule, MatchesMegatronAtPp2V2M4) {
  EXPECT_EQ(InterleavedWarmup(2, 0, 2, 4), 4);
  EXPECT_EQ(InterleavedWarmup(2, 1, 2, 4), 2);
  EXPECT_EQ(InterleavedSchedule(2, 0, 2, 4),
            (std::vector<PipelineStep>{F(0, 0), F(1, 0), F(0, 1), F(1, 1),                    // warmup
                                       F(2, 0), B(0, 1), F(3, 0), B(1, 1), F(2, 1), B(0, 0),  // steady
                                       F(3, 1), B(1, 0),                                      //
                                       B(2, 1), B(3, 1), B(2, 0), B(3, 0)}));                 // cooldown
  EXPECT_EQ(InterleavedSchedule(2, 1, 2, 4),
            (std::vector<PipelineStep>{F(0, 0), F(1, 0),                                      // warmup
                                       F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 0), B(0, 0),  // steady
                                       F(3, 0), B(1, 0), F(2, 1), B(2, 1), F(3, 1), B(3, 1),  //
                                       B(2, 0), B(3, 0)}));                                   // cooldown
}

// With as many micro-batches as pp ranks Megatron runs every forward, then every backward.
TEST(InterleavedSchedule, AllForwardsFirstWhenMicroBatchesEqualPp) {
  EXPECT_EQ(InterleavedWarmup(2, 1, 2, 2), 4);
  EXPECT_EQ(InterleavedSchedule(2, 1, 2, 2),
            (std::vector<PipelineStep>{F(0, 0), F(1, 0), F(0, 1), F(1, 1), B(0, 1), B(1, 1), B(0, 0), B(1, 0)}));
}

// pp 4, V 3, 8 micro-batches: rank 0 warms up with (4 - 0 - 1) * 2 + 2 * 4 = 14 forwards, the last rank with 8.
TEST(InterleavedSchedule, WarmupAtPp4V3) {
  EXPECT_EQ(InterleavedWarmup(4, 0, 3, 8), 14);
  EXPECT_EQ(InterleavedWarmup(4, 3, 3, 8), 8);
  const auto s = InterleavedSchedule(4, 0, 3, 8);
  EXPECT_EQ(s[13], F(5, 0));  // forward 13: group 1, chunk (13 % 12) / 4 = 0, micro-batch 4 + 13 % 4
  EXPECT_EQ(s[14], F(6, 0));
  EXPECT_EQ(s[15], B(0, 2));  // the first backward is the last chunk's
}

TEST(InterleavedSchedule, RefusesMicroBatchesNotAMultipleOfPp) {
  EXPECT_EQ(InterleavedMicroBatchProblem(4, 2), "");
  EXPECT_NE(InterleavedMicroBatchProblem(3, 2).find("not a multiple of pp 2"), std::string::npos);
  EXPECT_THROW(InterleavedSchedule(2, 0, 2, 3), ckpt::Error);
}

// Every rank's list run together, sends buffered and receives blocking (as RunPipelineStep runs
// them): the job finishes, each step finds its input (the previous virtual stage's forward, the
// next one's backward), and each chunk sees its micro-batches in order, forward and backward, so
// messages tagged by chunk arrive in the order they are awaited.
void ExpectRunsTogether(int pp, int chunks, int64_t m) {
  std::vector<std::vector<PipelineStep>> lists;
  for (int r = 0; r < pp; ++r) lists.push_back(InterleavedSchedule(pp, r, chunks, m));
  const int stages = pp * chunks;
  std::set<std::tuple<bool, int64_t, int>> done;  // (forward, micro-batch, virtual stage)
  std::vector<size_t> at(pp, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      while (at[r] < lists[r].size()) {
        const PipelineStep& s = lists[r][at[r]];
        const int stage = r + s.chunk * pp;
        const bool ready = s.forward ? stage == 0 || done.count({true, s.micro_batch, stage - 1})
                                     : done.count({true, s.micro_batch, stage}) && (stage == stages - 1 || done.count({false, s.micro_batch, stage + 1}));
        if (!ready) break;
        done.insert({s.forward, s.micro_batch, stage}), ++at[r], progress = true;
      }
    }
  }
  for (int r = 0; r < pp; ++r) EXPECT_EQ(at[r], lists[r].size()) << "pp " << pp << " V " << chunks << " M " << m << ": rank " << r << " stuck";
  for (int r = 0; r < pp; ++r) {
    std::map<std::pair<bool, int>, int64_t> next;
    for (const PipelineStep& s : lists[r]) {
      const std::pair<bool, int> key{s.forward, s.chunk};
      EXPECT_EQ(s.micro_batch, next[key]++) << "rank " << r;
    }
    for (const auto& [key, count] : next) EXPECT_EQ(count, m);
    EXPECT_EQ(next.size(), static_cast<size_t>(2 * chunks));
  }
}

TEST(InterleavedSchedule, RunsTogetherWithoutDeadlock) {
  for (auto [pp, chunks, m] : {std::tuple{2, 2, 2}, {2, 2, 4}, {2, 2, 8}, {2, 3, 6}, {4, 2, 4}, {4, 2, 8}, {4, 3, 12}, {3, 2, 9}})
    ExpectRunsTogether(pp, chunks, m);
}

}  // namespace
}  // namespace train

#include "libtrain/expert_exchange.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "ckpt/util/error.h"

namespace train {
namespace {

// Ranks as threads: an all-to-all through shared memory, the group's ranks
// meeting at a barrier before and after reading each other's input.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), inputs_(size), sync_(size) {}
  ExpertParallel Rank(int r) {
    return {size_, r, [this, r](const float* in, float* out, size_t block) {
              inputs_[r] = in;
              sync_.arrive_and_wait();
              for (int q = 0; q < size_; ++q) std::copy_n(inputs_[q] + r * block, block, out + q * block);
              sync_.arrive_and_wait();
            }};
  }

 private:
  int size_;
  std::vector<const float*> inputs_;
  std::barrier<> sync_;
};

std::vector<float> Normal(size_t n, float std, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0, std);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float scale = 0;
  for (float w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5f * scale + 1e-7f) << what << " at " << i;
}

// ep 2 (two threads, 12 tokens each, 4 experts of which each rank holds 2)
// against each rank's tokens run by MoeForward / MoeBackward with all
// experts: the outputs, input and router gradients of each rank are its own
// run's, and a rank's expert gradients the sum of both runs' for its
// experts. Capacity factor 1.0 drops tokens (C = 6 of each rank's 12); 0 is dropless.
void CheckTwoRanks(double capacity_factor) {
  const MoeShape s{12, 8, 6, 4, 2};
  MoeOptions o;
  o.capacity_factor = capacity_factor;
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, E = s.experts;
  std::mt19937_64 rng(39);
  const std::vector<float> router = Normal(E * H, 0.5f, rng), gate_up = Normal(E * H * 2 * I, 0.25f, rng), down = Normal(E * I * H, 0.25f, rng);
  std::vector<std::vector<float>> x, dout;
  for (int r = 0; r < 2; ++r) x.push_back(Normal(T * H, 1, rng)), dout.push_back(Normal(T * H, 1, rng));
  const std::vector<double> aux = {0.01, 0.02, 0.03, 0.04};
  // The reference: each rank's tokens through every expert, one process.
  std::vector<std::vector<float>> want_out(2, std::vector<float>(T * H)), want_dx = want_out;
  std::vector<std::vector<float>> want_router(2, std::vector<float>(E * H, 0.0f));
  std::vector<float> want_gate_up(E * H * 2 * I, 0.0f), want_down(E * I * H, 0.0f);
  int64_t dropped = 0;
  for (int r = 0; r < 2; ++r) {
    MoeActivations a;
    const MoeWeights w{router.data(), gate_up.data(), down.data()};
    MoeForward(want_out[r].data(), &a, x[r].data(), w, s, o);
    for (int64_t t = 0; t < T * E; ++t) dropped += a.kept[t] == 0;
    MoeBackward(want_dx[r].data(), {want_router[r].data(), want_gate_up.data(), want_down.data()}, dout[r].data(), aux, x[r].data(), w, a, s, o);
  }
  // Unchosen pairs are not kept; with cf 1.0 some chosen ones are dropped too.
  if (capacity_factor > 0) EXPECT_GT(dropped, 2 * T * (E - s.top_k));
  else EXPECT_EQ(dropped, 2 * T * (E - s.top_k));
  // ep 2.
  ThreadGroup group(2);
  std::vector<std::vector<float>> out(2, std::vector<float>(T * H)), dx = out, d_router(2, std::vector<float>(E * H, 0.0f));
  std::vector<std::vector<float>> d_gate_up(2, std::vector<float>(E / 2 * H * 2 * I, 0.0f)), d_down(2, std::vector<float>(E / 2 * I * H, 0.0f));
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      const ExpertParallel ep = group.Rank(r);
      const MoeWeights w{router.data(), gate_up.data() + r * (E / 2) * H * 2 * I, down.data() + r * (E / 2) * I * H};
      MoeActivations a;
      ExpertExchangeCache cache;
      ExpertParallelForward(out[r].data(), &a, &cache, x[r].data(), w, s, o, ep);
      ExpertParallelBackward(dx[r].data(), {d_router[r].data(), d_gate_up[r].data(), d_down[r].data()}, dout[r].data(), aux, x[r].data(), w, a,
                             cache, s, o, ep);
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    ExpectNear(out[r], want_out[r], "output");
    ExpectNear(dx[r], want_dx[r], "input gradient");
    ExpectNear(d_router[r], want_router[r], "router gradient");
    const int64_t gu = E / 2 * H * 2 * I, dn = E / 2 * I * H;
    ExpectNear(d_gate_up[r], std::vector<float>(want_gate_up.begin() + r * gu, want_gate_up.begin() + (r + 1) * gu), "gate_up gradient");
    ExpectNear(d_down[r], std::vector<float>(want_down.begin() + r * dn, want_down.begin() + (r + 1) * dn), "down gradient");
  }
}

TEST(ExpertExchange, TwoRanksComputeWhatEachRankAloneComputesWithTokenDropping) { CheckTwoRanks(1.0); }
TEST(ExpertExchange, TwoRanksComputeWhatEachRankAloneComputesDropless) { CheckTwoRanks(0.0); }

// Per all-to-all, one rank sends (ep - 1) blocks of E / ep experts' C rows:
// 12 tokens, top 2, cf 1.0 of 4 experts: C = ceil(12 * 2 * 1 / 4) = 6, so
// at ep 2, 1 * 2 * 6 * 8 floats; dropless C = 12.
TEST(ExpertExchange, FloatsSentPerAllToAll) {
  const MoeShape s{12, 8, 6, 4, 2};
  MoeOptions o;
  o.capacity_factor = 1.0;
  EXPECT_EQ(ExpertExchangeFloats(s, o, 2), 1 * 2 * 6 * 8);
  EXPECT_EQ(ExpertExchangeFloats(s, o, 4), 3 * 1 * 6 * 8);
  o.capacity_factor = 0.0;
  EXPECT_EQ(ExpertExchangeFloats(s, o, 2), 1 * 2 * 12 * 8);
  EXPECT_THROW(ExpertExchangeFloats(s, o, 3), ckpt::Error);
}

}  // namespace
}  // namespace train

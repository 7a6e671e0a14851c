#include "libtrain/expert_exchange.h"

#include <algorithm>
#include <string>

#include "ckpt/util/error.h"

namespace train {
namespace {

// The sizes of one exchange: E / ep local experts, C slots per expert.
struct Blocks {
  int64_t local_experts, capacity, hidden;
  int ranks;
  size_t block() const { return static_cast<size_t>(local_experts * capacity * hidden); }  // floats to one rank
};

Blocks BlocksOf(const MoeShape& s, const MoeOptions& o, const ExpertParallel& ep) {
  if (ep.size < 1 || s.experts % ep.size)
    throw ckpt::Error("expert parallelism: expert_model_parallel_size " + std::to_string(ep.size) + " does not divide num_experts " +
                      std::to_string(s.experts) + " (NxD gives each ep rank experts / ep whole experts)");
  return {s.experts / ep.size, MoeExpertCapacity(s, o.capacity_factor), s.hidden, ep.size};
}

// Expert-aligned [E, C, H] of this rank's tokens: slot j of expert e holds
// row j of rows_of(e) (its j-th token's), the rest zero.
template <typename RowsOf>
std::vector<float> ExpertAligned(const MoeActivations& a, const Blocks& b, int64_t experts, RowsOf rows_of) {
  const int64_t C = b.capacity, H = b.hidden;
  std::vector<float> aligned(experts * C * H, 0.0f);
  for (int64_t e = 0; e < experts; ++e)
    for (size_t j = 0; j < a.experts[e].tokens.size(); ++j) std::copy_n(rows_of(e, j), H, &aligned[(e * C + j) * H]);
  return aligned;
}

// After the first all-to-all the rows lie [ep, E/ep, C, H] (source rank
// first); the local experts run on [E/ep, ep * C, H] (source rank by source
// rank within each expert). Reorders `in` from the one to the other
// (`by_expert`) or back.
std::vector<float> Reordered(const std::vector<float>& in, const Blocks& b, bool by_expert) {
  std::vector<float> out(in.size());
  const size_t slab = static_cast<size_t>(b.capacity * b.hidden);
  for (int src = 0; src < b.ranks; ++src)
    for (int64_t le = 0; le < b.local_experts; ++le) {
      const size_t by_source = (src * b.local_experts + le) * slab, by_local = (le * b.ranks + src) * slab;
      std::copy_n(&in[by_expert ? by_source : by_local], slab, &out[by_expert ? by_local : by_source]);
    }
  return out;
}

std::vector<float> Exchange(const std::vector<float>& in, const Blocks& b, const ExpertParallel& ep) {
  std::vector<float> out(in.size());
  ep.all_to_all(in.data(), out.data(), b.block());
  return out;
}

}  // namespace

void ExpertParallelForward(float* out, MoeActivations* acts, ExpertExchangeCache* cache, const float* x, const MoeWeights& w,
                           const MoeShape& s, const MoeOptions& o, const ExpertParallel& ep) {
  const Blocks b = BlocksOf(s, o, ep);
  const int64_t H = s.hidden, I = s.intermediate, C = b.capacity, n = b.ranks * C;
  MoeRoute(acts, x, w, s, o);  // dispatch with C of this rank's tokens, as NxD's forward_capacity_factor
  const std::vector<float> send = ExpertAligned(*acts, b, s.experts, [&](int64_t e, size_t j) { return x + acts->experts[e].tokens[j] * H; });
  cache->capacity = C;
  cache->rows = Reordered(Exchange(send, b, ep), b, true);
  cache->local.assign(b.local_experts, {});
  std::vector<float> outputs(cache->rows.size());
  for (int64_t le = 0; le < b.local_experts; ++le) {
    ExpertMlpForward(&cache->local[le], &cache->rows[le * n * H], n, w.gate_up + le * H * 2 * I, w.down + le * I * H, H, I);
    std::copy(cache->local[le].out.begin(), cache->local[le].out.end(), &outputs[le * n * H]);
  }
  const std::vector<float> returned = Exchange(Reordered(outputs, b, false), b, ep);  // [E, C, H]: my tokens' outputs
  for (int64_t e = 0; e < s.experts; ++e) {
    MoeExpertBatch& mine = acts->experts[e];
    mine.out.assign(&returned[e * C * H], &returned[e * C * H] + mine.tokens.size() * H);
  }
  MoeCombine(out, *acts, s);
}

void ExpertParallelBackward(float* dx, const MoeGrads& g, const float* dout, const std::vector<double>& aux_affinity_grad,
                            const float* x, const MoeWeights& w, const MoeActivations& acts, const ExpertExchangeCache& cache,
                            const MoeShape& s, const MoeOptions& o, const ExpertParallel& ep) {
  const Blocks b = BlocksOf(s, o, ep);
  const int64_t T = s.tokens, E = s.experts, H = s.hidden, I = s.intermediate, C = b.capacity, n = b.ranks * C;
  std::vector<float> dcombine(T * E, 0.0f);
  std::vector<std::vector<float>> dy(E);
  for (int64_t e = 0; e < E; ++e) MoeCombineBackward(&dy[e], &dcombine, e, dout, acts, s);
  const std::vector<float> dy_rows = Reordered(Exchange(ExpertAligned(acts, b, E, [&](int64_t e, size_t j) { return &dy[e][j * H]; }), b, ep), b, true);
  std::vector<float> dx_rows(dy_rows.size());
  for (int64_t le = 0; le < b.local_experts; ++le)
    ExpertMlpBackward(&dx_rows[le * n * H], g.gate_up + le * H * 2 * I, g.down + le * I * H, &dy_rows[le * n * H], &cache.rows[le * n * H],
                      cache.local[le], n, w.gate_up + le * H * 2 * I, w.down + le * I * H, H, I);
  const std::vector<float> returned = Exchange(Reordered(dx_rows, b, false), b, ep);  // [E, C, H]: my tokens' input gradients
  std::fill_n(dx, T * H, 0.0f);
  for (int64_t e = 0; e < E; ++e)
    for (size_t j = 0; j < acts.experts[e].tokens.size(); ++j) {
      float* row = dx + acts.experts[e].tokens[j] * H;
      const float* add = &returned[(e * C + j) * H];
      for (int64_t h = 0; h < H; ++h) row[h] += add[h];
    }
  MoeRouteBackward(dx, g.router, dcombine, aux_affinity_grad, x, w, acts, s, o);
}

int64_t ExpertExchangeFloats(const MoeShape& s, const MoeOptions& o, int ep) {
  const Blocks b = BlocksOf(s, o, ExpertParallel{ep, 0, {}});
  return static_cast<int64_t>(b.block()) * (ep - 1);
}

}  // namespace train

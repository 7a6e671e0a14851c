// An MoE layer under expert parallelism (ep > 1) in training, as NxD runs it:
// each ep rank routes and dispatches its own tokens over all E experts
// (expert_mlps_v2.py ExpertMLPsV2.forward_capacity_factor, the capacity C
// computed from this rank's token count), lays them out expert-aligned
// [E, C, H] (slot j of expert e: its j-th kept token in token order; empty
// slots zero), and an all-to-all over the ep group hands each rank the
// [C, H] blocks of its E / ep contiguous experts from every ep rank
// (parallel_layers/mappings.py enter_expert_parallel_region: (e, c, h) ->
// (e/ep, ep, c, h)); the experts run on those ep * C rows, a second
// all-to-all returns the outputs (exit_expert_parallel_region), and each
// rank combines its tokens' outputs. Backward runs the same two exchanges on
// the gradients. Dropless (capacity_factor <= 0 or >= E / k) is the same with
// C = T, nothing dropped.
//
// The arithmetic of routing, the experts and the combine is moe_layer.h's;
// this unit only moves rows. Tensor parallelism composes: each tp rank
// exchanges within its own ep group, its experts' tp slices giving partial
// outputs summed by the caller, as at ep 1.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "libtrain/moe_layer.h"

namespace train {

// This rank's place in its ep group and the group's all-to-all (Comm::AllToAll:
// `in` holds `size` blocks of `block` floats, block r to rank r; out's block q
// from rank q).
struct ExpertParallel {
  int size = 1, rank = 0;
  std::function<void(const float* in, float* out, size_t block)> all_to_all;
};

// What forward keeps for backward besides MoeActivations (whose experts'
// tokens and out rows are this rank's own tokens and their returned outputs).
struct ExpertExchangeCache {
  int64_t capacity = 0;               // C
  std::vector<float> rows;            // [E/ep, ep * C, H]: each local expert's rows, source rank by source rank
  std::vector<MoeExpertBatch> local;  // [E/ep]: the local experts' fc, act, out on those rows
};

// The MoE layer's output out[T, H] for this rank's x[T, H] (s.tokens = T,
// s.experts = E, all of them); w.router is the whole router, w.gate_up and
// w.down this rank's E / ep experts. Throws ckpt::Error unless ep divides E.
void ExpertParallelForward(float* out, MoeActivations* acts, ExpertExchangeCache* cache, const float* x, const MoeWeights& w,
                           const MoeShape& s, const MoeOptions& o, const ExpertParallel& ep);
// Its backward as MoeBackward's (aux_affinity_grad likewise): dx written,
// g.router and the local experts' gradients accumulated (the experts' from
// every ep rank's tokens).
void ExpertParallelBackward(float* dx, const MoeGrads& g, const float* dout, const std::vector<double>& aux_affinity_grad,
                            const float* x, const MoeWeights& w, const MoeActivations& acts, const ExpertExchangeCache& cache,
                            const MoeShape& s, const MoeOptions& o, const ExpertParallel& ep);

// The floats one rank sends to the other ep ranks in one all-to-all of the
// layer: (ep - 1) blocks of E / ep experts' C rows of H, C =
// MoeExpertCapacity(s, capacity_factor). Forward runs two all-to-alls, backward two.
int64_t ExpertExchangeFloats(const MoeShape& s, const MoeOptions& o, int ep);

}  // namespace train

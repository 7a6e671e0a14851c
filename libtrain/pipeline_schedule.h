// The order in which one pipeline rank runs a step's micro-batches under the
// interleaved (virtual) pipeline, as a list: Megatron's
// forward_backward_pipelining_with_interleaving (apex's copy in NNM:
// apex/transformer/pipeline_parallel/schedules/fwd_bwd_pipelining_with_interleaving.py)
// and NxD's TrainInterleavedSchedule (neuronx_distributed/pipeline/scheduler.py)
// agree on it. pp rank p holds V model chunks; chunk c is virtual stage
// p + c * pp of pp * V. Of the M * V forwards a rank owes, it first runs
// `warmup` (all of them when M == pp, else 2 * (pp - p - 1) + (V - 1) * pp,
// at most M * V), then alternates forward k + warmup and backward k, then
// runs the backwards still owed. Virtual micro-batch k (forward or backward)
// is chunk (k mod pp*V) / pp (reversed for backwards) and micro-batch
// (k / (pp*V)) * pp + k mod pp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace train {

struct PipelineStep {
  bool forward = true;
  int64_t micro_batch = 0;
  int chunk = 0;
  bool operator==(const PipelineStep&) const = default;
};

// Why `micro_batches` per data-parallel rank cannot run interleaved over pp
// ranks ("" when they can): NxD and Megatron need a multiple of pp.
std::string InterleavedMicroBatchProblem(int64_t micro_batches, int pp);

// The forwards pp rank `rank` of `pp` runs before its first backward.
int64_t InterleavedWarmup(int pp, int rank, int chunks, int64_t micro_batches);

// Every forward and backward pp rank `rank` runs in one step, in order.
// Throws ckpt::Error when InterleavedMicroBatchProblem says why not.
std::vector<PipelineStep> InterleavedSchedule(int pp, int rank, int chunks, int64_t micro_batches);

}  // namespace train

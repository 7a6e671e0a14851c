#include "libtrain/pipeline_schedule.h"

#include <algorithm>

#include "ckpt/util/error.h"

namespace train {

std::string InterleavedMicroBatchProblem(int64_t micro_batches, int pp) {
  if (micro_batches > 0 && micro_batches % pp == 0) return "";
  // NxD: TrainInterleavedSchedule.get_step_schedule raises on num_microbatches % pipeline_parallel_size.
  return "the interleaved schedule runs micro-batches in groups of pp: " + std::to_string(micro_batches) +
         " micro-batches per data-parallel rank are not a multiple of pp " + std::to_string(pp);
}

int64_t InterleavedWarmup(int pp, int rank, int chunks, int64_t micro_batches) {
  const int64_t total = micro_batches * chunks;
  if (micro_batches == pp) return total;  // all forwards, then all backwards
  return std::min<int64_t>(2 * (pp - rank - 1) + int64_t{chunks - 1} * pp, total);
}

std::vector<PipelineStep> InterleavedSchedule(int pp, int rank, int chunks, int64_t micro_batches) {
  if (const std::string why = InterleavedMicroBatchProblem(micro_batches, pp); !why.empty()) throw ckpt::Error(why);
  const int64_t total = micro_batches * chunks, warmup = InterleavedWarmup(pp, rank, chunks, micro_batches);
  const int64_t group = int64_t{pp} * chunks;
  // Megatron's get_model_chunk_id and get_microbatch_id_in_model_chunk.
  auto step = [&](int64_t k, bool forward) {
    const int chunk = static_cast<int>((k % group) / pp);
    return PipelineStep{forward, (k / group) * pp + k % pp, forward ? chunk : chunks - 1 - chunk};
  };
  std::vector<PipelineStep> out;
  for (int64_t k = 0; k < warmup; ++k) out.push_back(step(k, true));
  for (int64_t k = 0; k < total - warmup; ++k) out.push_back(step(k + warmup, true)), out.push_back(step(k, false));
  for (int64_t k = total - warmup; k < total; ++k) out.push_back(step(k, false));
  return out;
}

}  // namespace train

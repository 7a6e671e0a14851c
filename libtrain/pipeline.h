// One training step's micro-batches through this rank's pipeline stage in
// 1F1B order (Megatron's forward_backward_pipelining_without_interleaving):
// stage s of P first runs min(P - s - 1, M) forwards to fill the pipeline,
// then alternates one forward and one backward, then drains the backwards
// still owed. Hidden states travel to the next stage and their gradients
// back as point-to-point messages over the pipeline group, so at most P - s
// micro-batches are in flight on stage s. With one stage this is forward,
// backward, micro-batch after micro-batch.
//
// A model of several chunks (virtual stages, PipelineStage::chunks) runs the
// interleaved schedule instead (libtrain/pipeline_schedule.h): virtual stage
// v's output goes to pp rank (v + 1) mod pp, so the last pp rank's chunk c
// feeds the first's chunk c + 1; messages are tagged by the receiving chunk,
// which takes its micro-batches in order.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "libtrain/model.h"

namespace train {

struct MicroBatch {
  std::vector<int32_t> tokens, targets;  // [B * T] each
  uint64_t dropout_key = 0;
};

// Runs `count` micro-batches of B sequences of T tokens; `load(m, &mb)` fills
// micro-batch m (every stage reads the data it needs itself). Gradients
// accumulate in the model. Returns the sum of the micro-batches' mean losses
// on the last stage, 0 on the others.
double RunPipelineStep(Model& model, int64_t count, int64_t B, int64_t T, const std::function<void(int64_t, MicroBatch*)>& load);

}  // namespace train

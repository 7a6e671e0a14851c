// The training loop of one rank of an Open MPI job (one process when the
// world is 1): builds the rank's part of the model (either family, ckpt/shard/
// model_family.h) on the config's tensor, pipeline and data parallel grid,
// resumes by itself (NxDT exp_manager semantics through the checkpoint store;
// a tag of other degrees refused or, with resume_reshard, re-laid by all
// ranks), accumulates gradients over global_batch_size / micro_batch_size
// micro-batches, clips, steps AdamW on the schedule, logs every step (a
// progress bar on a terminal, a line per step otherwise; metrics appended to
// <run>/metrics.jsonl; rank 0 speaks for the job) and checkpoints every
// every_n_train_steps and at the end, in NxDT's layout, each rank writing its
// own files. The data position is consumed_samples: the sample order is a
// function of the config.
#pragma once

#include <functional>
#include <string>

#include "ckpt/util/env.h"
#include "libtrain/train_config.h"

namespace train {

struct TrainResult {
  int64_t start_step = 0, end_step = 0;
  std::vector<double> losses;  // one per step run
  std::string resumed_from;
};

// Every file the run reads or writes (checkpoints, resume, metrics, timing,
// the indexed dataset) goes through `env`, so tests can inject faults; the
// HDF5 dataset reader is the exception (the HDF5 library opens its file).
TrainResult RunTraining(const TrainConfig& c, const std::function<void(const std::string&)>& log,
                        ckpt::Env* env = ckpt::Env::Default());

}  // namespace train

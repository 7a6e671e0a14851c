// The two small files of a tag that say where training stands, in typed form,
// so the trainer, nnm2nxdt-ckpt, ckpt-reshard and ckpt-sample read and write
// one schema:
//   user_content.pt  {epoch, global_step, consumed_samples, ...}: what NxDT's
//                    trainer saves as user content (an NNM-converted tag
//                    also carries NNM's loops, lr_schedulers and Lightning
//                    version after them);
//   scheduler.pt     a torch LR scheduler's state_dict; only `last_epoch`
//                    (the step the schedule stands at) is interpreted, the
//                    other entries (base_lrs, _last_lr, lambdas, ...) are
//                    carried as the scheduler wrote them.
// The optimizer's schema is OptimizerFile (ckpt/optimizer_state.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/value.h"

namespace ckpt {

struct UserContent {
  int64_t epoch = 0;
  int64_t global_step = 0;
  double consumed_samples = 0;
  std::vector<std::pair<std::string, Value>> carried;  // other entries, in order

  // A dict: epoch, global_step, consumed_samples, then `carried`.
  Value ToValue() const;
  // Throws ckpt::Error naming `where` and the key when `v` is not a dict with
  // a whole-number global_step and a numeric consumed_samples (epoch may be
  // missing: 0).
  static UserContent FromValue(const Value& v, const std::string& where);
};

struct SchedulerState {
  int64_t last_epoch = 0;
  std::vector<std::pair<std::string, Value>> carried;  // other entries, in order

  // A dict: the entries in order, last_epoch where it was (first for a new state).
  Value ToValue() const;
  // Throws ckpt::Error naming `where` when `v` is not a dict with a
  // whole-number last_epoch.
  static SchedulerState FromValue(const Value& v, const std::string& where);

 private:
  size_t last_epoch_at_ = 0;  // its position among the entries
};

}  // namespace ckpt

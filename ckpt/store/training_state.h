// The two small files of a tag that say where training stands, in typed form,
// so the trainer, nnm2nxdt-ckpt, ckpt-reshard and ckpt-sample read and write
// one schema:
//   user_content.pt  NxDT saves the Lightning checkpoint dict minus model and
//                    optimizer here (NxDT nlp_overrides.py
//                    NLPCheckpointIO.save_checkpoint; Lightning 2.5.0
//                    CheckpointConnector.dump_checkpoint): epoch,
//                    global_step, pytorch-lightning_version, loops,
//                    callbacks, lr_schedulers, hparams_name,
//                    hyper_parameters. No consumed_samples: NxDT takes that
//                    from the tag's name (ConsumedSamplesFromTagPath).
//                    shardkit's own tags add consumed_samples, and write
//                    lr_schedulers as NxDT restores it (LrSchedulerEntry).
//   scheduler.pt     a torch LR scheduler's state_dict (NxD's own trainer;
//                    shardkit writes it too, NxDT ignores it); only
//                    `last_epoch` is interpreted.
// The optimizer's schema is OptimizerFile (ckpt/spec/optimizer_state.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/pt/value.h"
#include "ckpt/util/env.h"

namespace ckpt {

// Bounds past which a recorded value is damage, not progress: no run takes
// 2^40 optimizer steps, nor consumes 2^53 samples (beyond that a double,
// as Lightning and the tag name carry it, no longer counts one by one).
// A step or count beyond them, negative, non-finite or fractional makes a
// tag damaged: resuming from it would skip training (a step past max_steps)
// or wrap the sample counter.
inline constexpr int64_t kMaxRecordedStep = int64_t{1} << 40;
inline constexpr int64_t kMaxRecordedSamples = int64_t{1} << 53;

struct UserContent {
  int64_t epoch = 0;
  int64_t global_step = 0;
  std::optional<double> consumed_samples;  // shardkit's and NNM-converted tags'; NxDT's have none
  std::vector<std::pair<std::string, Value>> carried;  // other entries, in order (loops, lr_schedulers, ...)

  // A dict: epoch, global_step, consumed_samples (when set), then `carried`.
  Value ToValue() const;
  // Throws ckpt::Error naming `where`, the key and its value when `v` is not
  // a dict with a whole-number global_step (epoch may be missing: 0), when
  // consumed_samples, loops' step count or lr_schedulers is there but
  // malformed, or when a step, epoch or consumed_samples is negative,
  // fractional, non-finite or past its bound above, or an LR (lr_schedulers[0]
  // base_lrs, _last_lr) is negative or non-finite.
  static UserContent FromValue(const Value& v, const std::string& where);

  // The step NxDT resumes at: Lightning's loops
  // fit_loop["epoch_loop.automatic_optimization.optim_progress"]
  // .optimizer.step.total.completed, else global_step (NxDT
  // nlp_overrides.py restore_training_state sets the latter first, and the
  // loops' state overrides it).
  int64_t ResumeStep() const;
  // lr_schedulers[0] (a torch scheduler's state_dict, whose entries NxDT's
  // restore applies over the YAML's), if the tag has one.
  const Value* LrScheduler() const;
  // Its last_epoch: where the LR schedule stands.
  std::optional<int64_t> LrSchedulerStep() const;
  // A carried entry by key, or null.
  const Value* Carried(const std::string& key) const;
};

// One entry of a job config as Lightning checkpoints hold it: a plain dict
// (as some writers store it), or omegaconf's DictConfig as pickled (NeMo's
// ModelPT.__init__ save_hyperparameters("cfg") keeps the model config as one,
// and Lightning's _dump_checkpoint stores dict(hparams) under
// hyper_parameters): its state's `_content` maps each key to a node whose
// `_val` is the value (nested configs stay DictConfig objects). Null when absent.
const Value* ConfigEntry(const Value& cfg, const std::string& key);
// hyper_parameters.cfg of a Lightning checkpoint dict (NNM's rank files,
// NxDT's user_content.pt), or null.
const Value* RecordedJobConfig(const Value& checkpoint);

// lr_schedulers[0] as NxDT restores it: only torch's generic
// _LRScheduler.state_dict entries (base_lrs, last_epoch, verbose,
// _step_count, _get_lr_called_within_step, _last_lr), since every entry
// overrides the scheduler's own (a saved max_steps would override the YAML).
// `next_lr`: the LR of the step after last_epoch, as torch's _last_lr holds it.
Value LrSchedulerEntry(double base_lr, int64_t last_epoch, double next_lr);

// The consumed samples NxDT takes from a tag's path (NxDT
// lightning_modules/data/base.py _extract_consumed_samples_from_ckpt):
// int(float(first match of consumed_samples\=([0-9]+.[0-9]+))), or nullopt
// where NxDT warns and assumes 0. So "=56" does not parse; "=56.0" does.
std::optional<int64_t> ConsumedSamplesFromTagPath(const std::string& path);

struct SchedulerState {
  int64_t last_epoch = 0;
  std::vector<std::pair<std::string, Value>> carried;  // other entries, in order

  // A dict: the entries in order, last_epoch where it was (first for a new state).
  Value ToValue() const;
  // Throws ckpt::Error naming `where` when `v` is not a dict with a
  // whole-number last_epoch in [0, kMaxRecordedStep], or when its LRs
  // (base_lrs, _last_lr) are negative or non-finite.
  static SchedulerState FromValue(const Value& v, const std::string& where);

 private:
  size_t last_epoch_at_ = 0;  // its position among the entries
};

// Where consumed samples come from in a tag's name, when its content records none.
enum class SamplesFromName {
  kAsNxdtReads,  // ConsumedSamplesFromTagPath only: resume, which must continue as NxDT would
  kTagName,      // shardkit's and NxDT's tag name (ParseTagName) first, then as NxDT reads it: the tag reader
};

// Where a tag stands by what it records and what its folder's name says,
// content over name: the one rule resume (ReadTrainingPosition) and the tag
// reader (ShardedTag::step) both take. The step is the content's
// (UserContent::ResumeStep) when there is content, else the name's (step=N,
// else NxD's step_<N>); consumed samples the content's, else the name's. The
// name's own values are kept so a caller can say when they disagree. Pure.
struct RecordedPosition {
  std::optional<int64_t> step;             // nullopt: neither content nor name gives one
  bool step_from_content = false;
  std::optional<int64_t> named_step;       // the name's: ParseTagName's step, else ParseNxdStepTagName
  std::optional<double> consumed_samples;  // nullopt: recorded nowhere
  bool samples_from_content = false;
  std::optional<int64_t> samples_nxdt_reads;  // ConsumedSamplesFromTagPath of the name
};
// `content`: the tag's parsed user_content.pt, or null when it has none (or
// none that records a step); `tag_name`: the tag folder's name.
RecordedPosition PositionFromContent(const UserContent* content, const std::string& tag_name, SamplesFromName rule);

// Where a tag says training stands, read from what it records, as a resumed
// run continues: the step from user_content.pt (Lightning's loops, else
// global_step; NxD's free-form user content has none, and its step_<N> name
// tells it), consumed samples from user_content.pt, else from the name as
// NxDT reads it (ConsumedSamplesFromTagPath), and the LR schedule's step from
// lr_schedulers[0], else scheduler.pt. The content wins over the name: a
// name that says otherwise is a warning in `notes`, never the value used.
struct TrainingPosition {
  int64_t step = 0;
  bool step_recorded = false;                // false: weights only (no user_content.pt), the run starts at step 0
  std::optional<int64_t> consumed_samples;   // nullopt: recorded nowhere (NxDT assumes 0)
  std::optional<int64_t> schedule_step;      // nullopt: recorded nowhere (the schedule restarts)
  std::vector<std::string> notes;            // "info: ..." / "warning: ..." lines for the log
};
// Throws ckpt::Error naming the file and the value when what the tag records
// is malformed or out of bounds (UserContent::FromValue,
// SchedulerState::FromValue), or when only its name gives consumed samples and
// they are past kMaxRecordedSamples. Reads nothing outside `tag`.
TrainingPosition ReadTrainingPosition(Env* env, const std::string& tag);

}  // namespace ckpt

// The training configuration, read from an NxDT YAML config (the schema in
// NxDT's reference configs) with Hydra-style overrides applied and
// interpolations resolved. Every key is judged by libtrain/config_keys.cc's
// table first: a key that would change what is trained in a way shardkit does
// not implement is refused, and keys that only matter on Neuron hardware (or
// have no effect here) are accepted and listed once in `ignored`. Invalid
// values and combinations raise an error naming the key before any work starts.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ckpt/spec/rank_grid.h"
#include "ckpt/util/error.h"
#include "libtrain/model.h"
#include "libtrain/optimizer.h"

namespace train {

// The config (or what it names, such as the data) is wrong or asks for what
// shardkit does not implement: bad input, exit 2. The message names the file and key.
class ConfigError : public ckpt::Error {
 public:
  explicit ConfigError(const std::string& what) : ckpt::Error(what) {}
};

struct TrainConfig {
  std::string source, name = "megatron_llama";
  uint64_t seed = 1234;
  // trainer
  int64_t max_steps = 1, log_every_n_steps = 1;
  double gradient_clip_val = 0;
  // exp_manager
  std::string explicit_log_dir, exp_dir = "nemo_experiments", exp_name, version = "version_0";
  bool resume_if_exists = false, resume_ignore_no_checkpoint = false;
  std::string resume_from_checkpoint;
  bool resume_past_damaged_checkpoints = false;
  // shardkit's own: a tag cut for other degrees is resharded for this run and resumed from.
  bool resume_reshard = false;
  bool create_checkpoint_callback = true, async_checkpointing = false;
  // Rank files as xser (NxD's use_xser), as NxDT's exp_manager.save_xser asks
  // (nlp_overrides.py is_save_type_xser: absent means plain). load_xser has no
  // effect in NxDT either: NxD's loader reads each tag as it finds it, and so
  // does resume here.
  bool save_xser = false;
  // NxDT's model.weight_init_only (examples/training.py -> NLPCheckpointIO):
  // resume reads the model only and the optimizer starts fresh; also the way
  // past the one-shard ZeRO-1 state NxDT saves at dp > 1.
  bool weight_init_only = false;
  int64_t save_top_k = -1, every_n_train_steps = 0;
  bool log_parameter_norm = true, log_gradient_norm = true;
  // data
  int64_t micro_batch_size = 1, global_batch_size = 1, seq_length = 128;
  // distributed_strategy over trainer.devices * trainer.num_nodes ranks.
  ckpt::RankGrid grid;
  // The pipeline stages' layers (ckpt::StageBounds): NxD's even split, or
  // model.pipeline_cuts, as the first layer of stages 1..pp-1 (shardkit's
  // numbers) or as NxDT names them (the last layer of stages 0..pp-2,
  // "model.layers.N" or "language_model.encoder.layers.N"); held as the former.
  std::vector<int64_t> pipeline_cuts, stage_bounds;
  // The interleaved schedule's virtual stages per pp rank (V): stage_bounds
  // then has pp * V stages, pp rank p holding stages p, p + pp, ...; the key
  // that set it (for errors).
  int virtual_pipeline = 1;
  std::string virtual_pipeline_key;
  bool sequence_parallel = false;  // distributed_strategy.sequence_parallel
  std::vector<std::pair<double, std::string>> data_prefix;  // (weight, prefix or .h5 file)
  std::string data_impl = "mmap";                           // mmap (Megatron .bin/.idx) or hdf5
  // model and optimisation
  ModelConfig model;
  AdamWConfig optim;
  ScheduleConfig sched;
  // precision.type: fp32, or mixed_precision (bfloat16 parameters with
  // float32 master weights and optimizer state: model.bf16_params and
  // optim.master_weights).
  std::string precision = "fp32";
  std::vector<std::string> ignored;  // keys accepted and ignored, each with the reason

  std::string RunDir() const;
  std::string CheckpointDir() const { return RunDir() + "/checkpoints"; }
};

// Throws migrate::InputError (bad YAML or override) or ConfigError (a bad
// value, or a key shardkit does not implement), naming the file and key.
TrainConfig LoadTrainConfig(const std::string& path, const std::vector<std::string>& overrides);
// The same from the YAML text itself; `path` names it in errors and anchors relative paths.
TrainConfig ParseTrainConfig(const std::string& text, const std::string& path, const std::vector<std::string>& overrides);

}  // namespace train

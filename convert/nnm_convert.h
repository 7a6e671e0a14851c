// The NNM -> NxDT mapping: from the loaded Lightning
// checkpoints of every (tp, pp) rank to the files of one NxDT tag, at the same
// parallel degrees. No tensor is copied here: outputs view the inputs' mapped
// bytes, and writing streams them.
//
//  - Model: `state_dict` (or the `model{i}` chunks of a virtual pipeline) with
//    `model.` stripped and layer indices renumbered to global ones from the
//    layer counts actually present per stage and chunk (no even-split
//    assumption), cross-checked with --n_layers. Non-tensor entries
//    (`untrained_buffer_names`) are dropped with a note; buffers such as
//    `rotary_emb.inv_freq` are kept.
//  - Optimizer (`optimizer_states[0]`, or NNM's ZeRO-1 files): the grouping
//    NNM used is read from the file, the ids are renumbered into the grouping
//    the trainer will build (nnm_optimizer.h), ZeRO-1 shards keep their
//    padding. An input with no optimizer state (NNM's HF converter writes
//    such files) converts its weights, and the trainer starts a fresh optimizer.
//  - Step, epoch, consumed samples, loops and the LR scheduler state go to
//    user_content.pt and scheduler.pt, which the training core resumes from.
// Anything that does not fit throws ckpt::Error naming the file and key.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/util/error.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/tag_writer.h"
#include "ckpt/pt/value.h"
#include "convert/nnm_source.h"

namespace convert {

// The optimizer grouping written: kKeep, NxDT's grouping (either
// do_layer_norm_weight_decay setting) that decays exactly what NNM decayed,
// an error when neither does (NNM's GPT: its LayerNorm weights did not decay,
// NxDT's do); kNxdt, NxDT's grouping with do_layer_norm_weight_decay False
// (ckpt::NxdtGrouping: only biases apart).
enum class OptimizerGroups { kKeep, kNxdt };

struct ConvertOptions {
  int n_layers = 0;  // 0: whatever the checkpoint holds
  bool weights_only = false;
  bool save_xser = false;
  OptimizerGroups optimizer_groups = OptimizerGroups::kKeep;
  bool require_optimizer = false;  // an input without optimizer state is an error
};

// The input holds no optimizer state and ConvertOptions::require_optimizer is set.
class MissingOptimizerState : public ckpt::Error {
 public:
  using ckpt::Error::Error;
};

// One (tp, pp) rank's loaded inputs.
struct RankInput {
  std::string path;
  ckpt::Value checkpoint;                // the Lightning dict
  std::vector<std::string> zero1_paths;  // by dp rank
  std::vector<ckpt::Value> zero1;
};

struct Rename {
  std::string from, to;
};

struct PlannedFile {
  ckpt::FileToWrite file;
  std::string source;  // the input it comes from
  int unit;            // input index p * tp + t; -1 for the rank-0 files
  int64_t tensors = 0;
  uint64_t bytes = 0;  // tensor bytes
};

struct ConvertPlan {
  ckpt::RankGrid grid;
  int64_t global_step = 0, epoch = 0;
  double consumed_samples = 0;
  int total_layers = 0;
  std::vector<std::vector<int>> layers;     // [chunk][stage]: layer count
  std::vector<std::vector<Rename>> renames;  // [stage]: tp rank 0's key renames
  std::vector<PlannedFile> files;
  std::vector<std::string> notes;
  // Non-empty when the output's user content will not record the model's
  // heads: the note to give before writing, unless the view of the planned
  // files reads the format from hints (the engine's manifest records it then).
  std::string format_unrecorded;
  bool optimizer = true;          // false: the input held none (or --weights_only)
  std::string source_grouping;    // what NNM's optimizer ids number, as found in the files
  std::string target_grouping;    // what the written ids number
  bool do_layer_norm_weight_decay = false;  // the trainer setting the target grouping needs
};

// `inputs` in NnmSource::files order.
ConvertPlan PlanConversion(const NnmSource& src, const std::vector<RankInput>& inputs, const ConvertOptions& opts);

// "language_model.encoder.layers.7.mlp..." with its first layer index
// shifted by `offset`; `local` receives the index. False when no index.
bool ShiftLayerIndex(const std::string& key, int offset, std::string* out, int* local);

}  // namespace convert

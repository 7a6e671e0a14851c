// ShardedTag reads a checkpoint tag of any layout as logical tensors: it maps
// every rank file, learns the layout (degrees, stage split, model format,
// optimizer form), checks every tensor against the partition rules
// (ckpt/spec/partition.h), and indexes where each run of each logical tensor's
// elements lies in which mapped file. A reader then copies any range of a
// logical tensor without assembling it, so tools that re-lay a checkpoint
// (ckpt-reshard, export) need memory for what they copy, not for the model.
//
// The layout comes from the tag's manifest when it has one; NxD's own tags
// have none, and then the degrees come from the rank-file names (tp, pp) and
// the optimizer files (dp, ZeRO-1), the stage split from the layer numbers in
// each stage's file, and the model format from tensor shapes plus what
// shapes cannot tell (FormatHints: heads, KV heads, the unpadded vocabulary).
//
// The reader is four parts: TagFiles finds and loads the rank files
// (ckpt/shard/tag_files.h), DescribeModel learns the stages and the model
// format (ckpt/shard/model_description.h), ExtentIndex indexes where each
// run of elements lies (ckpt/shard/extent_index.h), and ReadTagOptimizer
// reads the optimizer files (ckpt/shard/tag_optimizer.h).
//
// Optimizer state: torch's AdamW state dict (`state`), or torch-xla ZeRO-1's
// (`base_state` of dim-0 shards, `shape_info`, optional
// `sharded_master_weights`); ids are tied to parameters by NxDT's grouping
// (OptimizerOrder), checked against the file's `param_groups`.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/shard/extent_index.h"
#include "ckpt/shard/logical_state.h"
#include "ckpt/shard/model_description.h"
#include "ckpt/shard/tag_files.h"
#include "ckpt/shard/tag_optimizer.h"
#include "ckpt/util/error.h"

namespace ckpt {

struct TagReadOptions {
  // Read the model only; optimizer files are not opened (a fresh optimizer
  // follows). The way past an optimizer that cannot be read, such as the
  // one-shard ZeRO-1 state NxDT writes at dp > 1 (Zero1SavedAsOneShard).
  bool weights_only = false;
  // Replicated tensors (norms on every tp rank, KV heads NxD replicates) are
  // compared across their holders, and a difference is refused; with this,
  // the first holder's copy is read and the others are not compared.
  bool trust_first_replica = false;
};

class ShardedTag final : public LogicalState {
 public:
  // Throws ckpt::Error naming the file, key and problem for anything that is
  // not a complete, consistent tag. Rank files are plain .pt or xser (the
  // whole tag one or the other, as NxD's loader decides per tag:
  // checkpoint_storage.py is_checkpoint_xser), each tensor file mapped;
  // model files may list their entries in any order (names are the keys).
  static std::unique_ptr<ShardedTag> Open(Env* env, const std::string& tag_dir, const FormatHints& hints = {},
                                          const TagReadOptions& opts = {});
  // A tag that exists only in memory, read as Open reads one on disk:
  // `files` maps each path in the tag (model/<rank file>, optim/<rank file>,
  // user_content.pt, scheduler.pt) to its loaded value, whose tensors view
  // the bytes of mapped inputs (nnm2nxdt-ckpt's mapping of NNM's files, so
  // the reshard engine writes them in another parallel layout in one pass).
  // `manifest` says what a manifest on disk would (degrees, step, optimizer
  // grouping, and the model format when known); `label` names the source in
  // messages. Tensors must hold their bytes (no generated storages).
  static std::unique_ptr<ShardedTag> FromFiles(const std::string& label, std::map<std::string, Value> files, const Manifest& manifest,
                                               const FormatHints& hints = {}, const TagReadOptions& opts = {});

  const std::string& path() const override { return dir_; }
  const TagDescription& layout() const override { return layout_; }
  // The logical parameters, vocab padded as this tag pads it.
  const std::vector<ParamRule>& params() const override { return params_; }
  bool Has(const std::string& name, StateField f) const override { return index_.Has(name, f); }
  DType dtype(const std::string& name, StateField f) const override;
  // Copies logical (row-major) elements [begin, begin + out.size() / element
  // size) of `name`'s `f` into `out`. Elements past what the tag holds (vocab
  // rows beyond its padding) read as zero. Thread-safe.
  void Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const override;
  // The optimizer `step` entry of a logical parameter (as its first holder wrote it).
  const Value& Step(const std::string& name) const override;
  // `param_groups` of the first optimizer file: the hyperparameters.
  const Value& ParamGroups() const override { return optimizer_.param_groups; }
  using Buffer = StateBuffer;
  const std::vector<Buffer>& buffers() const override { return buffers_; }
  bool model_dict_ordered() const override { return ordered_; }
  // Bytes of every rank file (with xser, of every tensor file too).
  uint64_t bytes() const { return files_->bytes(); }
  // Whether the rank files are xser (X.pt + X.pt.tensors/) rather than plain .pt.
  bool xser() const override { return files_->xser(); }
  // The tag has optimizer files that were not read (TagReadOptions::weights_only).
  bool optimizer_skipped() const { return optimizer_skipped_; }
  int64_t step() const override { return step_; }
  // The fingerprints the manifest records (ckpt/shard/fingerprint.h), if any.
  const std::optional<TensorFingerprints>& recorded_fingerprints() const override { return recorded_; }
  double consumed_samples() const override { return consumed_; }
  bool consumed_samples_known() const override { return consumed_known_; }
  // What the model format was taken from besides tensor shapes (the job config an NxDT tag records).
  const std::vector<std::string>& format_notes() const { return format_notes_; }
  std::optional<Value> TagFile(const std::string& name) const override;

 private:
  std::unique_ptr<TagFiles> files_;  // the rank files, kept mapped for the extents that view them
  std::string dir_;
  TagDescription layout_;
  std::vector<ParamRule> params_;
  ExtentIndex index_;
  TagOptimizerState optimizer_;
  std::vector<Buffer> buffers_;
  bool ordered_ = false;
  bool optimizer_skipped_ = false;
  int64_t step_ = 0;
  double consumed_ = 0;
  bool consumed_known_ = true;
  std::vector<std::string> format_notes_;
  std::optional<TensorFingerprints> recorded_;

  friend class ShardedTagBuilder;
};

}  // namespace ckpt

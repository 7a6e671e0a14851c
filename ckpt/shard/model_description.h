// What model a tag holds (the tag reader's second part, ckpt/shard/sharded_tag.h):
// its stage split and its model format, from what the tag records or, where
// it records nothing (NxD's tags have no manifest), inferred by the model's
// family from tensor names and shapes, the hints a user gives, and the job
// config an NxDT tag records in user_content.pt. Pure: it reads the loaded
// model files it is given and opens nothing.
//
// Each family infers its own format (DescribeMegatronModel,
// DescribeHfLlamaModel); a manifest's format is taken as recorded, checked
// against the hints and refined by a true vocabulary (DescribeRecordedModel).
// What was taken from besides the shapes is said in `notes`.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/util/error.h"

namespace ckpt {

// The tag's model format cannot be learned without hints the reader lacks (heads, KV heads).
class FormatUnknown : public Error {
 public:
  using Error::Error;
};

// What the model is described from.
struct ModelEvidence {
  std::string dir;         // the tag, as messages name it
  bool in_memory = false;  // ShardedTag::FromFiles: no manifest file, no hyper_parameters.cfg
  RankGrid grid;
  // Tp rank t's model file of stage p.
  std::function<const Dict&(int t, int p)> model;
  // A path in the tag as messages name it (TagFiles::Path).
  std::function<std::string(const std::string& rel)> path;
  // user_content.pt, when the tag has one (asked for only where a job config can tell what shapes do not).
  std::function<const Value*()> user_content;
  const ModelFormat* recorded = nullptr;     // the format the manifest records, when it does
  const StageMap* recorded_stages = nullptr;  // the stage map the manifest records (layout.stages), when it does
};

struct ModelDescription {
  std::vector<int64_t> stage_bounds;  // StageBounds over every stage (pp * virtual_stages)
  int virtual_stages = 1;             // stages per pp rank (NxD's virtual_pipeline_size)
  ModelFormat format;
  bool from_manifest = false;
  std::vector<ParamRule> params;  // LogicalParameters at the tag's tp
  TiedCopyNaming tied_naming = TiedCopyNaming::kNxdt;
  std::vector<std::string> notes;  // what the format was taken from besides shapes
};

// The stage split the layer numbers in the pp ranks' files give: one range
// of consecutive layers per pp rank, in order; or NxD's virtual pipeline
// stages (ckpt/spec/partition.h: pp rank p holding stages p, p + pp, ...),
// told apart by the gaps between a rank's layers (at pp > 1 a rank's stages
// are never adjacent). A recorded stage map (layout.stages) is taken when it
// covers each rank's layers as the names do (at pp = 1 the names cannot tell
// virtual stages apart). Throws naming the stage's file, or the manifest,
// otherwise.
StageSplit StageSplitOfFiles(const ModelEvidence& e);
// StageSplitOfFiles' bounds.
std::vector<int64_t> StageBoundsOfFiles(const ModelEvidence& e);

// The recorded format, hints checked against it and a true vocabulary taken (see the .cc).
ModelFormat DescribeRecordedModel(const ModelEvidence& e, const FormatHints& hints, std::vector<std::string>* notes);
// A Megatron-style tag without a manifest: sizes from shapes, heads from a
// hint or the job config, KV heads from the key_value rows, the vocabulary's
// padding rule from hints or the job config.
ModelFormat DescribeMegatronModel(const ModelEvidence& e, const std::vector<int64_t>& stage_bounds, FormatHints hints,
                                  std::vector<std::string>* notes);
// An HF-style tag without a manifest (what NxD's checkpoint_converter.py and
// NxDT's HF models write): sizes from shapes, the attention layout from the
// names, heads from a hint, NxD's KV replication from the data.
ModelFormat DescribeHfLlamaModel(const ModelEvidence& e, const std::vector<int64_t>& stage_bounds, const FormatHints& hints,
                                 std::vector<std::string>* notes);

// The whole description: stages, the format (recorded, else by family), the
// logical parameters at the tag's tp and how GPT's tied copy is named.
// Throws FormatUnknown when a hint is needed, ckpt::Error for a tag no
// format describes.
ModelDescription DescribeModel(const ModelEvidence& e, const FormatHints& hints);

}  // namespace ckpt

// A tag's optimizer files read as logical optimizer state (the tag reader's
// fourth part, ckpt/shard/sharded_tag.h): each file parsed by the one
// optimizer-schema parser (OptimizerFileView, ckpt/spec/optimizer_state.h),
// its ids tied to the stage's parameters by NxDT's grouping (the first file
// decides among the groupings that fit, or the manifest does; every other
// file must fit the same), ZeRO-1 shards checked against their shape_info
// and dp, and every moment and master weight indexed (ckpt/shard/extent_index.h).
//
// torch's AdamW state dict (`state`), or torch-xla ZeRO-1's (`base_state` of
// dim-0 shards, `shape_info`, optional `sharded_master_weights`). GPT's tied
// output copy is read from the embedding's state, which it must equal.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/shard/extent_index.h"
#include "ckpt/shard/logical_state.h"
#include "ckpt/shard/tag_files.h"

namespace ckpt {

struct TagOptimizerState {
  Value param_groups;                   // the first file's: the hyperparameters
  std::map<std::string, Value> steps;   // each parameter's `step`, as its first holder wrote it
};

// Reads every optimizer file of `layout` (whose grid says dp and ZeRO-1) from
// `files`, setting layout.grouping and layout.master_weights, indexing into
// `index`. `recorded_grouping`: the manifest's, which then decides. Throws
// ckpt::Error naming the file, the parameter id and name, and the problem.
void ReadTagOptimizer(TagFiles& files, TagDescription& layout, const std::vector<ParamRule>& params,
                      const std::optional<GroupingRule>& recorded_grouping, ExtentIndex& index, TagOptimizerState* out);

}  // namespace ckpt

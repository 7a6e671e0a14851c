// The optimizer state of one NNM (tp, pp) rank, mapped to NxDT.
//
// NNM's optimizer ids number its parameter groups (convert/nnm_grouping.h),
// and NNM groups by module class, which a file does not record. So the
// grouping is read from the file: of every grouping NNM can produce, the one
// whose group count and sizes, then every moment's shape (for ZeRO-1 the
// padded dim-0 shard, and `shape_info`), fit. Nothing is tied by assumption:
// when none fits, or several fit with different ties, it is an error naming
// each candidate and why.
//
// The output is renumbered into the grouping the NxDT trainer will build, and
// `param_groups` rebuilt from NNM's hyperparameters; the moments themselves
// are not copied (outputs view the inputs' mapped bytes).
#pragma once

#include <string>
#include <vector>

#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/pt/value.h"

namespace convert {

// One optimizer state dict as NNM wrote it.
struct SourceOptimizer {
  std::string path;   // the file it was read from
  std::string where;  // "<file>: optimizer_states[0]", for messages
  ckpt::Value state_dict;  // torch AdamW's, or torch-xla ZeRO-1's
  int zero1_dp = 0;        // ZeRO-1 data-parallel degree; 0 for a plain state dict
};

// `optimizer_states[0]` of a Lightning checkpoint; `found` is false when the
// checkpoint holds no optimizer state (NNM's HF converter writes such files).
SourceOptimizer PlainOptimizer(const ckpt::Value& checkpoint, const std::string& path, bool* found);

// A ZeRO-1 file: NNM moves Lightning's `optimizer_states` list out of the
// checkpoint as it is (nlp_overrides.py, _remove_optimizer_states_from_checkpoint;
// its loader asserts the list type), so element 0 is torch-xla ZeRO-1's state dict.
SourceOptimizer Zero1Optimizer(const ckpt::Value& file, const std::string& path, int dp);

// The grouping NNM used for `params` (the rank's parameters in module order).
ckpt::Grouping FindSourceGrouping(const std::vector<ckpt::ParamInfo>& params, const SourceOptimizer& so);

// The state dict renumbered from `from` to `to` (both over the same
// parameters), with param_groups rebuilt: the target's group 0 takes NNM's
// group 0 hyperparameters, its group 1 NNM's group 1 (or group 0's with
// weight_decay 0). Empty groups are dropped, as the trainer drops them.
ckpt::Value RegroupOptimizerState(const SourceOptimizer& so, const ckpt::Grouping& from, const ckpt::Grouping& to);

}  // namespace convert

// The paths of an NxDT tag: rank file names, tag names and markers (the rank
// grid, in ckpt/spec/rank_grid.h, says which files a tag holds). This is the
// one place that knows these names; the store, resume, verify and every tool
// use it. (What a tag holds, its parallel layout and model format, is
// ckpt::TagDescription in ckpt/shard/logical_state.h.)
//
//   <checkpoint_dir>/<name>--step=S-consumed_samples=C.ckpt/
//     checkpoint                         "1": the save has begun
//     model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt
//     optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt   (DD = 00 unless ZeRO-1)
//     scheduler.pt, user_content.pt
//     manifest.json                      shardkit: sizes, checksums, grid
//     done                               "1": every file of every rank is durable
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/spec/rank_grid.h"

namespace ckpt {

inline constexpr const char* kCheckpointMarker = "checkpoint";
inline constexpr const char* kDoneMarker = "done";
inline constexpr const char* kNewestFile = "newest";  // NxD 2.16's top-level list of tags
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kSchedulerFile = "scheduler.pt";
inline constexpr const char* kUserContentFile = "user_content.pt";

// "dp_rank_00_tp_rank_03_pp_rank_01.pt"; {:02d} is a minimum width. With r.ep
// set, "dp_rank_00_ep_rank_01_tp_rank_03_pp_rank_01.pt" (NxD
// trainer/checkpoint.py _get_path: dp, then ep, tp, pp).
std::string RankFileName(const RankCoord& r);
// "model/" or "optim/" + RankFileName(r): a rank file's path in its tag
// (RankGrid::ForEachRankFile walks them).
std::string RankFilePath(RankFileKind kind, const RankCoord& r);
// Parses a rank file name. An expert-parallel one (dp_rank_.._ep_rank_..) throws
// ckpt::Error naming MoE: the tag readers do not take them yet, and taking it
// for another rank's file would be wrong.
std::optional<RankCoord> ParseRankFileName(const std::string& name);
// Parses a rank file name of either form; an expert-parallel one gives a
// coordinate with `ep` set.
std::optional<RankCoord> ParseAnyRankFileName(const std::string& name);

// Why model files named `coords` (ParseAnyRankFileName of each) are not an
// NxD tag's: an ep rank named in some and not others, or ep rank 0 alone (NxD
// names the ep rank in every model file, and only at ep size > 1:
// trainer/checkpoint.py _get_path). "" when they are; the caller names the
// first file with an ep rank.
std::string EpNamingProblem(const std::vector<RankCoord>& coords);

// A tag the store set aside rather than delete: <tag>.damaged[-N] (it failed
// verification) or <tag>.superseded[-N] (a later save took its name). Kept on
// disk, never a candidate for resume, retention or --gc.
inline constexpr const char* kDamagedSuffix = ".damaged";
inline constexpr const char* kSupersededSuffix = ".superseded";
bool IsSetAsideTagName(const std::string& dir_name);

// The step of a tag NxD's own llama example names step_<N>
// (examples/training/llama/tp_pp_llama_hf_pretrain/run_llama_nxd.py); its user
// content is free-form, so the name is what tells the step.
std::optional<int64_t> ParseNxdStepTagName(const std::string& dir_name);

struct TagName {
  std::string name;         // e.g. "megatron_llama"
  int64_t step = 0;
  double consumed_samples = 0;
  bool last = false;        // "-last" suffix
};

// "<name>--step=S-consumed_samples=C.ckpt", C printed as a float ("5120.0").
std::string FormatTagName(const TagName& t);
std::optional<TagName> ParseTagName(const std::string& dir_name);

}  // namespace ckpt

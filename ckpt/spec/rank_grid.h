// The rank grid: the one place that knows how a job's ranks map to
// coordinates on the named axes (ckpt/spec/axes.h), which rank groups they
// form, which files a tag of that grid holds, and how mpirun started this
// process. The store, the trainer, the converter and the layout tools take a
// RankGrid and an MpiLaunch; nothing else computes ranks or walks rank files.
//
// Rank order is NxD's and Megatron's parallel_state order: tensor-parallel
// ranks are consecutive, then data-parallel, then pipeline stages:
//   rank = pp * (dp_size * tp_size) + dp * tp_size + tp.
// Expert parallelism lies inside dp (RankGrid::ep: a coordinate's ep rank,
// its model file names); virtual pipeline stages would be a further axis of
// kGridAxes, which the grid does not lay out yet.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/spec/axes.h"

namespace ckpt {

// The most ranks (and so the largest tensor, pipeline or data-parallel degree)
// any shardkit input may claim; past it a value is malformed, not large.
inline constexpr int64_t kMaxRanks = 1 << 20;

struct RankCoord {
  int dp = 0, tp = 0, pp = 0;
  // The expert-parallel rank a file name carries: NxD names files
  // dp_rank_DD_ep_rank_EE_tp_rank_TT_pp_rank_PP only when the job's ep size
  // is above 1 (trainer/checkpoint.py _get_path(ep=True), called with
  // ep_enabled = get_expert_model_parallel_size() > 1); unset otherwise.
  std::optional<int> ep = std::nullopt;
  bool operator==(const RankCoord&) const = default;
};

// The axes of the grid, fastest first: a rank's number is its place along
// them read as a mixed-radix number.
inline constexpr Axis kGridAxes[] = {Axis::kTp, Axis::kDp, Axis::kPp};

// The two kinds of rank file of a tag: model/ (one per tp, pp place, written
// by dp rank 0) and optim/ (one per dp rank under ZeRO-1, else dp 0's alone).
enum class RankFileKind { kModel, kOptim };

enum class ExpertAxis { kEp, kExpertDp };

struct RankGrid {
  int tp = 1, pp = 1, dp = 1;
  // ZeRO-1: one optim file per dp rank; otherwise dp rank 0 only.
  bool zero1 = false;
  // Expert parallelism inside dp, as NxD lays it out
  // (parallel_layers/parallel_state.py initialize_model_parallel's table:
  // "(DP=1) or (DP_EXP=0, EP=1)"): a rank's ep rank is its dp rank % ep, its
  // expert-data-parallel rank dp / ep. ep must divide dp. With ep > 1 every
  // model file carries its ep rank: ep rank e's file, written by the first rank
  // of its expert-dp group, holds e's experts (and, in a plain .pt, every
  // non-expert tensor too).
  int ep = 1;

  // tp * pp * dp: the ranks a job of this grid runs.
  int world_size() const { return tp * pp * dp; }
  // The coordinates of `rank` (0 <= rank < world_size()) and back.
  RankCoord CoordOf(int rank) const;
  int RankOf(const RankCoord& c) const;
  // The degree along `a` (1 for an axis the grid does not lay out), and a
  // rank's place along every axis (what a shard spec's boxes are asked of).
  int size(Axis a) const;
  AxisCoords AxisCoordsOf(const RankCoord& c) const;
  // The rank group of `rank` over `axes`: the ranks that differ from it only
  // along those axes, ascending (so ordered by their place in the group, tp
  // fastest). {kTp}, {kDp}, {kPp} are NxD's tensor-, data- and
  // pipeline-parallel groups; {kTp, kPp} its model-parallel group
  // (parallel_layers/parallel_state.py initialize_model_parallel; Megatron
  // core's RankGenerator.get_ranks does the same for any set of axes).
  std::vector<int> Group(int rank, std::initializer_list<Axis> axes) const;

  // The rank groups expert parallelism makes inside dp (NxD's
  // parallel_state.py initialize_model_parallel: the expert-model-parallel
  // and expert-data-parallel groups), by EpOf's rule: kEp, the ranks of
  // rank's tp, pp and expert-dp rank (dp / ep), ep rank ascending (they
  // exchange tokens); kExpertDp, those of its tp, pp and ep rank, expert-dp
  // rank ascending (they hold the same experts). At ep 1: {rank}, and the dp group.
  std::vector<int> ExpertGroup(int rank, ExpertAxis axis) const;

  // The grid of `world` ranks at tensor degree tp and pipeline degree pp:
  // dp = world / (tp * pp). Throws ckpt::Error naming `where` when a degree is
  // out of range or tp * pp does not divide world (described as `world_what`).
  static RankGrid ForWorld(int64_t world, int64_t tp, int64_t pp, bool zero1, const std::string& where,
                           const std::string& world_what = "the world size");

  // Calls fn with the coordinates of every `kind` file a complete tag of this
  // grid holds: model files of dp 0, pp outer and tp inner; optim files
  // likewise for each dp rank that writes them (every one under ZeRO-1, else
  // dp 0), dp outermost. With `place`, only the files of its tp and pp.
  void ForEachRankFile(RankFileKind kind, const std::function<void(const RankCoord&)>& fn) const;
  void ForEachRankFile(RankFileKind kind, const RankCoord& place, const std::function<void(const RankCoord&)>& fn) const;
  // The `kind` file the rank at `at` reads and writes (RankFilePath in
  // ckpt/store/tag_paths.h): model files are dp 0's, optim files too unless ZeRO-1.
  std::string FileOf(RankFileKind kind, RankCoord at) const;
  // Relative paths a complete tag holds, in ForEachRankFile's order.
  std::vector<std::string> ModelFiles() const;
  std::vector<std::string> OptimFiles() const;
  // The ep rank of a coordinate (0 at ep 1).
  int EpOf(const RankCoord& c) const { return c.dp % ep; }
  // "tp 2, pp 1, dp 2 (ZeRO-1)"; ", ep 2" added at ep > 1.
  std::string ToString() const;
  bool operator==(const RankGrid&) const = default;
};

// How mpirun (Open MPI / PMIx) started this process: its rank and the world
// size, as mpirun's environment says before MPI is initialized
// (ReadMpiLaunch; job_id empty). The checkpoint store also takes a job id
// every rank shares, which the trainer broadcasts.
struct MpiLaunch {
  int rank = 0, world_size = 1;
  std::string job_id;
};
MpiLaunch ReadMpiLaunch();

}  // namespace ckpt

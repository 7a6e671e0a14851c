// The rank grid: the one place that knows how a job's ranks map to
// (dp, tp, pp) coordinates, which files a tag of that grid holds, and how
// mpirun started this process. The store, the trainer, the converter and the
// layout tools take a RankGrid and an MpiLaunch; nothing else computes ranks.
//
// Rank order is NxD's and Megatron's parallel_state order: tensor-parallel
// ranks are consecutive, then data-parallel, then pipeline stages:
//   rank = pp * (dp_size * tp_size) + dp * tp_size + tp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ckpt {

// The most ranks (and so the largest tensor, pipeline or data-parallel degree)
// any shardkit input may claim; past it a value is malformed, not large.
inline constexpr int64_t kMaxRanks = 1 << 20;

struct RankCoord {
  int dp = 0, tp = 0, pp = 0;
  bool operator==(const RankCoord&) const = default;
};

struct RankGrid {
  int tp = 1, pp = 1, dp = 1;
  // ZeRO-1: one optim file per dp rank; otherwise dp rank 0 only.
  bool zero1 = false;

  // tp * pp * dp: the ranks a job of this grid runs.
  int world_size() const { return tp * pp * dp; }
  // The coordinates of `rank` (0 <= rank < world_size()) and back.
  RankCoord CoordOf(int rank) const;
  int RankOf(const RankCoord& c) const;
  // The ranks of the tensor-, data- and pipeline-parallel groups `rank` is
  // in, ordered by their rank within the group.
  std::vector<int> TpGroup(int rank) const;
  std::vector<int> DpGroup(int rank) const;
  std::vector<int> PpGroup(int rank) const;

  // The grid of `world` ranks at tensor degree tp and pipeline degree pp:
  // dp = world / (tp * pp). Throws ckpt::Error naming `where` when a degree is
  // out of range or tp * pp does not divide world (described as `world_what`).
  static RankGrid ForWorld(int64_t world, int64_t tp, int64_t pp, bool zero1, const std::string& where,
                           const std::string& world_what = "the world size");

  // Relative paths a complete tag holds: model/ files for dp 0, optim/ files
  // for every dp rank under ZeRO-1 (dp 0 only otherwise).
  std::vector<std::string> ModelFiles() const;
  std::vector<std::string> OptimFiles() const;
  // "tp 2, pp 1, dp 2 (ZeRO-1)".
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

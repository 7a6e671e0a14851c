#include "ckpt/spec/rank_grid.h"

#include <algorithm>
#include <cstdlib>

#include "ckpt/util/error.h"
#include "ckpt/spec/tag_paths.h"

namespace ckpt {

RankCoord RankGrid::CoordOf(int rank) const {
  return RankCoord{.dp = (rank / tp) % dp, .tp = rank % tp, .pp = rank / (tp * dp)};
}

int RankGrid::RankOf(const RankCoord& c) const { return (c.pp * dp + c.dp) * tp + c.tp; }

int RankGrid::size(Axis a) const {
  switch (a) {
    case Axis::kTp: return tp;
    case Axis::kDp: return dp;
    case Axis::kPp: return pp;
    case Axis::kEp: return ep;
    default: return 1;
  }
}

AxisCoords RankGrid::AxisCoordsOf(const RankCoord& c) const {
  AxisCoords at;
  at[Axis::kTp] = {tp, c.tp}, at[Axis::kDp] = {dp, c.dp}, at[Axis::kPp] = {pp, c.pp};
  at[Axis::kEp] = {ep, c.ep.value_or(EpOf(c))};
  return at;
}

std::vector<int> RankGrid::Group(int rank, std::initializer_list<Axis> axes) const {
  const AxisCoords mine = AxisCoordsOf(CoordOf(rank));
  auto in_group = [&](int q) {
    const AxisCoords theirs = AxisCoordsOf(CoordOf(q));
    for (Axis a : kGridAxes)
      if (std::find(axes.begin(), axes.end(), a) == axes.end() && theirs[a] != mine[a]) return false;
    return true;
  };
  std::vector<int> g;
  for (int q = 0; q < world_size(); ++q)
    if (in_group(q)) g.push_back(q);
  return g;
}

std::vector<int> RankGrid::ExpertGroup(int rank, ExpertAxis axis) const {
  const RankCoord mine = CoordOf(rank);
  std::vector<int> g;
  for (int q : Group(rank, {Axis::kDp})) {
    const RankCoord theirs = CoordOf(q);
    const bool same = axis == ExpertAxis::kEp ? theirs.dp / ep == mine.dp / ep : EpOf(theirs) == EpOf(mine);
    if (same) g.push_back(q);
  }
  return g;
}

RankGrid RankGrid::ForWorld(int64_t world, int64_t tp, int64_t pp, bool zero1, const std::string& where, const std::string& world_what) {
  for (const auto& [name, v] : {std::pair{world_what, world}, {"tensor_model_parallel_size", tp}, {"pipeline_model_parallel_size", pp}})
    if (v < 1 || v > kMaxRanks)
      throw Error(where + ": " + name + " " + std::to_string(v) + " is not from 1 to " + std::to_string(kMaxRanks));
  if (world % (tp * pp))
    throw Error(where + ": tensor_model_parallel_size (" + std::to_string(tp) + ") * pipeline_model_parallel_size (" + std::to_string(pp) +
                ") = " + std::to_string(tp * pp) + " does not divide " + world_what + " (" + std::to_string(world) + ")");
  return RankGrid{static_cast<int>(tp), static_cast<int>(pp), static_cast<int>(world / (tp * pp)), zero1};
}

void RankGrid::ForEachRankFile(RankFileKind kind, const std::function<void(const RankCoord&)>& fn) const {
  if (kind == RankFileKind::kModel && ep > 1) {  // NxD's model path with ep: dp_rank_00, each ep rank's
    for (int e = 0; e < ep; ++e)
      for (int p = 0; p < pp; ++p)
        for (int t = 0; t < tp; ++t) fn({0, t, p, e});
    return;
  }
  const int dps = kind == RankFileKind::kOptim && zero1 ? dp : 1;
  for (int d = 0; d < dps; ++d)
    for (int p = 0; p < pp; ++p)
      for (int t = 0; t < tp; ++t) fn({d, t, p});
}

void RankGrid::ForEachRankFile(RankFileKind kind, const RankCoord& place, const std::function<void(const RankCoord&)>& fn) const {
  const int dps = kind == RankFileKind::kOptim && zero1 ? dp : 1;
  if (kind == RankFileKind::kModel && ep > 1) {
    for (int e = 0; e < ep; ++e) fn({0, place.tp, place.pp, e});
    return;
  }
  for (int d = 0; d < dps; ++d) fn({d, place.tp, place.pp});
}

std::string RankGrid::FileOf(RankFileKind kind, RankCoord at) const {
  if (kind == RankFileKind::kModel && ep > 1) at.ep = EpOf(at);
  if (kind == RankFileKind::kModel || !zero1) at.dp = 0;
  return RankFilePath(kind, at);
}

std::vector<std::string> RankGrid::ModelFiles() const {
  std::vector<std::string> out;
  ForEachRankFile(RankFileKind::kModel, [&](const RankCoord& c) { out.push_back(RankFilePath(RankFileKind::kModel, c)); });
  return out;
}

std::vector<std::string> RankGrid::OptimFiles() const {
  std::vector<std::string> out;
  ForEachRankFile(RankFileKind::kOptim, [&](const RankCoord& c) { out.push_back(RankFilePath(RankFileKind::kOptim, c)); });
  return out;
}

std::string RankGrid::ToString() const {
  return "tp " + std::to_string(tp) + ", pp " + std::to_string(pp) + ", dp " + std::to_string(dp) + (ep > 1 ? ", ep " + std::to_string(ep) : "") +
         (zero1 ? " (ZeRO-1)" : "");
}

MpiLaunch ReadMpiLaunch() {
  auto var = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v && *v ? v : nullptr;
  };
  MpiLaunch m;
  if (const char* size = var("OMPI_COMM_WORLD_SIZE")) {
    m.world_size = std::atoi(size);
    m.rank = std::atoi(var("OMPI_COMM_WORLD_RANK") ? var("OMPI_COMM_WORLD_RANK") : "0");
  }
  return m;
}

}  // namespace ckpt

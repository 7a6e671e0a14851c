#include "ckpt/spec/rank_grid.h"

#include <cstdlib>

#include "ckpt/util/error.h"
#include "ckpt/spec/tag_paths.h"

namespace ckpt {

RankCoord RankGrid::CoordOf(int rank) const {
  return RankCoord{.dp = (rank / tp) % dp, .tp = rank % tp, .pp = rank / (tp * dp)};
}

int RankGrid::RankOf(const RankCoord& c) const { return (c.pp * dp + c.dp) * tp + c.tp; }

std::vector<int> RankGrid::TpGroup(int rank) const {
  RankCoord c = CoordOf(rank);
  std::vector<int> g;
  for (c.tp = 0; c.tp < tp; ++c.tp) g.push_back(RankOf(c));
  return g;
}

std::vector<int> RankGrid::DpGroup(int rank) const {
  RankCoord c = CoordOf(rank);
  std::vector<int> g;
  for (c.dp = 0; c.dp < dp; ++c.dp) g.push_back(RankOf(c));
  return g;
}

std::vector<int> RankGrid::PpGroup(int rank) const {
  RankCoord c = CoordOf(rank);
  std::vector<int> g;
  for (c.pp = 0; c.pp < pp; ++c.pp) g.push_back(RankOf(c));
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

std::vector<std::string> RankGrid::ModelFiles() const {
  std::vector<std::string> out;
  for (int p = 0; p < pp; ++p)
    for (int t = 0; t < tp; ++t) out.push_back("model/" + RankFileName({0, t, p}));
  return out;
}

std::vector<std::string> RankGrid::OptimFiles() const {
  std::vector<std::string> out;
  for (int d = 0; d < (zero1 ? dp : 1); ++d)
    for (int p = 0; p < pp; ++p)
      for (int t = 0; t < tp; ++t) out.push_back("optim/" + RankFileName({d, t, p}));
  return out;
}

std::string RankGrid::ToString() const {
  return "tp " + std::to_string(tp) + ", pp " + std::to_string(pp) + ", dp " + std::to_string(dp) + (zero1 ? " (ZeRO-1)" : "");
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

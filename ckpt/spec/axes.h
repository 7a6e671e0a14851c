// The named parallel axes a job's ranks are laid out on, and a rank's place
// along each. Pure data: no I/O.
//
// NxD's order (parallel_layers/parallel_state.py initialize_model_parallel,
// and Megatron core's RankGenerator with order "tp-dp-pp"): tensor-parallel
// ranks are consecutive, then data-parallel, then pipeline stages. Expert
// parallelism (NxD's `ep`, rank files dp_rank_XX_ep_rank_EE_...) is named so a
// shard spec can split along it (Mixtral's expert weights); the rank grid
// (ckpt/spec/rank_grid.h) places it inside dp (RankGrid::ep, its groups
// RankGrid::ExpertGroup) and does not lay ranks out on virtual pipeline stages.
#pragma once

#include <array>
#include <cstdint>

namespace ckpt {

enum class Axis : uint8_t { kTp, kDp, kPp, kEp };
inline constexpr int kAxisCount = 4;
// "tp", "dp", "pp", "ep", as NxD's rank file names spell them.
inline const char* AxisName(Axis a) {
  static constexpr const char* kNames[kAxisCount] = {"tp", "dp", "pp", "ep"};
  return kNames[static_cast<int>(a)];
}

// A rank's place along one axis: `index` of `size` ranks.
struct AxisPlace {
  int size = 1, index = 0;
  bool operator==(const AxisPlace&) const = default;
};

// A rank's place along every axis; an axis a job does not use has size 1.
struct AxisCoords {
  std::array<AxisPlace, kAxisCount> places{};

  AxisPlace& operator[](Axis a) { return places[static_cast<int>(a)]; }
  const AxisPlace& operator[](Axis a) const { return places[static_cast<int>(a)]; }
  // Tensor-parallel rank `index` of `size`, every other axis of size 1.
  static AxisCoords Tp(int size, int index) {
    AxisCoords c;
    c[Axis::kTp] = {size, index};
    return c;
  }
  bool operator==(const AxisCoords&) const = default;
};

}  // namespace ckpt

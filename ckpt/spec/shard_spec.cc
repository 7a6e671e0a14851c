#include "ckpt/spec/shard_spec.h"

#include <algorithm>
#include <stdexcept>

namespace ckpt {
namespace {

int64_t KvMultiplier(const HeadSplit& h, int size) {
  if (h.kv_multiplier > 0) return h.kv_multiplier;
  return h.kv_heads < size ? size / h.kv_heads : 1;
}

// Head blocks as runs (adjacent ones merged). Runs of different regions
// ([Q; K; V]) are never merged, so a replicated K or V head is always a run
// of its own, as its other holders have it.
void AddHeadRuns(std::vector<Run>& runs, int64_t& local, int64_t base, const std::vector<int64_t>& heads, int64_t rows) {
  const size_t first = runs.size();
  for (int64_t h : heads) {
    if (runs.size() > first && runs.back().local + runs.back().count == local && runs.back().logical + runs.back().count == base + h * rows)
      runs.back().count += rows;
    else
      runs.push_back({local, base + h * rows, rows});
    local += rows;
  }
}

std::vector<Run> HeadSplitRuns(const HeadSplit& h, const AxisPlace& at) {
  std::vector<Run> runs;
  int64_t local = 0, base = 0;
  for (const HeadRegion& region : h.regions) {
    const auto heads = region.kv ? KvHeadsOf(h, at.size, at.index) : QueryHeadsOf(h, region.heads, at.size, at.index);
    AddHeadRuns(runs, local, base, heads, region.rows_per_head);
    base += region.heads * region.rows_per_head;
  }
  return runs;
}

}  // namespace

ShardSpec ShardSpec::Whole(std::vector<int64_t> shape, std::vector<Axis> replicated_over) {
  ShardSpec s;
  s.dims.resize(shape.size());
  s.global_shape = std::move(shape);
  s.replicated_over = std::move(replicated_over);
  return s;
}

ShardSpec& ShardSpec::Split(int dim, DimSplit split) {
  dims.at(dim) = std::move(split);
  return *this;
}

std::vector<int64_t> KvHeadsOf(const HeadSplit& h, int size, int rank) {
  const int64_t m = KvMultiplier(h, size), kv = h.kv_heads;
  if (m > 1) return {h.order == KvOrder::kConsecutive ? rank / m : rank % kv};
  const int64_t n = kv / size;
  std::vector<int64_t> heads;
  for (int64_t i = 0; i < n; ++i) heads.push_back(rank * n + i);
  return heads;
}

std::vector<int64_t> QueryHeadsOf(const HeadSplit& h, int64_t query_heads, int size, int rank) {
  const int64_t m = KvMultiplier(h, size), kv = h.kv_heads, n = query_heads / size;
  const int64_t block = m > 1 && h.order == KvOrder::kInterleaved ? rank % kv * m + rank / kv : rank;
  std::vector<int64_t> heads;
  for (int64_t i = 0; i < n; ++i) heads.push_back(block * n + i);
  return heads;
}

std::vector<Run> DimRuns(const ShardSpec& spec, int dim, const AxisCoords& at) {
  const int64_t extent = spec.global_shape.at(dim);
  if (!spec.dims.at(dim)) return {{0, 0, extent}};
  const DimSplit& split = *spec.dims[dim];
  const AxisPlace& place = at[split.axis];
  switch (split.kind) {
    case SplitKind::kContiguous: {
      const int64_t n = extent / place.size;
      return {{0, place.index * n, n}};
    }
    case SplitKind::kStrided: {
      const int64_t part = extent / split.parts, n = part / place.size;
      std::vector<Run> runs;
      for (int64_t k = 0; k < split.parts; ++k) runs.push_back({k * n, k * part + place.index * n, n});
      return runs;
    }
    case SplitKind::kHeads: return HeadSplitRuns(split.heads, place);
  }
  throw std::logic_error("DimRuns: unknown split kind");
}

std::vector<Box> BoxesOf(const ShardSpec& spec, const AxisCoords& at) {
  std::vector<Box> boxes{Box{}};
  for (int d = 0; d < static_cast<int>(spec.global_shape.size()); ++d) {
    // Each dimension's runs are in local order, so nesting them under the
    // boxes so far keeps the boxes in row-major local order.
    const std::vector<Run> runs = DimRuns(spec, d, at);
    std::vector<Box> next;
    for (const Box& b : boxes)
      for (const Run& r : runs) {
        Box n = b;
        n.offset.push_back(r.logical), n.size.push_back(r.count), n.local.push_back(r.local);
        next.push_back(std::move(n));
      }
    boxes = std::move(next);
  }
  return boxes;
}

std::vector<int64_t> LocalShapeOf(const ShardSpec& spec, const AxisCoords& at) {
  std::vector<int64_t> shape;
  for (int d = 0; d < static_cast<int>(spec.global_shape.size()); ++d) {
    int64_t n = 0;
    for (const Run& r : DimRuns(spec, d, at)) n += r.count;
    shape.push_back(n);
  }
  return shape;
}

int64_t FlatIndex(const std::vector<int64_t>& point, const std::vector<int64_t>& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + point[d];
  return flat;
}

void PointOf(int64_t flat, const std::vector<int64_t>& shape, std::vector<int64_t>& point) {
  point.resize(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    point[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
}

int64_t RunInBox(const std::vector<int64_t>& lo, const std::vector<int64_t>& size, const std::vector<int64_t>& shape,
                 const std::vector<int64_t>& point) {
  if (shape.empty()) return 1;
  // Dims d+1.. are whole in the box, so the run goes on to the box's end along dim d.
  size_t d = shape.size() - 1;
  while (d > 0 && size[d] == shape[d]) --d;
  int64_t inner = 1, past = 0;  // the box's elements per index of dim d; those before `point` within it
  for (size_t i = shape.size(); i-- > d + 1;) past += (point[i] - lo[i]) * inner, inner *= size[i];
  return (lo[d] + size[d] - point[d]) * inner - past;
}

void AdvanceInBox(const std::vector<int64_t>& lo, const std::vector<int64_t>& size, std::vector<int64_t>& point, int64_t n) {
  for (size_t d = size.size(); d-- > 0 && n > 0;) {
    const int64_t at = point[d] - lo[d] + n;
    point[d] = lo[d] + (d == 0 ? at : at % size[d]);
    n = d == 0 ? 0 : at / size[d];
  }
}

bool IsFirstReplica(const ShardSpec& spec, const AxisCoords& at) {
  return std::all_of(spec.replicated_over.begin(), spec.replicated_over.end(), [&](Axis a) { return at[a].index == 0; });
}

}  // namespace ckpt

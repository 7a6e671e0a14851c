// Shard specs: how one parameter's global tensor is cut over the named
// parallel axes (ckpt/spec/axes.h), and the boxes of it a rank holds. Pure
// data and arithmetic: no I/O, no model family, no file names.
//
// A spec is Megatron core's ShardedTensor without the data
// (dist_checkpointing/mapping.py: global_shape, global_offset along named
// axes, replica_id) and a box is PyTorch DCP's chunk
// (distributed/checkpoint/metadata.py ChunkStorageMetadata: offsets, sizes),
// with the offset into the rank's local tensor beside it. The model families
// (ckpt/spec/model_family.h, ckpt/spec/partition.h) declare a spec for each
// parameter; every layout question (a rank's runs, its local shape, which
// ranks hold copies) is BoxesOf of that spec and the rank's coordinates.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "ckpt/spec/axes.h"

namespace ckpt {

// How the KV heads of a head-split dimension lie over the axis's ranks when
// they are replicated (multiplier m > 1), after NxD's GQAQKVColumnParallelLinear
// (modules/qkv_linear.py _initialize_affine_weight):
//   - kConsecutive: repeat_interleave, rank r holds KV head r / m and queries
//     keep their order (NxD Trn2; shardkit's Megatron `key_value` rule);
//   - kInterleaved: repeat, rank r holds KV head r % kv_heads and the query
//     blocks are permuted to match, rank r holding block (r % kv_heads) * m +
//     r / kv_heads (NxD Trn1; scripts/checkpoint_converter.py
//     convert_full_state_to_tp).
enum class KvOrder { kConsecutive, kInterleaved };

// One region of a head-split dimension: `heads` blocks of `rows_per_head`
// indices, query heads or KV heads.
struct HeadRegion {
  int64_t heads = 0, rows_per_head = 0;
  bool kv = false;
  bool operator==(const HeadRegion&) const = default;
};

// A dimension made of head regions in order ([Q; K; V], or K alone). Every
// rank holds heads / size query heads of each query region and, of each KV
// region, kv_heads * m / size heads (one when m > 1).
struct HeadSplit {
  std::vector<HeadRegion> regions;
  int64_t kv_heads = 1;
  // The KV replication multiplier; 0: as many as the axis needs, size /
  // kv_heads when the KV heads are fewer than the ranks, else 1.
  int64_t kv_multiplier = 1;
  KvOrder order = KvOrder::kConsecutive;
  bool operator==(const HeadSplit&) const = default;
};

enum class SplitKind {
  kContiguous,  // rank i of n holds [i * e / n, (i + 1) * e / n)
  kStrided,     // `parts` equal parts ([gate; up]: 2), each split contiguously
  kHeads,       // whole heads (HeadSplit), with KV replication
};

// How one dimension is split, and over which axis.
struct DimSplit {
  Axis axis = Axis::kTp;
  SplitKind kind = SplitKind::kContiguous;
  int64_t parts = 1;  // kStrided
  HeadSplit heads = {};  // kHeads
  bool operator==(const DimSplit&) const = default;
};

struct ShardSpec {
  std::vector<int64_t> global_shape;
  // Per dimension of global_shape: the split, or nullopt when it is whole.
  std::vector<std::optional<DimSplit>> dims;
  // The replica rule: the axes whose ranks hold equal copies (Megatron's
  // replica_id is the rank's place along them). KV heads replicated by a
  // head split are the split's own, not listed here.
  std::vector<Axis> replicated_over;

  // A spec of `shape` with no dimension split.
  static ShardSpec Whole(std::vector<int64_t> shape, std::vector<Axis> replicated_over = {});
  // The spec with dimension `dim` split by `split`.
  ShardSpec& Split(int dim, DimSplit split);
  bool operator==(const ShardSpec&) const = default;
};

// One run along one dimension: `count` indices from local index `local` are
// global indices from `logical`.
struct Run {
  int64_t local, logical, count;
  bool operator==(const Run&) const = default;
};

// An N-D box of a rank's local tensor: global indices [offset, offset + size)
// per dimension, held at local indices [local, local + size).
struct Box {
  std::vector<int64_t> offset, size, local;
  bool operator==(const Box&) const = default;
};

// The runs of dimension `dim` the rank at `at` holds, in local order (one
// whole run when the dimension is not split).
std::vector<Run> DimRuns(const ShardSpec& spec, int dim, const AxisCoords& at);
// The boxes the rank at `at` holds, in local row-major order (the cartesian
// product of every dimension's runs, dimension 0 outermost). A spec with no
// dimensions (a scalar) gives one empty box.
std::vector<Box> BoxesOf(const ShardSpec& spec, const AxisCoords& at);
// The shape of the rank's local tensor.
std::vector<int64_t> LocalShapeOf(const ShardSpec& spec, const AxisCoords& at);
// Whether the rank at `at` is the first of the copies its replica rule makes
// (index 0 along every replicated axis): the one that writes the shard.
bool IsFirstReplica(const ShardSpec& spec, const AxisCoords& at);

// Box arithmetic on row-major tensors (the reshard engine walks boxes with it).
// The flat row-major index of `point` in `shape`, and the point of `flat`.
int64_t FlatIndex(const std::vector<int64_t>& point, const std::vector<int64_t>& shape);
void PointOf(int64_t flat, const std::vector<int64_t>& shape, std::vector<int64_t>& point);
// How many elements, from `point` inside the box [lo, lo + size) of a tensor
// of `shape`, follow one another both in the box's row-major order and in
// the tensor's: the run ends at the box's innermost edge unless the box spans
// the tensor's whole inner dimensions. 1 for a scalar.
int64_t RunInBox(const std::vector<int64_t>& lo, const std::vector<int64_t>& size, const std::vector<int64_t>& shape,
                 const std::vector<int64_t>& point);
// Moves `point` `n` elements on in the box's row-major order.
void AdvanceInBox(const std::vector<int64_t>& lo, const std::vector<int64_t>& size, std::vector<int64_t>& point, int64_t n);

// The KV heads, and the query heads of a region of `query_heads` heads, that
// rank `rank` of `size` holds along a head split, in local order.
std::vector<int64_t> KvHeadsOf(const HeadSplit& h, int size, int rank);
std::vector<int64_t> QueryHeadsOf(const HeadSplit& h, int64_t query_heads, int size, int rank);

}  // namespace ckpt

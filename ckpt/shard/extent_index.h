// ExtentIndex: where each box of each logical tensor lies in a tag's mapped
// rank files (the tag reader's third part; the others find the files,
// ckpt/shard/tag_files.h, describe the model, ckpt/shard/model_description.h,
// and read the optimizer files, ckpt/shard/tag_optimizer.h). Generic over
// model families: it knows a parameter's shard spec (ckpt/spec/shard_spec.h)
// and the rank's place on the axes, never a name.
//
// A reader adds each local tensor's boxes (AddBoxes: BoxesOf the spec at the
// rank's coordinates, cut to a ZeRO-1 shard's rows), one entry per box, so
// the index grows with the boxes and never with a tensor's width or rows
// (PyTorch DCP's planner keeps chunk metadata the same way). A box several
// ranks hold (norms, KV heads NxD replicates) is indexed from its first
// holder; the other copies are kept and CompareReplicas requires them equal,
// byte for byte. CheckCovered then requires the boxes disjoint and their
// volumes to sum to the tensor's. Read copies any flat range of a logical
// tensor without assembling it: each point is found in its box (a binary
// search on dim 0, then the few boxes of that slab) and copied as contiguous
// innermost runs.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/util/open_file_cache.h"

namespace ckpt {

// A box of a logical tensor that one rank's local tensor holds: global
// elements [offset, offset + size) per dimension (ckpt/spec/shard_spec.h Box),
// stored from `data` (global element `offset`) with `strides` (elements, per
// dimension: a transposed o_proj's are not row-major) in `file`.
struct SourceBox {
  std::vector<int64_t> offset, size, strides;
  const uint8_t* data;
  const MappedFile* file;
};

// `v` as a tensor the index can read: contiguous, or a strided 1-D or 2-D
// view (NxD's converter saves o_proj transposed). Throws naming `where`.
const Tensor& IndexableTensor(const Value& v, const std::string& where);
// Whether two contiguous tensors hold the same dtype, shape and bytes (a tied copy against its original).
bool SameBytes(const Tensor& a, const Tensor& b);

class ExtentIndex {
 public:
  // The first rank holding each (tensor, field, box offset): one map per
  // kind of file (model files, optimizer files), as each is read in turn.
  using Holders = std::map<std::tuple<std::string, StateField, std::vector<int64_t>>, int>;

  // Indexes the boxes of the local tensor `x` of the rank at `at` (its tp
  // index names it in Holders and messages) whose local rows [row_lo, row_hi)
  // `x` holds (ZeRO-1: one dp shard of them, whose row 0 is row_lo; rows past
  // the local tensor's are padding). `x` may be strided (a transposed o_proj).
  // Throws naming `where` when `dtype` differs from what other ranks hold.
  void AddBoxes(const ParamRule& rule, const AxisCoords& at, StateField field, const Tensor& x, const MappedFile* file, int64_t row_lo,
                int64_t row_hi, Holders& owner, DType dtype, const std::string& where);
  // The number a rank at `at` has in Holders: its tp index, plus its ep
  // index times the tp size (replicas over ep, the non-expert tensors of an
  // expert-parallel tag, are compared as replicas over tp are).
  static int HolderId(const AxisCoords& at) { return at[Axis::kEp].index * at[Axis::kTp].size + at[Axis::kTp].index; }
  // Requires each tensor's boxes disjoint and covering its logical elements
  // (`params`' shapes) without a gap, and builds the lookup Read uses; throws
  // naming `dir` and the first elements not held (or held twice).
  void CheckCovered(const std::string& dir, const std::vector<ParamRule>& params);
  // Every replica equals its first holder's copy (see the .cc); throws naming
  // `dir`, the tensor, both tp ranks and the elements. `format` names the KV rule.
  void CompareReplicas(const std::string& dir, const ModelFormat& format) const;

  bool Has(const std::string& name, StateField f) const { return index_.count({name, f}) > 0; }
  // The dtype of `name`'s `f`; false when not indexed.
  bool FindDType(const std::string& name, StateField f, DType* dtype) const;
  // The boxes indexed for `name`'s `f` (replicas not counted): what the index's size grows with.
  size_t BoxCount(const std::string& name, StateField f) const;
  // As LogicalState::Read: elements the index does not hold read as zero.
  // Thread-safe once CheckCovered has built the lookup.
  void Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const;
  // Read (and CompareReplicas) then read the bytes of mapped files
  // (MappedFile::mapped) with pread through `env`, not out of the mapping.
  void ReadThrough(Env* env) { reads_ = std::make_shared<OpenFileCache>(env); }

  struct Entry {
    DType dtype = DType::kFloat32;
    bool typed = false;
    std::vector<int64_t> shape;  // the logical tensor's
    std::vector<SourceBox> boxes;
    // The lookup (CheckCovered): slab i holds dim-0 indices [cuts[i],
    // cuts[i + 1]), and in_slab[i] the boxes meeting it.
    std::vector<int64_t> cuts;
    std::vector<std::vector<uint32_t>> in_slab;
  };

 private:
  std::shared_ptr<OpenFileCache> reads_;  // ReadThrough's; null: copies out of the mappings
  struct Key {
    std::string name;
    StateField field;
    bool operator<(const Key& o) const { return name != o.name ? name < o.name : field < o.field; }
  };
  struct Replica {
    std::string name;
    StateField field;
    SourceBox box;
    int holder, rank;  // HolderId of the first holder and of this copy
    int tp;            // the tp size, which HolderId folds in
  };
  std::map<Key, Entry> index_;
  std::vector<Replica> replicas_;
};

}  // namespace ckpt

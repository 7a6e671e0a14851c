// ExtentIndex: where each run of each logical tensor's elements lies in a
// tag's mapped rank files (the tag reader's third part; the others find the
// files, ckpt/shard/tag_files.h, describe the model,
// ckpt/shard/model_description.h, and read the optimizer files,
// ckpt/shard/tag_optimizer.h). Generic over model families: it knows a
// parameter's rule (ckpt/shard/partition.h) and the tp degree, never a name.
//
// A reader adds each local tensor's rows (AddRuns). A run of logical elements
// several tp ranks hold (norms, KV heads NxD replicates) is indexed from its
// first holder; the other copies are kept and CompareReplicas requires them
// equal, byte for byte. CheckCovered then requires every logical element
// held exactly once. Read copies any range of a logical tensor without
// assembling it.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "ckpt/shard/logical_state.h"

namespace ckpt {

// A run of logical elements [begin, end) of one tensor, in one mapped file.
struct TensorExtent {
  uint64_t begin, end;  // logical elements
  const uint8_t* data;  // element `begin`
  const MappedFile* file;
  int64_t stride = 1;  // elements between consecutive logical elements in storage (a transposed tensor's rows)
  // Copies `n` elements of `es` bytes from this extent's element `from` into `out`.
  void CopyOut(uint64_t from, uint64_t n, size_t es, uint8_t* out, Touched* touched) const;
};

// `v` as a tensor the index can read: contiguous, or a strided 1-D or 2-D
// view (NxD's converter saves o_proj transposed). Throws naming `where`.
const Tensor& IndexableTensor(const Value& v, const std::string& where);
// Whether two contiguous tensors hold the same dtype, shape and bytes (a tied copy against its original).
bool SameBytes(const Tensor& a, const Tensor& b);

class ExtentIndex {
 public:
  // The first tp rank holding each (tensor, field, logical run): one map per
  // kind of file (model files, optimizer files), as each is read in turn.
  using Holders = std::map<std::tuple<std::string, StateField, int64_t>, int>;

  // Indexes a local tensor's rows [row_lo, row_hi) held by `x` (ZeRO-1: one
  // dp shard of them, whose row 0 is row_lo); `rows` is the local tensor's
  // dim 0. A strided `x` (a transposed o_proj) is indexed a row at a time,
  // each extent stepping through storage by its column stride. Throws naming
  // `where` when `dtype` differs from what other ranks hold.
  void AddRuns(const ParamRule& rule, const ModelFormat& format, int tp, StateField field, int t, const Tensor& x, const MappedFile* file,
               int64_t row_lo, int64_t row_hi, int64_t rows, Holders& owner, DType dtype, const std::string& where);
  // Sorts each tensor's extents and requires them to cover its logical
  // elements (`params`' shapes) without a gap; throws naming `dir`.
  void CheckCovered(const std::string& dir, const std::vector<ParamRule>& params);
  // Every replica equals its first holder's copy (see the .cc); throws naming
  // `dir`, the tensor, both tp ranks and the elements. `format` names the KV rule.
  void CompareReplicas(const std::string& dir, const ModelFormat& format) const;

  bool Has(const std::string& name, StateField f) const { return index_.count({name, f}) > 0; }
  // The dtype of `name`'s `f`; false when not indexed.
  bool FindDType(const std::string& name, StateField f, DType* dtype) const;
  // As LogicalState::Read: elements the index does not hold read as zero. Thread-safe.
  void Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const;

 private:
  struct Entry {
    DType dtype = DType::kFloat32;
    bool typed = false;
    std::vector<TensorExtent> extents;  // sorted, disjoint (after CheckCovered)
  };
  struct Key {
    std::string name;
    StateField field;
    bool operator<(const Key& o) const { return name != o.name ? name < o.name : field < o.field; }
  };
  struct Replica {
    std::string name;
    StateField field;
    TensorExtent extent;
    int holder, rank;
  };
  std::map<Key, Entry> index_;
  std::vector<Replica> replicas_;
};

}  // namespace ckpt

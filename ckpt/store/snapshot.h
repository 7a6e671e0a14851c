// Taking a snapshot of training state for an async save: a copy whose
// tensors own their bytes, made with a parallel memcpy. With a SnapshotPool,
// the copy lands in buffers recycled from earlier snapshots (already faulted
// in), so a snapshot costs a memcpy and not a page fault per 4 KiB; a buffer
// returns to the pool when the save that held it has finished with it.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "ckpt/pt/value.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/tag_writer.h"

namespace ckpt {

// One rank's part of a save, taken for the checkpoint store
// (CheckpointStore::Save): the tag it belongs to and this rank's files,
// whose tensors a sync save may share with training and an async one copies
// (CopyForSnapshot).
struct Snapshot {
  TagName tag;
  RankGrid grid;
  std::vector<FileToWrite> files;  // this rank's files
};

// Which tensors a snapshot copies (see CopyForSnapshot); empty: all.
using TensorFilter = std::function<bool(size_t)>;

// The pool snapshots take their buffers from (StoragePool), able to reserve
// them ahead of the first snapshot.
class SnapshotPool final : public StoragePool {
 public:
  static std::shared_ptr<SnapshotPool> Create() { return std::shared_ptr<SnapshotPool>(new SnapshotPool()); }
  // Allocates and touches a buffer for every tensor in `like` (converted to
  // `floats_to` as CopyForSnapshot would), so even the first snapshot is a
  // memcpy (call at start-up, as with pinned buffers).
  // With `copies`, only for the tensors CopyForSnapshot would copy.
  void Reserve(const Value& like, std::optional<DType> floats_to = std::nullopt, const TensorFilter& copies = {});

 private:
  SnapshotPool() = default;
};

// A copy of `v` whose tensors own their bytes (containers copied, tensors
// copied in parallel), safe to hand to an async save while training goes on.
// Storages come from `pool` when given. With `floats_to`, float32, float64
// and bfloat16 tensors are converted to it while copying (dtype_cast.h): a
// mixed-precision trainer computes in float32 and saves bfloat16.
// With `copies`, only the tensors for which copies(i) holds (i counts the
// tensors depth first, containers in order: the order of xser's tids) are
// copied; each other one becomes a placeholder of its snapshot dtype and
// shape that holds no bytes and must never be written (another rank writes
// it: XserFilesOfBin).
Value CopyForSnapshot(const Value& v, SnapshotPool* pool = nullptr, std::optional<DType> floats_to = std::nullopt,
                      const TensorFilter& copies = {});
// The bytes of each tensor of `v` in that order, as CopyForSnapshot stores it.
std::vector<uint64_t> SnapshotTensorBytes(const Value& v, std::optional<DType> floats_to = std::nullopt);

}  // namespace ckpt

// Pickle encodes a Value tree as a protocol-2 pickle the way torch.save does:
// tensors as torch._utils._rebuild_tensor_v2 over persistent storage ids
// ('storage', torch.<T>Storage, key, 'cpu', numel), keys numbered from 0 in
// order of first use, so tensors sharing a storage still share it after
// torch.load. Containers referenced twice are memoised and stay shared.
// Opaque objects are written back as they were read.
//
// Weights-only mode emits only what torch 1.13's weights_only=True loader
// accepts (OrderedDict, torch.Size, storage classes, _rebuild_tensor_v2,
// _rebuild_parameter, and no BINFLOAT), and throws ckpt::Error naming the
// key path of anything it cannot express that way.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ckpt/pt/value.h"

namespace ckpt {

struct PickleOptions {
  bool weights_only = false;
  // After copying a storage that is a record of a mapped archive, drop its
  // pages from memory (MappedFile::DropPages): converters streaming large
  // inputs keep their memory bounded by this.
  bool drop_source_pages = false;
  // Generated storages (Storage::Generated) are produced and written this
  // many bytes at a time: the file's memory cost whatever its size.
  size_t stream_chunk = 8 << 20;
  // Where those chunks come from; null: a fresh allocation per file. A writer
  // of many files (an xser tag holds one per tensor) passes one pool to all,
  // so each chunk is faulted in once and not once per file.
  std::shared_ptr<StoragePool> stream_buffers = nullptr;
};

struct PickledStorage {
  std::string key;  // record name under data/
  std::shared_ptr<Storage> storage;
};

// Returns the pickle bytes; `storages` receives each distinct storage in key order.
std::string Pickle(const Value& root, const PickleOptions& opts, std::vector<PickledStorage>* storages);

}  // namespace ckpt

// Pickle encodes a Value tree as a protocol-2 pickle the way torch.save does:
// tensors as torch._utils._rebuild_tensor_v2 over persistent storage ids
// ('storage', torch.<T>Storage, key, 'cpu', numel), keys numbered from 0 in
// order of first use, so tensors sharing a storage still share it after
// torch.load. Containers referenced twice are memoised and stay shared.
// Objects of the classes below are written back as they were read.
//
// Nothing is written that runs code on load: every global a pickle names is
// one torch 2's torch.load(weights_only=True) resolves (TorchLoadableGlobal),
// or xser's TensorReference, and every opcode is one its unpickler executes
// (no LONG4, no NEWOBJ_EX, no APPENDS or SETITEMS onto an object). Anything
// else (an os.system call, an omegaconf config, a Lightning AttributeDict)
// throws ckpt::Error naming its key path: content read from a checkpoint is
// made plain first (PlainCheckpointData, ckpt/pt/plain_data.h).
//
// Weights-only mode is stricter still: it emits only what torch 1.13's
// weights_only=True loader accepts (OrderedDict, torch.Size, storage classes,
// _rebuild_tensor_v2, _rebuild_parameter, and no BINFLOAT), and throws
// ckpt::Error naming the key path of anything it cannot express that way.
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

// Throws the ckpt::Error Pickle(root, {}) would throw, writing nothing; its
// message starts with `where` and names the key path of what is refused.
void CheckPicklable(const Value& root, const std::string& where);

// Whether torch 2's weights-only unpickler resolves the global `g`: pytorch
// torch/_weights_only_unpickler.py _get_allowed_globals (OrderedDict,
// Counter, torch.Size, torch.Tensor, torch.device, Parameter, _get_layout,
// the dtypes, the storage classes, the quantization schemes, the
// torch._utils._rebuild_* functions and torch._tensor._rebuild_from_type_v2,
// _codecs.encode, bytearray, set, complex), with Python 2 module names
// (__builtin__) read as its _read_global_instruction maps them. Only names a
// Value can hold are listed; torch's own tensor classes (torch.FloatTensor)
// and newer dtypes are not, so this is a subset of torch's list.
bool TorchLoadableGlobal(const Global& g);

// xser's reference class, which our xser writer emits (MakeTensorReference)
// and NxD's xser loader resolves (torch_xla.utils.serialization).
bool IsXserReferenceClass(const Global& g);

}  // namespace ckpt

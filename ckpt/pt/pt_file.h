// Reading and writing PyTorch .pt files with no Python.
//
// LoadPt accepts torch's zip format (any torch since 1.6, any archive prefix,
// aligned or not) and the legacy pre-zip format. Tensor bytes are not copied:
// tensors borrow from the file's read-only mapping, which they keep alive.
//
// SavePt writes what torch.save writes: a zip of STORED records under the
// file stem, data.pkl (protocol 2), one data/<key> record per distinct
// storage at a 64-byte-aligned offset, byteorder and version. The write is
// atomic (temporary sibling, fsync, rename, directory fsync).
#pragma once

#include <memory>
#include <string>

#include "ckpt/util/env.h"
#include "ckpt/pt/pickle_writer.h"
#include "ckpt/pt/value.h"

namespace ckpt {

struct LoadOptions {
  // Recompute every record's CRC-32 (touches every byte).
  bool verify_crc = false;
  // When set, every file read (an xser file's tensor files too) must resolve
  // inside this folder; one that does not is refused, never read.
  std::string confine_to;
};

Value LoadPt(const std::string& path, const LoadOptions& opts = {}, Env* env = Env::Default());
// The same, from an already mapped (or in-memory) file.
Value LoadPtFromFile(std::shared_ptr<const MappedFile> file, const LoadOptions& opts = {});

using SaveOptions = PickleOptions;

void SavePt(const std::string& path, const Value& root, const SaveOptions& opts = {}, Env* env = Env::Default());
// Writes the archive to an open file (no atomic rename); `prefix` is the
// archive folder. Returns the CRC-32 of the bytes written.
uint32_t WritePt(WritableFile& out, const std::string& prefix, const Value& root, const SaveOptions& opts = {});

// torch's archive folder name for a path: the basename without its last extension.
std::string ArchivePrefixFor(const std::string& path);

}  // namespace ckpt

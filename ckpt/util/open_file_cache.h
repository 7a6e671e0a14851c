// OpenFileCache reads byte ranges of many files by path with pread
// (Env::NewRandomAccessFile), keeping the most recently used files open: a
// Trn1 tp 32 xser tag has 6,304 files, beyond the usual limit of 1,024
// descriptors, so at most `capacity` are open at once and the least recently
// used is closed first. A read in flight keeps its file open even once it is
// evicted. Thread-safe.
//
// A read with pread copies straight into the caller's buffer: no mapping, so
// none of the page faults, madvise(MADV_DONTNEED) and munmap calls a mapped
// read costs, each of the latter two flushing the TLB of every core running
// the process (the HF import's profile: 42% of its samples).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>

#include "ckpt/util/env.h"

namespace ckpt {

class OpenFileCache {
 public:
  static constexpr size_t kDefaultCapacity = 256;
  explicit OpenFileCache(Env* env, size_t capacity = kDefaultCapacity);

  // Reads [offset, offset + out.size()) of `path` into `out`. Throws
  // ckpt::Error naming the file when it cannot be opened or read, or ends first.
  void ReadAt(const std::string& path, uint64_t offset, std::span<uint8_t> out);

  // Files open now (at most the capacity).
  size_t open_files() const;

 private:
  std::shared_ptr<const RandomAccessFile> Open(const std::string& path);

  Env* env_;
  size_t capacity_;
  mutable std::mutex mu_;
  std::list<std::string> recent_;  // most recently used first
  struct Entry {
    std::shared_ptr<const RandomAccessFile> file;
    std::list<std::string>::iterator at;
  };
  std::unordered_map<std::string, Entry> open_;
};

}  // namespace ckpt

// ReadFold records, per file, the CRC-32 of the byte ranges a job read, so a
// check of the files against their recorded CRC-32s (a source tag's manifest)
// reads only the ranges the job did not: the check is folded into the reads
// the job does anyway instead of being a second pass over every byte.
//
// FoldingEnv is the Env decorator that feeds it: every RandomAccessFile::ReadAt
// (OpenFileCache, the extent index's reads) and every file MapFile returns as
// memory rather than a mapping (small files, read whole) is recorded. Bytes
// read through a mapping (a pickle parsed in place) are not: they are gaps.
//
// Memory stays small: adjacent ranges merge into one run as they come
// (Crc32Combine), a range overlapping what is recorded adds only its new
// parts, and past kMaxRuns runs in all a new range is not recorded (it is a
// gap the check reads, so it costs reads, never correctness). Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>

#include "ckpt/util/env.h"

namespace ckpt {

class ReadFold {
 public:
  static constexpr size_t kMaxRuns = size_t{1} << 20;  // ~64 MiB of map nodes at most

  // The key a file is recorded under: `path` made lexically normal, so "a//b" and "a/./b" agree.
  static std::string Key(const std::string& path);

  // Records bytes [offset, offset + bytes.size()) of the file keyed `key`.
  void Add(const std::string& key, uint64_t offset, std::span<const uint8_t> bytes);

  // The runs recorded, for another process (Merge): one line per run.
  std::string Encode() const;
  // Adds the runs another process recorded (Encode); a run overlapping one
  // recorded here is left out (a gap). Throws ckpt::Error on a malformed text.
  void Merge(const std::string& encoded);

  // The CRC-32 of the first `size` bytes of `path`: the recorded runs,
  // and the gaps between them read through `env` (4 MiB at a time), combined
  // in file order. What DigestFile computes for a file of `size` bytes, with
  // only the gaps read. Throws ckpt::Error naming the file when a read fails.
  uint32_t Crc(Env* env, const std::string& path, uint64_t size) const;

  // Bytes recorded (tests, reports).
  uint64_t bytes() const;
  size_t runs() const;

 private:
  struct Run {
    uint64_t len;
    uint32_t crc;
  };
  using Runs = std::map<uint64_t, Run>;  // by offset; never overlapping
  // Under mu_: adds a run unless it overlaps one, merging it with its neighbours.
  void Insert(Runs& runs, uint64_t offset, uint64_t len, uint32_t crc);

  mutable std::mutex mu_;
  std::unordered_map<std::string, Runs> files_;
  size_t runs_ = 0;
  uint64_t bytes_ = 0;
};

// An Env that forwards to `base` and records into `fold` what is read
// (see above). Both must outlive it and the files it opens.
class FoldingEnv final : public Env {
 public:
  FoldingEnv(Env* base, ReadFold* fold) : base_(base), fold_(fold) {}

  std::unique_ptr<WritableFile> NewWritableFile(const std::string& p) override { return base_->NewWritableFile(p); }
  std::unique_ptr<WritableFile> NewAppendableFile(const std::string& p) override { return base_->NewAppendableFile(p); }
  std::shared_ptr<const MappedFile> MapFile(const std::string& path) override;
  std::unique_ptr<RandomAccessFile> NewRandomAccessFile(const std::string& path) override;
  uint64_t ReadInPieces(const std::string& p, std::span<uint8_t> buf, const std::function<void(std::span<const uint8_t>)>& piece) override {
    return base_->ReadInPieces(p, buf, piece);
  }
  void RenameFile(const std::string& from, const std::string& to) override { base_->RenameFile(from, to); }
  void SyncDir(const std::string& d) override { base_->SyncDir(d); }
  void SyncFileSystem(const std::string& d) override { base_->SyncFileSystem(d); }
  void RemoveFile(const std::string& p) override { base_->RemoveFile(p); }
  void RemoveAll(const std::string& p) override { base_->RemoveAll(p); }
  void CreateDirs(const std::string& p) override { base_->CreateDirs(p); }
  bool Exists(const std::string& p) override { return base_->Exists(p); }
  bool IsDirectory(const std::string& p) override { return base_->IsDirectory(p); }
  std::vector<std::string> ListDir(const std::string& p) override { return base_->ListDir(p); }
  uint64_t FileSize(const std::string& p) override { return base_->FileSize(p); }
  int64_t FileMTimeNs(const std::string& p) override { return base_->FileMTimeNs(p); }
  uint64_t AvailableBytes(const std::string& d) override { return base_->AvailableBytes(d); }
  std::unique_ptr<FileLock> LockFile(const std::string& p, bool exclusive, bool wait) override { return base_->LockFile(p, exclusive, wait); }

 private:
  Env* base_;
  ReadFold* fold_;
};

}  // namespace ckpt

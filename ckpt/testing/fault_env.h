// FaultEnv wraps an Env and injects the failures checkpoint code must survive:
// ENOSPC after a byte budget, a short write, a failing fsync or rename, or a
// crash (SIGKILL of the process) at the Nth mutating operation. It also logs
// every durability-relevant event (file fsync, rename, directory fsync,
// directory creation) so tests can check the order a commit makes things
// durable in, and every folder listed and file mapped, so tests can check
// that nothing outside an input folder is read. For tests.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>
#include <string>

#include "ckpt/util/env.h"

namespace ckpt {

class FaultEnv : public Env {
 public:
  explicit FaultEnv(Env* base) : base_(base) {}

  // Appends fail with ENOSPC once this many bytes were written in total.
  void FailWritesAfter(int64_t bytes) { enospc_after_ = bytes; }
  // The append that crosses this many bytes writes only part and then fails.
  void ShortWriteAt(int64_t bytes) { short_at_ = bytes; }
  // Counted from the call: the Nth fsync (file or directory) fails with EIO.
  void FailSyncAt(int64_t n) { fail_sync_at_ = syncs_ + n; }
  // Counted from the call: the Nth rename fails with EIO.
  void FailRenameAt(int64_t n) { fail_rename_at_ = renames_ + n; }
  // Counted from the call: the Nth mutating operation (append, sync, rename,
  // remove, create) kills the process.
  void CrashAt(int64_t n) { crash_at_ = ops_ + n; }
  // Counted from the call: the Nth RandomAccessFile::ReadAt fails with EIO.
  void FailReadAt(int64_t n) { fail_read_at_ = reads_at_ + n; }

  struct Event {
    enum Kind { kSyncFile, kRename, kSyncDir, kCreateDirs, kSyncFileSystem } kind;
    std::string path, to;  // to: rename target
  };
  std::vector<Event> events() const {
    std::lock_guard<std::mutex> l(mu_);
    return events_;
  }

  // Every folder listed and file mapped or opened for reading, in order.
  std::vector<std::string> reads() const {
    std::lock_guard<std::mutex> l(mu_);
    return reads_;
  }

  int64_t bytes_written() const { return written_; }
  // RandomAccessFile::ReadAt calls so far (preads).
  int64_t reads_at() const { return reads_at_; }
  int64_t mutating_ops() const { return ops_; }

  std::unique_ptr<WritableFile> NewWritableFile(const std::string& path) override;
  std::unique_ptr<WritableFile> NewAppendableFile(const std::string& path) override;
  std::shared_ptr<const MappedFile> MapFile(const std::string& path) override {
    LogRead(path);
    return base_->MapFile(path);
  }
  std::unique_ptr<RandomAccessFile> NewRandomAccessFile(const std::string& path) override;
  uint64_t ReadInPieces(const std::string& path, std::span<uint8_t> buf,
                        const std::function<void(std::span<const uint8_t>)>& piece) override {
    LogRead(path);
    return base_->ReadInPieces(path, buf, piece);
  }
  void RenameFile(const std::string& from, const std::string& to) override;
  void SyncDir(const std::string& dir) override;
  void SyncFileSystem(const std::string& dir) override;
  void RemoveFile(const std::string& path) override;
  void RemoveAll(const std::string& path) override;
  void CreateDirs(const std::string& path) override;
  bool Exists(const std::string& path) override { return base_->Exists(path); }
  bool IsDirectory(const std::string& path) override { return base_->IsDirectory(path); }
  std::vector<std::string> ListDir(const std::string& path) override {
    LogRead(path);
    return base_->ListDir(path);
  }
  uint64_t FileSize(const std::string& path) override { return base_->FileSize(path); }
  int64_t FileMTimeNs(const std::string& path) override { return base_->FileMTimeNs(path); }
  uint64_t AvailableBytes(const std::string& dir) override { return base_->AvailableBytes(dir); }
  std::unique_ptr<FileLock> LockFile(const std::string& path, bool exclusive, bool wait) override {
    return base_->LockFile(path, exclusive, wait);
  }

 private:
  friend class FaultFile;
  friend class FaultRandomAccessFile;
  void Op();
  void Sync(const std::string& what, Event::Kind kind);
  void Log(Event e) {
    std::lock_guard<std::mutex> l(mu_);
    events_.push_back(std::move(e));
  }
  void LogRead(const std::string& path) {
    std::lock_guard<std::mutex> l(mu_);
    reads_.push_back(path);
  }
  mutable std::mutex mu_;
  std::vector<Event> events_;
  std::vector<std::string> reads_;

  Env* base_;
  std::atomic<int64_t> written_{0}, ops_{0}, syncs_{0}, renames_{0}, reads_at_{0};
  int64_t enospc_after_ = -1, short_at_ = -1, fail_sync_at_ = -1, fail_rename_at_ = -1, crash_at_ = -1, fail_read_at_ = -1;
};

}  // namespace ckpt

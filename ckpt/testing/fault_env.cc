#include "ckpt/testing/fault_env.h"

#include <signal.h>
#include <unistd.h>

#include "ckpt/util/error.h"

namespace ckpt {

void FaultEnv::Op() {
  if (++ops_ == crash_at_) ::kill(::getpid(), SIGKILL);
}

void FaultEnv::Sync(const std::string& what, Event::Kind kind) {
  Op();
  if (++syncs_ == fail_sync_at_) throw Error(what + ": fsync failed: Input/output error (injected)");
  Log({kind, what, ""});
}

class FaultFile final : public WritableFile {
 public:
  FaultFile(FaultEnv* env, std::string path, std::unique_ptr<WritableFile> base)
      : env_(env), path_(std::move(path)), base_(std::move(base)) {}
  void Append(std::span<const uint8_t> d) override {
    env_->Op();
    const int64_t before = env_->written_;
    if (env_->enospc_after_ >= 0 && before + static_cast<int64_t>(d.size()) > env_->enospc_after_)
      throw Error(path_ + ": write failed: No space left on device (injected)");
    if (env_->short_at_ >= 0 && before <= env_->short_at_ && before + static_cast<int64_t>(d.size()) > env_->short_at_) {
      const size_t part = static_cast<size_t>(env_->short_at_ - before);
      base_->Append(d.first(part));
      env_->written_ += part;
      throw Error(path_ + ": short write: " + std::to_string(part) + " of " + std::to_string(d.size()) + " bytes (injected)");
    }
    base_->Append(d);
    env_->written_ += d.size();
  }
  void Flush() override { base_->Flush(); }
  void Sync() override {
    base_->Sync();
    env_->Sync(path_, FaultEnv::Event::kSyncFile);
  }
  void Close() override { base_->Close(); }
  uint64_t Size() const override { return base_->Size(); }
  void WriteAt(uint64_t offset, std::span<const uint8_t> d) override {
    env_->Op();
    base_->WriteAt(offset, d);
  }

 private:
  FaultEnv* env_;
  std::string path_;
  std::unique_ptr<WritableFile> base_;
};

class FaultRandomAccessFile final : public RandomAccessFile {
 public:
  FaultRandomAccessFile(FaultEnv* env, std::unique_ptr<RandomAccessFile> base) : env_(env), base_(std::move(base)) {}
  void ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
    if (++env_->reads_at_ == env_->fail_read_at_) throw Error(path() + ": read failed: Input/output error (injected)");
    base_->ReadAt(offset, out);
  }
  const std::string& path() const override { return base_->path(); }

 private:
  FaultEnv* env_;
  std::unique_ptr<RandomAccessFile> base_;
};

std::unique_ptr<RandomAccessFile> FaultEnv::NewRandomAccessFile(const std::string& path) {
  LogRead(path);
  return std::make_unique<FaultRandomAccessFile>(this, base_->NewRandomAccessFile(path));
}

std::unique_ptr<WritableFile> FaultEnv::NewWritableFile(const std::string& path) {
  Op();
  return std::make_unique<FaultFile>(this, path, base_->NewWritableFile(path));
}

std::unique_ptr<WritableFile> FaultEnv::NewAppendableFile(const std::string& path) {
  Op();
  return std::make_unique<FaultFile>(this, path, base_->NewAppendableFile(path));
}

void FaultEnv::RenameFile(const std::string& from, const std::string& to) {
  Op();
  if (++renames_ == fail_rename_at_) throw Error(from + ": cannot rename to " + to + ": Input/output error (injected)");
  base_->RenameFile(from, to);
  Log({Event::kRename, from, to});
}

void FaultEnv::SyncDir(const std::string& dir) {
  base_->SyncDir(dir);
  Sync(dir, Event::kSyncDir);
}

void FaultEnv::SyncFileSystem(const std::string& dir) {
  base_->SyncFileSystem(dir);
  Sync(dir, Event::kSyncFileSystem);
}

void FaultEnv::RemoveFile(const std::string& path) {
  Op();
  base_->RemoveFile(path);
}

void FaultEnv::RemoveAll(const std::string& path) {
  Op();
  base_->RemoveAll(path);
}

void FaultEnv::CreateDirs(const std::string& path) {
  Op();
  base_->CreateDirs(path);
  Log({Event::kCreateDirs, path, ""});
}

}  // namespace ckpt

// The POSIX Env: buffered appends, mmap for reads (pread for small files and random access),
// fsync for durability.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "ckpt/util/env.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void ThrowErrno(const std::string& path, const char* what, int err = errno) {
  throw Error(path + ": " + what + ": " + std::strerror(err));
}

// Appends go through a 1 MiB buffer and pwrite at a tracked offset. Large
// appends whose memory and file offset are page aligned (the zip writer puts
// big records on pages; Storage allocates on pages) go through a second
// O_DIRECT descriptor instead: the device DMAs from our memory, so writing a
// checkpoint costs no page-cache copy, which is most of the CPU a buffered
// write takes and what would otherwise slow a training loop during an async
// save. File systems without O_DIRECT (tmpfs) fall back to buffered writes.
class PosixWritableFile final : public WritableFile {
 public:
  // `offset`: where appending starts (the size of the file kept, or 0).
  PosixWritableFile(std::string path, int fd, uint64_t offset = 0) : path_(std::move(path)), fd_(fd), offset_(offset) {
    buf_.reserve(kBuf);
  }
  ~PosixWritableFile() override {
    if (dfd_ >= 0) ::close(dfd_);
    if (fd_ >= 0) ::close(fd_);
  }

  void Append(std::span<const uint8_t> data) override {
    if (buf_.size() + data.size() <= kBuf) {
      buf_.insert(buf_.end(), data.begin(), data.end());
      return;
    }
    Flush();
    if (data.size() >= kDirectMin && TryDirect(data)) return;
    if (data.size() >= kBuf) WriteBuffered(data);  // large: straight from the caller's memory
    else buf_.assign(data.begin(), data.end());
  }

  void Sync() override {
    Flush();
    if (::fdatasync(fd_) != 0) ThrowErrno(path_, "fsync failed");
  }

  void Close() override {
    if (fd_ < 0) return;
    Flush();
    if (dfd_ >= 0) ::close(dfd_), dfd_ = -1;
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) ThrowErrno(path_, "close failed");
  }

  uint64_t Size() const override { return offset_ + buf_.size(); }

  void WriteAt(uint64_t offset, std::span<const uint8_t> data) override {
    if (offset + data.size() > Size()) throw Error(path_ + ": WriteAt past the end of what was written");
    // The part still in the buffer is patched there; the rest goes through
    // the buffered descriptor (never O_DIRECT, which needs whole pages).
    const size_t flushed = offset < offset_ ? static_cast<size_t>(std::min<uint64_t>(offset_ - offset, data.size())) : 0;
    for (size_t done = 0; done < flushed;) {
      ssize_t w = ::pwrite(fd_, data.data() + done, flushed - done, static_cast<off_t>(offset + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) ThrowErrno(path_, "write failed");
      done += static_cast<size_t>(w);
    }
    if (flushed < data.size()) std::memcpy(buf_.data() + (offset + flushed - offset_), data.data() + flushed, data.size() - flushed);
  }

 private:
  static constexpr size_t kBuf = 1 << 20;
  static constexpr uint64_t kSyncEvery = 32 << 20;
  static constexpr size_t kPage = 4096;
  static constexpr size_t kDirectMin = 1 << 20;

  void Flush() override {
    if (buf_.empty()) return;
    WriteBuffered(buf_);
    buf_.clear();
  }

  // pwrites all of [p, p+n) at offset_ through `fd`, advancing offset_.
  // Returns errno on failure before anything was written, else 0.
  int PwriteAll(int fd, const uint8_t* p, size_t n, bool einval_ok) {
    const uint64_t start = offset_;
    while (n > 0) {
      ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, kSyncEvery), static_cast<off_t>(offset_));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno == EINVAL && einval_ok && offset_ == start) return EINVAL;
      if (w < 0) ThrowErrno(path_, "write failed");
      if (w == 0) throw Error(path_ + ": write failed: no progress");
      p += w;
      n -= static_cast<size_t>(w);
      offset_ += static_cast<uint64_t>(w);
    }
    return 0;
  }

  void WriteBuffered(std::span<const uint8_t> data) {
    PwriteAll(fd_, data.data(), data.size(), false);
    buffered_ += data.size();
    // Start writeback of what accumulated (no waiting), so the disk works while
    // we copy more and the final fdatasync has little left.
    if (buffered_ - queued_ >= kSyncEvery) {
      ::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
      queued_ = buffered_;
    }
  }

  // Writes the page-aligned bulk of `data` with O_DIRECT and the tail
  // buffered. Returns false (nothing written) when not applicable.
  bool TryDirect(std::span<const uint8_t> data) {
    if (direct_failed_ || offset_ % kPage || reinterpret_cast<uintptr_t>(data.data()) % kPage) return false;
    if (dfd_ < 0) {
      dfd_ = ::open(path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
      if (dfd_ < 0) {
        direct_failed_ = true;
        return false;
      }
    }
    const size_t bulk = data.size() / kPage * kPage;
    if (PwriteAll(dfd_, data.data(), bulk, /*einval_ok=*/true) == EINVAL) {  // not supported here after all
      direct_failed_ = true;
      return false;
    }
    if (bulk < data.size()) WriteBuffered(data.subspan(bulk));
    return true;
  }

  std::string path_;
  int fd_, dfd_ = -1;
  bool direct_failed_ = false;
  std::vector<uint8_t> buf_;
  uint64_t offset_ = 0;                 // bytes written to the file; buf_ follows
  uint64_t buffered_ = 0, queued_ = 0;  // bytes written buffered / queued for writeback
};

class PosixMappedFile final : public MappedFile {
 public:
  PosixMappedFile(std::string path, const uint8_t* data, uint64_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  ~PosixMappedFile() override {
    if (size_ > 0) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  const uint8_t* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }
  bool mapped() const override { return size_ > 0; }
  void DropPages(const uint8_t* p, size_t n) const override {
    // A fault maps more than the page it needs: the cached pages around it
    // (fault-around, 64 KiB) or its whole large folio (up to 2 MiB on ext4
    // since Linux 6.16), aligned in the file. So the 2 MiB file windows
    // around [p, p+n) are released; a neighbour still in use re-maps from the page cache.
    constexpr uint64_t kWindow = 2 << 20;
    if (n == 0 || p + n <= data_ || p >= data_ + size_) return;
    const uint64_t lo = static_cast<uint64_t>(std::max(p, data_) - data_) / kWindow * kWindow;
    const uint64_t hi = std::min<uint64_t>((static_cast<uint64_t>(std::min(p + n, data_ + size_) - data_) + kWindow - 1) / kWindow * kWindow, size_);
    if (hi > lo) ::madvise(const_cast<uint8_t*>(data_ + lo), (hi - lo + 4095) / 4096 * 4096, MADV_DONTNEED);  // a hint: failure is harmless
  }
  void Prefetch(const uint8_t* p, size_t n) const override {
    constexpr uintptr_t kPage = 4096;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(std::max(p, data_)) / kPage * kPage;
    const uintptr_t hi = reinterpret_cast<uintptr_t>(std::min(p + n, data_ + size_));
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_WILLNEED);  // a hint: failure is harmless
  }

 private:
  std::string path_;
  const uint8_t* data_;
  uint64_t size_;
};

// A small file read whole (pread) into memory of its own instead of mapped.
// An xser tag is thousands of small files; mapping each costs an mmap, page
// faults, and an madvise and a munmap that each flush the TLB of every core
// running the process (20-35% of a reshard's cycles on a 0.1B Trn1 tp 32
// tag). Its bytes stay resident while it lives, so the bytes read this way
// are capped per process (kReadWholeCap), past which files are mapped.
class ReadWholeFile final : public MappedFile {
 public:
  ReadWholeFile(std::string path, uint64_t size, std::atomic<uint64_t>* held)
      : path_(std::move(path)), bytes_(new uint8_t[size]), size_(size), held_(held) {}
  ~ReadWholeFile() override { *held_ -= size_; }
  const uint8_t* data() const override { return bytes_.get(); }
  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }
  uint8_t* mutable_data() { return bytes_.get(); }

 private:
  std::string path_;
  std::unique_ptr<uint8_t[]> bytes_;
  uint64_t size_;
  std::atomic<uint64_t>* held_;  // the Env's count of bytes held this way
};

// Reads [offset, offset + n) of `fd` into `out`; false when the file ended first.
bool ReadFully(int fd, uint8_t* out, uint64_t n, uint64_t offset, const std::string& path) {
  for (uint64_t at = 0; at < n;) {
    const ssize_t got = ::pread(fd, out + at, n - at, static_cast<off_t>(offset + at));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) ThrowErrno(path, "read failed");
    if (got == 0) return false;
    at += static_cast<uint64_t>(got);
  }
  return true;
}

class PosixRandomAccessFile final : public RandomAccessFile {
 public:
  PosixRandomAccessFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixRandomAccessFile() override { ::close(fd_); }
  void ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
    if (!ReadFully(fd_, out.data(), out.size(), offset, path_))
      throw Error(path_ + ": ends before byte " + std::to_string(offset + out.size()) + " (a read of " + std::to_string(out.size()) +
                  " bytes at offset " + std::to_string(offset) + ")");
  }
  const std::string& path() const override { return path_; }

 private:
  std::string path_;
  int fd_;
};

class BufferFile final : public MappedFile {
 public:
  BufferFile(std::string name, std::string contents) : name_(std::move(name)), buf_(std::move(contents)) {}
  const uint8_t* data() const override { return reinterpret_cast<const uint8_t*>(buf_.data()); }
  uint64_t size() const override { return buf_.size(); }
  const std::string& path() const override { return name_; }

 private:
  std::string name_, buf_;
};

// fstat of an open descriptor; on failure closes it and throws naming `path`.
struct stat StatOrClose(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    ThrowErrno(path, "cannot stat", e);
  }
  return st;
}

// Opens the folder `dir` and calls `sync` (fsync, syncfs) on it.
void SyncThroughDir(const std::string& dir, int (*sync)(int), const char* failed) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) ThrowErrno(dir, "cannot open directory");
  int rc = sync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0) ThrowErrno(dir, failed, e);
}

// Opens `path` for reading and sets `size`; throws naming it unless it is a
// regular file. O_NONBLOCK: opening a FIFO for reading would otherwise wait
// for a writer forever; it returns at once and the file type is refused. It
// does not affect reads of a regular file, which are all this opens.
int OpenRegularFile(const std::string& path, uint64_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) ThrowErrno(path, "cannot open");
  const struct stat st = StatOrClose(fd, path);
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": is a directory, not a file");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": is not a regular file (a FIFO, socket or device); refusing to read it");
  }
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

class PosixEnv final : public Env {
 private:
  std::atomic<uint64_t> read_whole_{0};  // bytes ReadWholeFiles hold

 public:
  std::unique_ptr<WritableFile> NewWritableFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) ThrowErrno(path, "cannot create");
    return std::make_unique<PosixWritableFile>(path, fd);
  }

  std::unique_ptr<WritableFile> NewAppendableFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) ThrowErrno(path, "cannot open for appending");
    const struct stat st = StatOrClose(fd, path);
    return std::make_unique<PosixWritableFile>(path, fd, static_cast<uint64_t>(st.st_size));
  }

  std::shared_ptr<const MappedFile> MapFile(const std::string& path) override {
    uint64_t size = 0;
    const int fd = OpenRegularFile(path, &size);
    if (auto f = ReadWhole(fd, path, size)) return f;
    void* p = nullptr;
    if (size > 0) {
      p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        int e = errno;
        ::close(fd);
        ThrowErrno(path, "mmap failed", e);
      }
    }
    ::close(fd);
    return std::make_shared<PosixMappedFile>(path, static_cast<const uint8_t*>(p), size);
  }

  std::unique_ptr<RandomAccessFile> NewRandomAccessFile(const std::string& path) override {
    uint64_t size = 0;
    return std::make_unique<PosixRandomAccessFile>(path, OpenRegularFile(path, &size));
  }

  uint64_t ReadInPieces(const std::string& path, std::span<uint8_t> buf,
                        const std::function<void(std::span<const uint8_t>)>& piece) override {
    uint64_t size = 0, at = 0;
    const int fd = OpenRegularFile(path, &size);
    try {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint: deeper read-ahead; failure is harmless
      for (;;) {
        const ssize_t got = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(at));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) ThrowErrno(path, "read failed");
        if (got == 0) break;
        piece({buf.data(), static_cast<size_t>(got)});
        at += static_cast<uint64_t>(got);
      }
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    return at;
  }

  // Files up to 64 KiB (an xser tag's norms and biases) are read whole
  // (ReadWholeFile), up to 16 MiB held at once; larger ones are mapped.
  static constexpr uint64_t kReadWholeMax = 64 << 10, kReadWholeCap = 16 << 20;

  // `fd` read into a ReadWholeFile, closing it; null (the descriptor open)
  // when the file is empty, larger than kReadWholeMax, or over the cap.
  std::shared_ptr<const MappedFile> ReadWhole(int fd, const std::string& path, uint64_t size) {
    if (size == 0 || size > kReadWholeMax) return nullptr;
    if ((read_whole_ += size) > kReadWholeCap) {
      read_whole_ -= size;
      return nullptr;
    }
    auto f = std::make_shared<ReadWholeFile>(path, size, &read_whole_);
    bool whole = false;
    try {
      whole = ReadFully(fd, f->mutable_data(), size, 0, path);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    if (!whole) throw Error(path + ": shrank while being read");
    return f;
  }

  void RenameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) ThrowErrno(from, ("cannot rename to " + to).c_str());
  }

  void SyncDir(const std::string& dir) override { SyncThroughDir(dir, ::fsync, "directory fsync failed"); }
  void SyncFileSystem(const std::string& dir) override { SyncThroughDir(dir, ::syncfs, "syncfs failed"); }

  void RemoveFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) ThrowErrno(path, "cannot remove");
  }

  void RemoveAll(const std::string& path) override {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) throw Error(path + ": cannot remove: " + ec.message());
  }

  void CreateDirs(const std::string& path) override {
    std::error_code ec;
    fs::create_directories(path, ec);
    if (ec) throw Error(path + ": cannot create directory: " + ec.message());
  }

  bool Exists(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }

  bool IsDirectory(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  }

  std::vector<std::string> ListDir(const std::string& path) override {
    std::error_code ec;
    std::vector<std::string> names;
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec))
      names.push_back(it->path().filename().string());
    if (ec) throw Error(path + ": cannot list directory: " + ec.message());
    std::sort(names.begin(), names.end());
    return names;
  }

  uint64_t FileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) ThrowErrno(path, "cannot stat");
    return static_cast<uint64_t>(st.st_size);
  }

  uint64_t AvailableBytes(const std::string& dir) override {
    struct statvfs st;
    if (::statvfs(dir.empty() ? "." : dir.c_str(), &st) != 0) ThrowErrno(dir, "cannot read the file system's free space");
    return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  }

  int64_t FileMTimeNs(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) ThrowErrno(path, "cannot stat");
    return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  }

  std::unique_ptr<FileLock> LockFile(const std::string& path, bool exclusive, bool wait) override {
    struct Lock : FileLock {
      Lock(std::string p, int f) : path(std::move(p)), fd(f) {}
      ~Lock() override { ::close(fd); }
      void SetContents(const std::string& text) override {
        if (::ftruncate(fd, 0) != 0) ThrowErrno(path, "cannot write lock file");
        for (size_t done = 0; done < text.size();) {
          const ssize_t w = ::pwrite(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
          if (w < 0 && errno == EINTR) continue;
          if (w <= 0) ThrowErrno(path, "cannot write lock file");
          done += static_cast<size_t>(w);
        }
      }
      std::string path;
      int fd;
    };
    for (;;) {
      int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0) ThrowErrno(path, "cannot open lock file");
      while (::flock(fd, (exclusive ? LOCK_EX : LOCK_SH) | (wait ? 0 : LOCK_NB)) != 0) {
        if (errno == EINTR) continue;
        int e = errno;
        ::close(fd);
        if (e == EWOULDBLOCK) return nullptr;
        ThrowErrno(path, "cannot lock", e);
      }
      // A holder may remove the file before releasing it (env.h): the lock
      // counts only while `path` still names the file locked; else lock anew.
      struct stat held, named;
      if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev && held.st_ino == named.st_ino)
        return std::make_unique<Lock>(path, fd);
      ::close(fd);
    }
  }
};

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::FromBuffer(std::string name, std::string contents) {
  return std::make_shared<BufferFile>(std::move(name), std::move(contents));
}

Env* Env::Default() {
  static PosixEnv env;
  return &env;
}

std::string TempPathFor(const std::string& path) {
  return path + ".tmp-shardkit-" + std::to_string(::getpid());
}

bool IsTempPath(const std::string& name) { return name.find(".tmp-shardkit-") != std::string::npos; }

void WriteFileAtomically(Env* env, const std::string& path, const std::function<void(WritableFile&)>& fill) {
  WriteFilesAtomically(env, {{path, fill}});
}

void WriteFilesAtomically(Env* env, const std::vector<FileContent>& files, bool sync_dirs) {
  std::vector<std::string> temps;
  size_t renamed = 0;
  try {
    for (const auto& f : files) {
      temps.push_back(TempPathFor(f.path));
      auto file = env->NewWritableFile(temps.back());
      f.fill(*file);
      file->Sync();
      file->Close();
    }
    for (; renamed < files.size(); ++renamed) env->RenameFile(temps[renamed], files[renamed].path);
  } catch (...) {
    for (size_t i = renamed; i < temps.size(); ++i) {  // what was not renamed is debris
      try {
        env->RemoveFile(temps[i]);
      } catch (...) {
      }
    }
    throw;
  }
  if (!sync_dirs) return;
  std::set<std::string> dirs;
  for (const auto& f : files) dirs.insert(fs::path(f.path).has_parent_path() ? fs::path(f.path).parent_path().string() : ".");
  for (const auto& d : dirs) env->SyncDir(d);
}

}  // namespace ckpt

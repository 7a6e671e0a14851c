// Env is the one interface through which checkpoint code touches the file
// system (as in LevelDB). The default is POSIX; tests substitute an Env that
// injects failed writes, ENOSPC, short writes or a crash at a chosen point.
// Every method reports failure by throwing ckpt::Error naming the path and
// the OS error.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace ckpt {

// A file being written, appended to in order.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual void Append(std::span<const uint8_t> data) = 0;
  // Hands what is buffered to the OS (visible to readers, not yet durable).
  virtual void Flush() = 0;
  // Flushes buffers and makes the contents durable (fsync).
  virtual void Sync() = 0;
  virtual void Close() = 0;
  // Bytes appended so far.
  virtual uint64_t Size() const = 0;
  // Overwrites bytes already appended, [offset, offset + data.size()) below
  // Size(): a zip header's CRC-32 once its streamed record is complete.
  virtual void WriteAt(uint64_t offset, std::span<const uint8_t> data) = 0;
};

// A whole file mapped read-only (or an in-memory buffer standing in for one).
// Tensors loaded from the file borrow its bytes and keep it alive.
class MappedFile {
 public:
  virtual ~MappedFile() = default;
  virtual const uint8_t* data() const = 0;
  virtual uint64_t size() const = 0;
  // The name used in error messages.
  virtual const std::string& path() const = 0;
  std::span<const uint8_t> bytes() const { return {data(), static_cast<size_t>(size())}; }
  // Hints that [p, p+n) will not be read again soon: a real mapping releases
  // it from this process, with the pages the kernel mapped around it (they
  // are re-read from the page cache if touched again), bounding the memory of
  // a pass over a large file.
  virtual void DropPages(const uint8_t* /*p*/, size_t /*n*/) const {}
  // Hints that [p, p+n) will be read soon: a real mapping starts reading it
  // into the page cache in the background.
  virtual void Prefetch(const uint8_t* /*p*/, size_t /*n*/) const {}
  // Whether the bytes are a mapping of path() (read from the disk on demand)
  // rather than memory of this process: a reader copying many ranges reads
  // those with pread instead (ckpt/util/open_file_cache.h).
  virtual bool mapped() const { return false; }

  // An in-memory file (tests, fuzzing).
  static std::shared_ptr<const MappedFile> FromBuffer(std::string name, std::string contents);
};

// A file read at any offset with pread, from any thread at once: a copy
// straight into the caller's memory, with no mapping (OpenFileCache,
// ckpt/util/open_file_cache.h, keeps many open).
class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Reads [offset, offset + out.size()) into `out`. Throws ckpt::Error
  // naming the file when the read fails or the file ends first.
  virtual void ReadAt(uint64_t offset, std::span<uint8_t> out) const = 0;
  // The name used in error messages.
  virtual const std::string& path() const = 0;
};

// An advisory lock held until destroyed (or until the process ends, however
// it ends: the kernel releases it, so a killed holder never blocks anyone).
class FileLock {
 public:
  virtual ~FileLock() = default;
  // Replaces the lock file's contents with `text`: who holds it, for a
  // process the lock turns away to read and name.
  virtual void SetContents(const std::string& text) = 0;
};

class Env {
 public:
  virtual ~Env() = default;
  static Env* Default();

  // Creates or truncates `path`.
  virtual std::unique_ptr<WritableFile> NewWritableFile(const std::string& path) = 0;
  // Opens `path` (creating it) to append after what it holds; Size() counts
  // the bytes already there.
  virtual std::unique_ptr<WritableFile> NewAppendableFile(const std::string& path) = 0;
  virtual std::shared_ptr<const MappedFile> MapFile(const std::string& path) = 0;
  // Opens `path`, a regular file, for RandomAccessFile::ReadAt; its
  // descriptor stays open until the object is destroyed.
  virtual std::unique_ptr<RandomAccessFile> NewRandomAccessFile(const std::string& path) = 0;
  // Reads `path` once from start to end, at most buf.size() bytes at a time
  // into `buf`, calling `piece` with each piece read; returns the bytes read.
  // For one pass over a file (its checksum): the POSIX Env reads with pread,
  // so the pass maps nothing and costs no page faults, nor an madvise and a
  // munmap that each flush the TLB of every core running the process.
  virtual uint64_t ReadInPieces(const std::string& path, std::span<uint8_t> buf,
                                const std::function<void(std::span<const uint8_t>)>& piece) = 0;
  // Atomically replaces `to` with `from`.
  virtual void RenameFile(const std::string& from, const std::string& to) = 0;
  // fsyncs a directory so renames and creations inside it are durable.
  virtual void SyncDir(const std::string& dir) = 0;
  // Makes everything written on the file system holding `dir` durable
  // (syncfs): one journal commit for a folder of many small files (xser),
  // where an fsync of each would be one commit per file.
  virtual void SyncFileSystem(const std::string& dir) = 0;
  virtual void RemoveFile(const std::string& path) = 0;
  // Removes a directory tree; absent is fine.
  virtual void RemoveAll(const std::string& path) = 0;
  // Creates a directory and its parents; existing is fine.
  virtual void CreateDirs(const std::string& path) = 0;
  virtual bool Exists(const std::string& path) = 0;
  virtual bool IsDirectory(const std::string& path) = 0;
  // Names (not paths) of the entries of a directory, sorted.
  virtual std::vector<std::string> ListDir(const std::string& path) = 0;
  virtual uint64_t FileSize(const std::string& path) = 0;
  // Modification time in nanoseconds since the epoch.
  virtual int64_t FileMTimeNs(const std::string& path) = 0;
  // Bytes an unprivileged writer can still put on the file system holding
  // `dir` (statvfs f_bavail): a large output is refused before it starts.
  virtual uint64_t AvailableBytes(const std::string& dir) = 0;
  // flock()s `path` (created if absent). Shared locks coexist; an exclusive
  // lock excludes all others. Returns null when !wait and the lock is taken.
  // The lock returned is on the file `path` names when it returns (one
  // removed while this call waited is not), so a holder may remove `path`
  // just before releasing it without letting two processes in at once.
  virtual std::unique_ptr<FileLock> LockFile(const std::string& path, bool exclusive, bool wait) = 0;
};

// Writes `path` so that a crash leaves either the old file or the complete
// new one: `fill` writes a temporary sibling, which is fsynced, renamed over
// `path`, and the directory is fsynced. On failure the temporary is removed,
// `path` is untouched, and the error propagates.
void WriteFileAtomically(Env* env, const std::string& path,
                         const std::function<void(WritableFile&)>& fill);

// Writes several files so that a failure leaves none of them under its final
// name (or the old ones): every temporary is written and fsynced first, then
// all are renamed. Only a crash between two renames can leave a mix.
struct FileContent {
  std::string path;
  std::function<void(WritableFile&)> fill;
};
// `sync_dirs` false leaves the folders' fsync to the caller, who writes many
// files into few folders and syncs each folder once after the last of them
// (WriteRankFiles: an xser tag has a file per tensor).
void WriteFilesAtomically(Env* env, const std::vector<FileContent>& files, bool sync_dirs = true);

// The name of the temporary sibling WriteFileAtomically uses for `path`;
// anything with this shape is debris from an interrupted write.
std::string TempPathFor(const std::string& path);
bool IsTempPath(const std::string& name);

}  // namespace ckpt

// Storage is a flat byte buffer that tensors view. It is shared (tensors hold
// it by shared_ptr) and is either owned heap memory or a read-only window of a
// memory-mapped file, kept alive by the mapping's owner. Reading a .pt file
// creates mapped storages, so no tensor bytes are copied on load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

namespace ckpt {

class MappedFile;

// Where a storage's bytes came from when they are a STORED record of a mapped
// archive: writers that copy the bytes verify them against the record's
// CRC-32 and can drop the copied pages from memory (SaveOptions).
struct StorageOrigin {
  const MappedFile* file;  // kept alive by the storage's owner
  std::string record;
  uint32_t crc32;
};

// Fills `out` with a generated storage's bytes [offset, offset + out.size()).
using StorageProducer = std::function<void(uint64_t offset, std::span<uint8_t> out)>;

class Storage {
 public:
  // Owned, writable memory, 4096-byte aligned (so the POSIX Env can write it
  // with O_DIRECT), zero-initialised unless `zero` is false.
  static std::shared_ptr<Storage> Allocate(size_t nbytes, bool zero = true);
  // Owned, writable memory handed back through `release` when the storage
  // dies (a pool recycling snapshot buffers).
  static std::shared_ptr<Storage> Adopt(uint8_t* data, size_t nbytes, std::function<void(uint8_t*)> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  // A read-only view of bytes that `owner` keeps alive (e.g. an mmap).
  static std::shared_ptr<Storage> Borrow(std::shared_ptr<const void> owner,
                                         const uint8_t* data, size_t nbytes);

  // A storage whose bytes exist only as they are written: SavePt asks
  // `produce` for them a chunk at a time (SaveOptions::stream_chunk), so a
  // file assembled from pieces of other files is never held whole. data()
  // is null; only a writer reads it.
  static std::shared_ptr<Storage> Generated(size_t nbytes, StorageProducer produce);
  // nullptr unless the storage is generated.
  const StorageProducer* producer() const { return produce_ ? &produce_ : nullptr; }

  // A storage of known size whose bytes are bound later (legacy .pt files
  // store data after the pickle that references it).
  static std::shared_ptr<Storage> Deferred(size_t nbytes);
  // Binds a deferred storage; throws ckpt::Error if already bound.
  void Bind(std::shared_ptr<const void> owner, const uint8_t* data);
  bool is_bound() const { return data_ != nullptr || nbytes_ == 0; }

  const uint8_t* data() const { return data_; }
  // Throws ckpt::Error for a borrowed (read-only) storage.
  uint8_t* mutable_data();
  size_t nbytes() const { return nbytes_; }
  bool is_borrowed() const { return owner_ != nullptr; }
  // nullptr unless the storage is a record of a mapped archive.
  const StorageOrigin* origin() const { return origin_ ? &*origin_ : nullptr; }
  void set_origin(StorageOrigin o) { origin_ = std::move(o); }

 private:
  Storage() = default;
  uint8_t* owned_ = nullptr;
  std::function<void(uint8_t*)> release_;  // frees owned_
  std::shared_ptr<const void> owner_;
  const uint8_t* data_ = nullptr;
  size_t nbytes_ = 0;
  std::optional<StorageOrigin> origin_;
  StorageProducer produce_;
};

// Owned buffers recycled by size. A buffer taken from the pool returns to it
// when its storage dies, already faulted in, so the next one costs neither an
// allocation nor a page fault per 4 KiB. Buffers outliving the pool are freed.
// Thread-safe.
class StoragePool : public std::enable_shared_from_this<StoragePool> {
 public:
  static std::shared_ptr<StoragePool> Create() { return std::shared_ptr<StoragePool>(new StoragePool()); }
  virtual ~StoragePool();
  StoragePool(const StoragePool&) = delete;
  StoragePool& operator=(const StoragePool&) = delete;

  // Owned, 4096-aligned, uninitialised storage of `nbytes`, reused when a
  // buffer of that size is free.
  std::shared_ptr<Storage> Acquire(size_t nbytes);
  // Bytes held free for reuse.
  size_t free_bytes() const;
  // Frees every idle buffer.
  void Trim();

 protected:
  StoragePool() = default;

 private:
  void Release(uint8_t* p, size_t nbytes);
  mutable std::mutex mu_;
  std::multimap<size_t, uint8_t*> free_;
};

}  // namespace ckpt

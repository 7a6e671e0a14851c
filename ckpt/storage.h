// Storage is a flat byte buffer that tensors view. It is shared (tensors hold
// it by shared_ptr) and is either owned heap memory or a read-only window of a
// memory-mapped file, kept alive by the mapping's owner. Reading a .pt file
// creates mapped storages, so no tensor bytes are copied on load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace ckpt {

class Storage {
 public:
  // Owned, writable, zero-initialised memory.
  static std::shared_ptr<Storage> Allocate(size_t nbytes);
  // A read-only view of bytes that `owner` keeps alive (e.g. an mmap).
  static std::shared_ptr<Storage> Borrow(std::shared_ptr<const void> owner,
                                         const uint8_t* data, size_t nbytes);

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

 private:
  Storage() = default;
  std::unique_ptr<uint8_t[]> owned_;
  std::shared_ptr<const void> owner_;
  const uint8_t* data_ = nullptr;
  size_t nbytes_ = 0;
};

}  // namespace ckpt

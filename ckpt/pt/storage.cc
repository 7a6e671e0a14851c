#include "ckpt/pt/storage.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "ckpt/util/error.h"

namespace ckpt {

std::shared_ptr<Storage> Storage::Allocate(size_t nbytes, bool zero) {
  constexpr size_t kAlign = 4096;
  const size_t padded = (std::max<size_t>(nbytes, 1) + kAlign - 1) / kAlign * kAlign;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlign, padded));
  if (!p) throw std::bad_alloc();
  if (zero) std::memset(p, 0, padded);
  std::shared_ptr<Storage> s(new Storage());
  s->owned_ = p;
  s->release_ = [](uint8_t* q) { std::free(q); };
  s->data_ = p;
  s->nbytes_ = nbytes;
  return s;
}

std::shared_ptr<Storage> Storage::Adopt(uint8_t* data, size_t nbytes, std::function<void(uint8_t*)> release) {
  std::shared_ptr<Storage> s(new Storage());
  s->owned_ = data;
  s->release_ = std::move(release);
  s->data_ = data;
  s->nbytes_ = nbytes;
  return s;
}

Storage::~Storage() {
  if (owned_) release_(owned_);
}

std::shared_ptr<Storage> Storage::Borrow(std::shared_ptr<const void> owner,
                                         const uint8_t* data, size_t nbytes) {
  std::shared_ptr<Storage> s(new Storage());
  s->owner_ = std::move(owner);
  s->data_ = data;
  s->nbytes_ = nbytes;
  return s;
}

std::shared_ptr<Storage> Storage::Generated(size_t nbytes, StorageProducer produce) {
  std::shared_ptr<Storage> s(new Storage());
  s->nbytes_ = nbytes;
  s->produce_ = std::move(produce);
  return s;
}

std::shared_ptr<Storage> Storage::Deferred(size_t nbytes) {
  std::shared_ptr<Storage> s(new Storage());
  s->nbytes_ = nbytes;
  return s;
}

void Storage::Bind(std::shared_ptr<const void> owner, const uint8_t* data) {
  if (data_ || owned_) throw Error("storage is already bound");
  owner_ = std::move(owner);
  data_ = data;
}

uint8_t* Storage::mutable_data() {
  if (!owned_) throw Error("storage is a read-only view of a mapped file; clone the tensor before writing to it");
  return owned_;
}

StoragePool::~StoragePool() { Trim(); }

std::shared_ptr<Storage> StoragePool::Acquire(size_t nbytes) {
  uint8_t* p = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = free_.find(nbytes);
    if (it != free_.end()) {
      p = it->second;
      free_.erase(it);
    }
  }
  if (!p) {
    const size_t padded = (std::max<size_t>(nbytes, 1) + 4095) / 4096 * 4096;
    p = static_cast<uint8_t*>(std::aligned_alloc(4096, padded));
    if (!p) throw std::bad_alloc();
  }
  // The pool may die before the storage: then the buffer is simply freed.
  std::weak_ptr<StoragePool> weak = weak_from_this();
  return Storage::Adopt(p, nbytes, [weak, nbytes](uint8_t* q) {
    if (auto pool = weak.lock()) pool->Release(q, nbytes);
    else std::free(q);
  });
}

void StoragePool::Release(uint8_t* p, size_t nbytes) {
  std::lock_guard<std::mutex> l(mu_);
  free_.emplace(nbytes, p);
}

size_t StoragePool::free_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (const auto& [size, p] : free_) n += size;
  return n;
}

void StoragePool::Trim() {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& [size, p] : free_) std::free(p);
  free_.clear();
}

}  // namespace ckpt

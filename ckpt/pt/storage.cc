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

}  // namespace ckpt

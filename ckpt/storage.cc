#include "ckpt/storage.h"

#include "ckpt/error.h"

namespace ckpt {

std::shared_ptr<Storage> Storage::Allocate(size_t nbytes) {
  std::shared_ptr<Storage> s(new Storage());
  s->owned_.reset(new uint8_t[nbytes > 0 ? nbytes : 1]());
  s->data_ = s->owned_.get();
  s->nbytes_ = nbytes;
  return s;
}

std::shared_ptr<Storage> Storage::Borrow(std::shared_ptr<const void> owner,
                                         const uint8_t* data, size_t nbytes) {
  std::shared_ptr<Storage> s(new Storage());
  s->owner_ = std::move(owner);
  s->data_ = data;
  s->nbytes_ = nbytes;
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
  return owned_.get();
}

}  // namespace ckpt

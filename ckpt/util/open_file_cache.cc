#include "ckpt/util/open_file_cache.h"

#include <algorithm>

namespace ckpt {

OpenFileCache::OpenFileCache(Env* env, size_t capacity) : env_(env), capacity_(std::max<size_t>(capacity, 1)) {}

std::shared_ptr<const RandomAccessFile> OpenFileCache::Open(const std::string& path) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (auto it = open_.find(path); it != open_.end()) {
      recent_.splice(recent_.begin(), recent_, it->second.at);
      return it->second.file;
    }
  }
  // Opened outside the lock: threads opening different files do not wait on each other.
  std::shared_ptr<const RandomAccessFile> f = env_->NewRandomAccessFile(path);
  std::lock_guard<std::mutex> l(mu_);
  if (auto it = open_.find(path); it != open_.end()) return it->second.file;  // another thread opened it meanwhile
  while (open_.size() >= capacity_) {
    open_.erase(recent_.back());
    recent_.pop_back();
  }
  recent_.push_front(path);
  open_.emplace(path, Entry{f, recent_.begin()});
  return f;
}

void OpenFileCache::ReadAt(const std::string& path, uint64_t offset, std::span<uint8_t> out) {
  if (out.empty()) return;
  Open(path)->ReadAt(offset, out);
}

size_t OpenFileCache::open_files() const {
  std::lock_guard<std::mutex> l(mu_);
  return open_.size();
}

}  // namespace ckpt

#include "ckpt/util/read_fold.h"

#include <filesystem>
#include <sstream>
#include <vector>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"

namespace ckpt {

std::string ReadFold::Key(const std::string& path) { return std::filesystem::path(path).lexically_normal().string(); }

void ReadFold::Insert(Runs& runs, uint64_t offset, uint64_t len, uint32_t crc) {
  if (len == 0) return;
  auto next = runs.lower_bound(offset);
  if (next != runs.end() && next->first < offset + len) return;  // overlaps the run after
  auto prev = next == runs.begin() ? runs.end() : std::prev(next);
  if (prev != runs.end() && prev->first + prev->second.len > offset) return;  // overlaps the run before
  if (prev != runs.end() && prev->first + prev->second.len == offset) {
    prev->second.crc = Crc32Combine(prev->second.crc, crc, len);
    prev->second.len += len;
  } else {
    if (runs_ >= kMaxRuns) return;  // a gap the check reads
    prev = runs.emplace_hint(next, offset, Run{len, crc});
    ++runs_;
  }
  bytes_ += len;
  if (next != runs.end() && next->first == prev->first + prev->second.len) {
    prev->second.crc = Crc32Combine(prev->second.crc, next->second.crc, next->second.len);
    prev->second.len += next->second.len;
    runs.erase(next);
    --runs_;
  }
}

void ReadFold::Add(const std::string& key, uint64_t offset, std::span<const uint8_t> bytes) {
  const uint64_t end = offset + bytes.size();
  std::vector<std::pair<uint64_t, uint64_t>> fresh;  // [lo, hi) not yet recorded
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Runs& runs = files_[key];
    uint64_t at = offset;
    auto it = runs.upper_bound(offset);
    if (it != runs.begin()) --it;
    for (; it != runs.end() && it->first < end && at < end; ++it) {
      if (it->first > at) fresh.push_back({at, it->first});
      at = std::max(at, it->first + it->second.len);
    }
    if (at < end) fresh.push_back({at, end});
  }
  // The CRCs are summed outside the lock; a range another thread recorded meanwhile is left out.
  std::vector<uint32_t> crcs;
  for (const auto& [lo, hi] : fresh) crcs.push_back(Crc32(bytes.subspan(lo - offset, hi - lo)));
  std::lock_guard<std::mutex> lock(mu_);
  Runs& runs = files_[key];
  for (size_t i = 0; i < fresh.size(); ++i) Insert(runs, fresh[i].first, fresh[i].second - fresh[i].first, crcs[i]);
}

std::string ReadFold::Encode() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream out;
  for (const auto& [key, runs] : files_)
    for (const auto& [offset, run] : runs) out << offset << ' ' << run.len << ' ' << run.crc << ' ' << key << '\n';
  return out.str();
}

void ReadFold::Merge(const std::string& encoded) {
  std::istringstream in(encoded);
  std::string line;
  std::lock_guard<std::mutex> lock(mu_);
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    uint64_t offset = 0, len = 0;
    uint32_t crc = 0;
    if (!(fields >> offset >> len >> crc) || fields.get() != ' ') throw Error("a peer's record of what it read is malformed: " + line);
    std::string key;
    std::getline(fields, key);
    Insert(files_[key], offset, len, crc);
  }
}

uint32_t ReadFold::Crc(Env* env, const std::string& path, uint64_t size) const {
  Runs runs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = files_.find(Key(path)); it != files_.end()) runs = it->second;
  }
  thread_local std::vector<uint8_t> window(kCrcWindow);
  std::unique_ptr<RandomAccessFile> file;
  uint32_t crc = 0;
  auto read_gap = [&](uint64_t lo, uint64_t hi) {
    if (!file) file = env->NewRandomAccessFile(path);
    for (uint64_t at = lo; at < hi;) {
      const uint64_t n = std::min<uint64_t>(hi - at, window.size());
      file->ReadAt(at, {window.data(), n});
      crc = Crc32Combine(crc, Crc32({window.data(), n}), n);
      at += n;
    }
  };
  uint64_t at = 0;
  for (const auto& [offset, run] : runs) {
    if (offset + run.len > size) break;  // past the end: what is left is read (and its read fails)
    read_gap(at, offset);
    crc = Crc32Combine(crc, run.crc, run.len);
    at = offset + run.len;
  }
  read_gap(at, size);
  return crc;
}

uint64_t ReadFold::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

size_t ReadFold::runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return runs_;
}

namespace {

class FoldingFile final : public RandomAccessFile {
 public:
  FoldingFile(std::unique_ptr<RandomAccessFile> base, ReadFold* fold, std::string key)
      : base_(std::move(base)), fold_(fold), key_(std::move(key)) {}
  void ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
    base_->ReadAt(offset, out);
    fold_->Add(key_, offset, out);
  }
  const std::string& path() const override { return base_->path(); }

 private:
  std::unique_ptr<RandomAccessFile> base_;
  ReadFold* fold_;
  std::string key_;
};

}  // namespace

std::shared_ptr<const MappedFile> FoldingEnv::MapFile(const std::string& path) {
  auto f = base_->MapFile(path);
  if (!f->mapped()) fold_->Add(ReadFold::Key(path), 0, f->bytes());  // read whole into memory: recorded whole
  return f;
}

std::unique_ptr<RandomAccessFile> FoldingEnv::NewRandomAccessFile(const std::string& path) {
  return std::make_unique<FoldingFile>(base_->NewRandomAccessFile(path), fold_, ReadFold::Key(path));
}

}  // namespace ckpt

#include "libtrain/indexed_dataset.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <map>

#include "ckpt/util/error.h"

namespace train {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};

size_t ElementSize(int code) {
  switch (code) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 6: return 4;
    case 5: case 7: return 8;
  }
  return 0;
}

template <typename T>
T ReadLe(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

IndexedDataset::IndexedDataset(const std::string& prefix, ckpt::Env* env) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  if (!env->Exists(idx_path)) throw ckpt::Error(idx_path + ": missing (data_prefix '" + prefix + "' needs .idx and .bin)");
  if (!env->Exists(bin_path)) throw ckpt::Error(bin_path + ": missing (data_prefix '" + prefix + "' needs .idx and .bin)");
  auto idx = env->MapFile(idx_path);
  bin_ = env->MapFile(bin_path);
  const uint8_t* p = idx->data();
  const uint64_t n = idx->size();
  if (n < 34 || std::memcmp(p, kMagic, 9) != 0) throw ckpt::Error(idx_path + ": not a Megatron mmap index (bad magic)");
  if (ReadLe<uint64_t>(p + 9) != 1) throw ckpt::Error(idx_path + ": unsupported index version " + std::to_string(ReadLe<uint64_t>(p + 9)));
  dtype_code_ = p[17];
  elem_ = ElementSize(dtype_code_);
  if (!elem_ || dtype_code_ == 6 || dtype_code_ == 7)
    throw ckpt::Error(idx_path + ": dtype code " + std::to_string(dtype_code_) + " is not an integer token type");
  const uint64_t count = ReadLe<uint64_t>(p + 18), docs = ReadLe<uint64_t>(p + 26);
  if (count > (n - 34) / 12 || docs > (n - 34 - count * 12) / 8)
    throw ckpt::Error(idx_path + ": truncated (" + std::to_string(count) + " sequences declared, " + std::to_string(n) + " bytes)");
  sizes_.resize(count);
  pointers_.resize(count);
  std::memcpy(sizes_.data(), p + 34, count * 4);
  std::memcpy(pointers_.data(), p + 34 + count * 4, count * 8);
  starts_.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    if (sizes_[i] < 0 || pointers_[i] < 0 ||
        static_cast<uint64_t>(pointers_[i]) + static_cast<uint64_t>(sizes_[i]) * elem_ > bin_->size())
      throw ckpt::Error(bin_path + ": sequence " + std::to_string(i) + " (" + std::to_string(sizes_[i]) + " tokens at byte " +
                        std::to_string(pointers_[i]) + ") lies outside the " + std::to_string(bin_->size()) + "-byte file");
    starts_[i] = total_;
    total_ += sizes_[i];
  }
}

void IndexedDataset::ReadTokens(int64_t pos, int64_t count, int32_t* out) const {
  if (pos < 0 || count < 0 || pos + count > total_) throw ckpt::Error(prefix_ + ": token range out of bounds");
  auto seq = static_cast<int64_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
  int64_t within = pos - starts_[seq];
  for (int64_t done = 0; done < count;) {
    while (within >= sizes_[seq]) ++seq, within = 0;
    const int64_t take = std::min<int64_t>(count - done, sizes_[seq] - within);
    const uint8_t* src = bin_->data() + pointers_[seq] + within * elem_;
    for (int64_t k = 0; k < take; ++k) {
      const uint8_t* e = src + k * elem_;
      switch (dtype_code_) {
        case 1: out[done + k] = *e; break;
        case 2: out[done + k] = static_cast<int8_t>(*e); break;
        case 3: out[done + k] = ReadLe<int16_t>(e); break;
        case 8: out[done + k] = ReadLe<uint16_t>(e); break;
        case 4: out[done + k] = ReadLe<int32_t>(e); break;
        case 5: out[done + k] = static_cast<int32_t>(ReadLe<int64_t>(e)); break;
      }
    }
    done += take;
    within += take;
  }
}

void IndexedDataset::Write(const std::string& prefix, const std::vector<std::vector<int32_t>>& docs, ckpt::Env* env) {
  bool small = true;
  for (const auto& d : docs)
    for (int32_t t : d) small &= t >= 0 && t < 65536;
  const int code = small ? 8 : 4;
  const size_t elem = small ? 2 : 4;
  auto bin = [&](ckpt::WritableFile& f) {
    std::vector<uint8_t> buf;
    for (const auto& d : docs) {
      buf.resize(d.size() * elem);
      for (size_t i = 0; i < d.size(); ++i) {
        if (small) {
          const uint16_t v = static_cast<uint16_t>(d[i]);
          std::memcpy(&buf[i * 2], &v, 2);
        } else {
          std::memcpy(&buf[i * 4], &d[i], 4);
        }
      }
      f.Append(buf);
    }
  };
  auto idx = [&](ckpt::WritableFile& f) {
    std::vector<uint8_t> h(kMagic, kMagic + 9);
    auto put = [&](const void* p, size_t n) { h.insert(h.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n); };
    const uint64_t version = 1, count = docs.size(), doc_count = docs.size() + 1;
    const uint8_t c = static_cast<uint8_t>(code);
    put(&version, 8), put(&c, 1), put(&count, 8), put(&doc_count, 8);
    for (const auto& d : docs) {
      const int32_t s = static_cast<int32_t>(d.size());
      put(&s, 4);
    }
    int64_t ptr = 0;
    for (const auto& d : docs) put(&ptr, 8), ptr += static_cast<int64_t>(d.size() * elem);
    for (uint64_t i = 0; i <= count; ++i) {  // doc_idx: every sequence is one document
      const int64_t v = static_cast<int64_t>(i);
      put(&v, 8);
    }
    f.Append(h);
  };
  ckpt::WriteFilesAtomically(env, {{prefix + ".bin", bin}, {prefix + ".idx", idx}});  // both or neither
}

SampleSource::SampleSource(std::vector<std::shared_ptr<TokenSource>> datasets, std::vector<double> weights,
                           int64_t seq_length, uint64_t seed)
    : datasets_(std::move(datasets)), weights_(std::move(weights)), seq_(seq_length), seed_(seed) {
  if (datasets_.empty()) throw ckpt::Error("no training data given (data.data_prefix)");
  if (weights_.size() != datasets_.size()) throw ckpt::Error("data.data_prefix: one weight per dataset is needed");
  const double sum = std::accumulate(weights_.begin(), weights_.end(), 0.0);
  if (!(sum > 0)) throw ckpt::Error("data.data_prefix: weights must be positive");
  for (double& w : weights_) w /= sum;
  for (const auto& d : datasets_) {
    const int64_t windows = (d->num_tokens() - 1) / seq_;
    if (windows < 1)
      throw ckpt::Error(d->prefix() + ": " + std::to_string(d->num_tokens()) + " tokens cannot make one sample of seq_length " +
                        std::to_string(seq_) + " + 1");
    windows_.push_back(windows);
  }
}

int64_t SampleSource::WindowFor(size_t d, int64_t k) const {
  // Epoch e visits the windows in a permutation seeded by (seed, dataset, e).
  const int64_t n = windows_[d], epoch = k / n, j = k % n;
  const uint64_t key = seed_ * 1000003ull + d * 7919ull + static_cast<uint64_t>(epoch) * 104729ull;
  std::lock_guard<std::mutex> l(perm_mu_);
  auto it = perm_cache_.find({d, epoch});
  if (it == perm_cache_.end()) {
    if (perm_cache_.size() > 8) perm_cache_.clear();
    std::vector<int64_t> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(key);
    for (int64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1))]);
    it = perm_cache_.emplace(std::pair{d, epoch}, std::move(perm)).first;
  }
  return it->second[j];
}

void SampleSource::Sample(int64_t i, int32_t* out) const {
  size_t d = 0;
  int64_t k = i;
  if (datasets_.size() > 1) {
    // Megatron's blending: sample s goes to the dataset furthest behind
    // weight * (s + 1). Training asks for samples in order, so the running
    // counts are kept and only rebuilt when asked to go back.
    std::lock_guard<std::mutex> l(blend_mu_);
    if (i < blend_next_) blend_next_ = 0, blend_counts_.assign(datasets_.size(), 0);
    if (blend_counts_.empty()) blend_counts_.assign(datasets_.size(), 0);
    for (; blend_next_ <= i; ++blend_next_) {
      size_t best = 0;
      double best_err = -1e300;
      for (size_t q = 0; q < datasets_.size(); ++q) {
        const double err = weights_[q] * static_cast<double>(blend_next_ + 1) - static_cast<double>(blend_counts_[q]);
        if (err > best_err) best_err = err, best = q;
      }
      if (blend_next_ == i) d = best, k = blend_counts_[best];
      ++blend_counts_[best];
    }
  }
  datasets_[d]->ReadTokens(WindowFor(d, k) * seq_, seq_ + 1, out);
}

}  // namespace train

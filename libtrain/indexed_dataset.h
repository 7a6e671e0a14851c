// Megatron's mmap indexed dataset (data_impl: mmap), what NNM and NxDT users
// already have: PREFIX.bin holds the token ids of every document back to
// back; PREFIX.idx holds "MMIDIDX\0\0", version 1 (u64), the dtype code (u8:
// 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float32, 7 float64,
// 8 uint16), the sequence count and doc count (u64), then int32 sizes,
// int64 byte pointers and int64 doc_idx. Both files are mapped, not read.
#pragma once

#include <cstdint>
#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ckpt/util/env.h"

namespace train {

// A stream of token ids: the concatenation of a dataset's documents.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual int64_t num_tokens() const = 0;
  // Tokens [pos, pos + count) of the stream; throws ckpt::Error when out of range.
  virtual void ReadTokens(int64_t pos, int64_t count, int32_t* out) const = 0;
  // The name used in messages (a prefix or a file).
  virtual const std::string& prefix() const = 0;
};

class IndexedDataset : public TokenSource {
 public:
  // Throws ckpt::Error naming the file and what is wrong with it.
  explicit IndexedDataset(const std::string& prefix, ckpt::Env* env = ckpt::Env::Default());

  int64_t num_sequences() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_tokens() const override { return total_; }
  int64_t size(int64_t i) const { return sizes_[i]; }
  void ReadTokens(int64_t pos, int64_t count, int32_t* out) const override;
  const std::string& prefix() const override { return prefix_; }

  // Writes a dataset (atomically); dtype code 8 (uint16) when every id fits, else 4 (int32).
  static void Write(const std::string& prefix, const std::vector<std::vector<int32_t>>& docs,
                    ckpt::Env* env = ckpt::Env::Default());

 private:
  std::string prefix_;
  std::shared_ptr<const ckpt::MappedFile> bin_;
  int dtype_code_ = 0;
  size_t elem_ = 0;
  std::vector<int32_t> sizes_;
  std::vector<int64_t> pointers_;  // byte offsets into .bin
  std::vector<int64_t> starts_;    // token offset of each sequence in the concatenation
  int64_t total_ = 0;
};

// Training samples over one or more datasets: each sample is seq_length + 1
// consecutive tokens of a dataset's concatenated stream (windows of stride
// seq_length), visited in a seeded random order per epoch; several datasets
// are blended by weight as Megatron's BlendableDataset does (each sample goes
// to the dataset furthest behind its share). Sample i is a pure function of
// (datasets, weights, seq_length, seed), so consumed_samples alone restores
// the position in the data.
class SampleSource {
 public:
  SampleSource(std::vector<std::shared_ptr<TokenSource>> datasets, std::vector<double> weights, int64_t seq_length,
               uint64_t seed);
  // Tokens of global sample `i` (seq_length + 1 of them).
  void Sample(int64_t i, int32_t* out) const;
  int64_t samples_per_epoch(size_t dataset) const { return windows_[dataset]; }

 private:
  int64_t WindowFor(size_t d, int64_t k) const;  // k-th sample drawn from dataset d
  std::vector<std::shared_ptr<TokenSource>> datasets_;
  std::vector<double> weights_;
  std::vector<int64_t> windows_;
  int64_t seq_;
  uint64_t seed_;
  // Epoch permutations by (dataset, epoch), owned by this source: a cache
  // shared across sources could hand one source another's permutation.
  mutable std::mutex perm_mu_;
  mutable std::map<std::pair<size_t, int64_t>, std::vector<int64_t>> perm_cache_;
  mutable std::mutex blend_mu_;
  mutable int64_t blend_next_ = 0;  // first sample not yet assigned
  mutable std::vector<int64_t> blend_counts_;
};

}  // namespace train

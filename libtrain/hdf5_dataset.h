// Tokenised data in HDF5: a file holding one one-dimensional integer
// dataset of token ids (any integer type; read as int32). Read on demand by
// hyperslab, not loaded whole.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "libtrain/indexed_dataset.h"

namespace train {

class Hdf5Dataset : public TokenSource {
 public:
  // Throws ckpt::Error naming the file and what is wrong with it.
  explicit Hdf5Dataset(const std::string& path);
  ~Hdf5Dataset() override;
  Hdf5Dataset(const Hdf5Dataset&) = delete;
  Hdf5Dataset& operator=(const Hdf5Dataset&) = delete;

  int64_t num_tokens() const override { return total_; }
  void ReadTokens(int64_t pos, int64_t count, int32_t* out) const override;
  const std::string& prefix() const override { return path_; }

  // Writes `tokens` as dataset "tokens" of a new file (atomically).
  static void Write(const std::string& path, const std::vector<int32_t>& tokens);

 private:
  std::string path_, dataset_name_;
  int64_t file_ = -1, dataset_ = -1;
  int64_t total_ = 0;
};

}  // namespace train

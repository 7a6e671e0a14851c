// Helpers shared by the ckpt unit tests.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include "ckpt/tensor.h"

namespace ckpt::testing {

// A fresh directory under the system temp dir, removed on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    path_ = (std::filesystem::temp_directory_path() / (tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++))).string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

// A float32 tensor holding 0, 1, 2, ... in row-major order.
inline Tensor Arange(std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(DType::kFloat32, std::move(shape));
  float* p = reinterpret_cast<float*>(t.mutable_data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(i);
  return t;
}

}  // namespace ckpt::testing

// Helpers shared by the ckpt unit tests.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <chrono>
#include <ctime>
#include <algorithm>
#include <functional>
#include <string>

#include <random>

#include "ckpt/store/checkpoint_store.h"
#include "ckpt/util/error.h"
#include "ckpt/pt/tensor.h"
#include "ckpt/store/training_state.h"

namespace ckpt::testing {

// A WritableFile collecting its bytes in memory.
class StringFile : public WritableFile {
 public:
  void Append(std::span<const uint8_t> d) override { s.append(reinterpret_cast<const char*>(d.data()), d.size()); }
  void Flush() override {}
  void Sync() override {}
  void Close() override {}
  uint64_t Size() const override { return s.size(); }
  void WriteAt(uint64_t offset, std::span<const uint8_t> d) override {
    s.replace(offset, d.size(), reinterpret_cast<const char*>(d.data()), d.size());
  }
  std::string s;
};

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

// How much longer `work(4 * n)` takes than `work(n)`, each the best of three
// runs: about 4 for work linear in n, 16 for quadratic. A ratio, not seconds,
// so it holds under the sanitizers; and the calling thread's CPU time, not the
// wall clock, so time spent waiting for a core on a loaded machine (a load of
// 17 gave 12x for linear work by the wall clock) does not count. `work` must
// run on the calling thread.
inline double GrowthRatio(const std::function<void(int)>& work, int n) {
  const auto cpu_seconds = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  const auto best = [&](int size) {
    double fastest = 1e30;
    for (int run = 0; run < 3; ++run) {
      const double t0 = cpu_seconds();
      work(size);
      fastest = std::min(fastest, cpu_seconds() - t0);
    }
    return fastest;
  };
  const double small = best(n);
  return best(4 * n) / std::max(small, 1e-6);
}

// The message of the ckpt::Error `f` throws; "" when it throws none.
inline std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Creates (or replaces) the file `p` holding one byte.
inline void Touch(const std::string& p) { std::ofstream(p) << "x"; }

// A float32 tensor holding 0, 1, 2, ... in row-major order.
inline Tensor Arange(std::vector<int64_t> shape) {
  Tensor t = Tensor::Zeros(DType::kFloat32, std::move(shape));
  float* p = reinterpret_cast<float*>(t.mutable_data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(i);
  return t;
}

// A snapshot of the whole grid written by one process: model files for dp 0,
// optim files per the grid, scheduler.pt and user_content.pt. Each model file
// holds `floats_per_file` random float32 values; contents depend on `seed`.
inline Snapshot MakeSnapshot(const std::string& name, int64_t step, const RankGrid& grid, int64_t floats_per_file,
                             uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(step));
  auto random = [&](int64_t n) {
    Tensor t = Tensor::Zeros(DType::kFloat32, {n});
    float* p = reinterpret_cast<float*>(t.mutable_data());
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 1000.f;
    return t;
  };
  Snapshot s;
  s.tag = TagName{name, step, static_cast<double>(step * 8), false};
  s.grid = grid;
  for (const auto& f : grid.ModelFiles()) {
    Value m = Value::NewDict();
    m.as_dict().Set("language_model.encoder.layers.0.mlp.dense_h_to_4h.weight", Value(random(floats_per_file)));
    s.files.push_back({f, m, {.weights_only = true}});
  }
  for (const auto& f : grid.OptimFiles()) {
    Value st = Value::NewDict();
    st.as_dict().Set("step", Value(step));
    st.as_dict().Set("exp_avg", Value(random(floats_per_file / 2)));
    Value state = Value::NewDict();
    state.as_dict().items.emplace_back(Value(0), st);
    Value o = Value::NewDict();
    o.as_dict().Set("state", state);
    o.as_dict().Set("param_groups", Value::List({Value::NewDict()}));
    s.files.push_back({f, o, {}});
  }
  SchedulerState sched;
  sched.last_epoch = step;
  s.files.push_back({kSchedulerFile, sched.ToValue(), {}});
  const UserContent uc{.global_step = step, .consumed_samples = static_cast<double>(step * 8), .carried = {}};
  s.files.push_back({kUserContentFile, uc.ToValue(), {}});
  return s;
}

}  // namespace ckpt::testing

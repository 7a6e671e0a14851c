// A LogicalState for the shard tests (reshard, sharded tag, tag compare):
// float32 weights of a model format, one process, no optimizer state, each
// element's value a function of its tensor and index (ValueOf), so a test
// can check any placement element for element without holding a model.
#pragma once

#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/shard/reshard.h"
#include "ckpt/shard/source_registry.h"
#include "ckpt/util/error.h"
#include "ckpt/util/crc32.h"

namespace ckpt::testing {

// A small Megatron-style Llama: 2 layers, 4 heads over 2 KV heads.
inline ModelFormat SmallLlama() {
  ModelFormat f;
  f.hidden = 32, f.ffn = 48, f.heads = 4, f.kv_heads = 2, f.layers = 2, f.vocab_size = 60, f.make_vocab_size_divisible_by = 8;
  return f;
}

// A source holding float32 weights only: element i of tensor `name` is Value(name, i).
class FakeState final : public LogicalState {
 public:
  FakeState(std::string path, const ModelFormat& f) : path_(std::move(path)) {
    layout_.grid = {1, 1, 1, false};
    layout_.stage_bounds = StageBounds(f.layers, 1);
    layout_.format = f;
    layout_.format_from_manifest = true;
    params_ = LogicalParameters(f, 1);
  }
  // Exact in float32, and different for every tensor and element that matters here.
  static float ValueOf(const std::string& name, uint64_t i) {
    return static_cast<float>(Crc32({reinterpret_cast<const uint8_t*>(name.data()), name.size()}) % 1000) * 65536.0f +
           static_cast<float>(i % 65536);
  }
  const std::string& path() const override { return path_; }
  const TagDescription& layout() const override { return layout_; }
  const std::vector<ParamRule>& params() const override { return params_; }
  bool Has(const std::string&, StateField f) const override { return f == StateField::kParam; }
  DType dtype(const std::string&, StateField) const override { return DType::kFloat32; }
  void Read(const std::string& name, StateField, uint64_t begin, std::span<uint8_t> out, Touched*) const override {
    const auto changed = changed_.find(name);  // once per read: no allocation per element
    for (size_t k = 0; k < out.size() / 4; ++k) {
      float v = ValueOf(name, begin + k);
      if (changed != changed_.end())
        if (const auto at = changed->second.find(begin + k); at != changed->second.end()) v = at->second;
      std::memcpy(out.data() + 4 * k, &v, 4);
    }
  }
  // Element `i` of `name` reads as `v` instead.
  void Change(const std::string& name, uint64_t i, float v) { changed_[name][i] = v; }
  const Value& Step(const std::string&) const override { return none_; }
  const Value& ParamGroups() const override { return none_; }
  const std::vector<StateBuffer>& buffers() const override { return buffers_; }
  bool model_dict_ordered() const override { return true; }
  int64_t step() const override { return 3; }
  double consumed_samples() const override { return 24; }
  const std::optional<TensorFingerprints>& recorded_fingerprints() const override { return fingerprints_; }
  std::optional<Value> TagFile(const std::string&) const override { return std::nullopt; }

 private:
  std::string path_;
  TagDescription layout_;
  std::vector<ParamRule> params_;
  Value none_;
  std::vector<StateBuffer> buffers_;
  std::optional<TensorFingerprints> fingerprints_;
  std::map<std::string, std::map<uint64_t, float>> changed_;
};

// The registry entry of the fake (ckpt/shard/source_registry.h), "fake": a
// regular file named *.fake stands for a FakeState of SmallLlama() at that path.
inline SourceKind FakeSourceKind() {
  SourceKind k;
  k.name = "fake";
  k.description = "the shard tests' fake state (a *.fake file)";
  k.detect = [](Env* env, const std::string& path) { return path.ends_with(".fake") && env->Exists(path) && !env->IsDirectory(path); };
  k.open = [](Env* env, const std::string& path, const SourceOptions&) {
    if (!env->Exists(path)) throw Error(path + ": no such file");
    OpenedSource s;
    s.state = std::make_unique<FakeState>(path, SmallLlama());
    return s;
  };
  return k;
}

// Writes `src` as a tag at `dst` in the parallel layout of `a` (its dst
// replaced), as ckpt-reshard would, and returns the summary.
inline ReshardSummary WriteFake(const LogicalState& src, const std::string& dst, ReshardArgs a) {
  a.dst = dst;
  a.threads = 1;
  ReshardSummary sum;
  sum.src_tag = src.path();
  return WriteInLayout(src, "", a, Env::Default(), [](const std::string&) {}, std::chrono::steady_clock::now(), sum);
}

}  // namespace ckpt::testing

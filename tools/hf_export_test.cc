#include "tools/hf_export.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "ckpt/pt/dtype_cast.h"
#include "ckpt/spec/lora.h"
#include "ckpt/spec/partition.h"
#include "ckpt/testing/test_util.h"

namespace tools {
namespace {

using ckpt::DType;
using ckpt::testing::TempDir;

// A tiny HF-style Llama holding base and LoRA adapters (rank 4, alpha 8: scale 2) on qkv_proj
// and down_proj, whose every element is a function of its tensor and index, in `dtype`
// (adapters float32, as NxD keeps them).
class LoraState final : public ckpt::LogicalState {
 public:
  explicit LoraState(DType base) : base_(base) {
    ckpt::ModelFormat& f = layout_.format;
    f.family = ckpt::ModelFamily::kHfLlama, f.hidden = 32, f.ffn = 48, f.heads = 8, f.kv_heads = 2, f.layers = 1, f.vocab_size = 64;
    f.fuse_qkv = false, f.qkv_linear = true;
    f.lora.rank = 4, f.lora.alpha = 8, f.lora.targets = {"qkv_proj", "down_proj"}, f.lora.saved = ckpt::LoraSaved::kBaseAndAdapter;
    layout_.stage_bounds = {0, 1};
    params_ = ckpt::LogicalParameters(f, 1);
  }
  static float Value(const std::string& name, uint64_t i) {
    const double salt = static_cast<double>(std::hash<std::string>{}(name) % 1000);
    return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + salt) * (ckpt::IsLoraAdapterName(name) ? 0.5 : 1.0));
  }
  const std::string& path() const override { return path_; }
  const ckpt::TagDescription& layout() const override { return layout_; }
  const std::vector<ckpt::ParamRule>& params() const override { return params_; }
  bool Has(const std::string&, ckpt::StateField f) const override { return f == ckpt::StateField::kParam; }
  DType dtype(const std::string& name, ckpt::StateField) const override {
    return ckpt::IsLoraAdapterName(name) ? DType::kFloat32 : base_;
  }
  void Read(const std::string& name, ckpt::StateField f, uint64_t begin, std::span<uint8_t> out, ckpt::Touched*) const override {
    const DType d = dtype(name, f);
    for (uint64_t i = 0; i < out.size() / ckpt::ElementSize(d); ++i) {
      const float v = Value(name, begin + i);
      if (d == DType::kFloat32) std::memcpy(out.data() + 4 * i, &v, 4);
      else {
        const uint16_t b = ckpt::FloatToBFloat16(v);
        std::memcpy(out.data() + 2 * i, &b, 2);
      }
    }
  }
  const ckpt::Value& Step(const std::string&) const override { return none_value_; }
  const ckpt::Value& ParamGroups() const override { return none_value_; }
  const std::vector<ckpt::StateBuffer>& buffers() const override { return buffers_; }
  bool model_dict_ordered() const override { return true; }
  int64_t step() const override { return 2; }
  double consumed_samples() const override { return 0; }
  const std::optional<ckpt::TensorFingerprints>& recorded_fingerprints() const override { return fingerprints_; }
  std::optional<ckpt::Value> TagFile(const std::string&) const override { return std::nullopt; }

 private:
  DType base_;
  std::string path_ = "lora_state";
  ckpt::TagDescription layout_;
  std::vector<ckpt::ParamRule> params_;
  ckpt::Value none_value_;
  std::vector<ckpt::StateBuffer> buffers_;
  std::optional<ckpt::TensorFingerprints> fingerprints_;
};

std::string Bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// down_proj's merged element (row i, column j) in float64: W + (B A) * 2, B [32, 4], A [4, 48].
double Exact(DType base, uint64_t i, uint64_t j, double* magnitude) {
  const std::string m = "model.layers.0.mlp.down_proj.";
  double w = LoraState::Value(m + "base_layer.weight", i * 48 + j), dot = 0, abs = 0;
  if (base == DType::kBFloat16) w = ckpt::RoundToBFloat16(static_cast<float>(w));
  for (uint64_t k = 0; k < 4; ++k) {
    const double b = LoraState::Value(m + "lora_B.weight", i * 4 + k), a = LoraState::Value(m + "lora_A.weight", k * 48 + j);
    dot += b * a, abs += std::fabs(b * a);
  }
  *magnitude = abs * 2;
  return w + dot * 2;
}

// Writes the folder with `chunk`-byte chunks; returns model.safetensors' bytes.
std::string Export(const LoraState& s, const TempDir& d, const std::string& name, size_t chunk) {
  ckpt::Env::Default()->CreateDirs(d / name);
  WriteHfFolder(s, d / name, {.chunk = chunk}, ckpt::Env::Default());
  return Bytes(d / name + "/model.safetensors");
}

// A chunk that ends mid-row (down_proj's rows are 48 elements, its chunks 25 or 50) merges the
// same rows of B as whole rows do: the folder is byte for byte the one of large chunks.
TEST(HfExportLora, AChunkEndingMidRowMergesAsWholeRowsDo) {
  for (DType base : {DType::kFloat32, DType::kBFloat16}) {
    const LoraState s(base);
    TempDir d("hf_export_lora");
    const std::string whole = Export(s, d, "whole", size_t{1} << 20), cut = Export(s, d, "cut", 100);
    EXPECT_EQ(whole.size(), cut.size());
    EXPECT_TRUE(whole == cut) << ckpt::DTypeName(base);
  }
}

// The merge is computed in float32 and rounded once to the base's dtype. Against the float64
// merge of the same (bfloat16-rounded) base: float32 adds at most gamma_4 * sum_k |B_ik A_kj| * 2
// (gamma_4 = 4u / (1 - 4u), u = 2^-24) plus u |result|; rounding to bfloat16 at most 2^-8 |y|
// (8 significant bits). In float32 the bound is the first two terms alone.
TEST(HfExportLora, MergesInFloat32AndRoundsOnceToTheBasesDtype) {
  for (DType base : {DType::kFloat32, DType::kBFloat16}) {
    const LoraState s(base);
    TempDir d("hf_export_lora");
    const std::string file = Export(s, d, "out", size_t{1} << 20);
    uint64_t header = 0;
    std::memcpy(&header, file.data(), 8);
    const std::string text = file.substr(8, header);
    const std::string key = "\"model.layers.0.mlp.down_proj.weight\":{\"dtype\":\"";
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos);
    const size_t offsets = text.find("\"data_offsets\":[", at) + 16;
    const uint64_t start = 8 + header + std::stoull(text.substr(offsets));
    const double u = std::ldexp(1.0, -24), gamma = 4 * u / (1 - 4 * u), round = base == DType::kBFloat16 ? std::ldexp(1.0, -8) : 0.0;
    int moved = 0;
    for (uint64_t i = 0; i < 32; ++i)
      for (uint64_t j = 0; j < 48; ++j) {
        const uint64_t e = i * 48 + j;
        float got;
        if (base == DType::kFloat32) {
          std::memcpy(&got, file.data() + start + 4 * e, 4);
        } else {
          uint16_t b;
          std::memcpy(&b, file.data() + start + 2 * e, 2);
          got = ckpt::BFloat16ToFloat(b);
        }
        double magnitude = 0;
        const double exact = Exact(base, i, j, &magnitude);
        const double e32 = gamma * magnitude + u * (std::fabs(exact) + gamma * magnitude);
        ASSERT_LE(std::fabs(got - exact), e32 + round * (std::fabs(exact) + e32)) << ckpt::DTypeName(base) << " " << i << "," << j;
        const double w = LoraState::Value("model.layers.0.mlp.down_proj.base_layer.weight", e);
        moved += std::fabs(got - w) > 1e-2;
      }
    EXPECT_GT(moved, 32 * 48 / 2) << "the adapter changes most elements";
  }
}

}  // namespace
}  // namespace tools

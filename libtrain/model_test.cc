#include "libtrain/model.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "ckpt/pt/dtype_cast.h"
#include "ckpt/store/snapshot.h"
#include "ckpt/testing/test_util.h"

namespace train {
namespace {

struct StepResult {
  std::vector<std::vector<float>> grads;
  size_t activation_bytes;
  float loss;
};

StepResult TrainStep(const std::string& recompute, int64_t kv_heads, bool gpt = false) {
  ModelConfig c;
  c.vocab = 64, c.hidden = 32, c.ffn = 48, c.heads = 4, c.kv_heads = kv_heads, c.layers = 3;
  if (gpt) {  // with dropout at every place: recompute must regenerate the same masks
    c.layernorm = c.gelu = c.bias = c.learned_positions = c.tied_output = true, c.max_positions = 16;
    c.hidden_dropout = c.attention_dropout = c.ffn_dropout = 0.2f;
  }
  c.recompute = recompute;
  Model m(c);
  m.InitWeights();
  std::mt19937 rng(3);
  const int64_t B = 2, T = 16;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 64);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % 64);
  m.ZeroGrad();
  StepResult r;
  r.loss = m.Forward(tokens.data(), targets.data(), B, T, /*dropout_key=*/99);
  r.activation_bytes = m.activation_bytes();
  m.Backward();
  for (const auto& p : m.layout()) {
    const float* g = reinterpret_cast<const float*>(m.grad(p.name).data());
    r.grads.emplace_back(g, g + m.grad(p.name).numel());
  }
  return r;
}

void ExpectIdentical(const StepResult& r, const StepResult& none) {
  EXPECT_EQ(r.loss, none.loss);
  ASSERT_EQ(r.grads.size(), none.grads.size());
  for (size_t i = 0; i < none.grads.size(); ++i)
    EXPECT_EQ(std::memcmp(r.grads[i].data(), none.grads[i].data(), none.grads[i].size() * sizeof(float)), 0) << i;
}

TEST(Recompute, GradientsAreBitIdenticalAndMemoryDrops) {
  for (int64_t kv : {4, 2}) {
    SCOPED_TRACE(kv);
    const StepResult none = TrainStep("", kv), selective = TrainStep("selective", kv), full = TrainStep("full", kv);
    for (const StepResult* r : {&selective, &full}) ExpectIdentical(*r, none);
    // Selective drops the [B, heads, T, T] probabilities; full keeps one input per layer.
    EXPECT_EQ(none.activation_bytes - selective.activation_bytes, size_t{3} * 2 * 4 * 16 * 16 * sizeof(float));
    EXPECT_LT(full.activation_bytes, selective.activation_bytes / 2);
  }
}

TEST(Recompute, GptStyleWithDropoutGradientsAreBitIdenticalToo) {
  const StepResult none = TrainStep("", 4, true), selective = TrainStep("selective", 4, true),
                   full = TrainStep("full", 4, true);
  for (const StepResult* r : {&selective, &full}) ExpectIdentical(*r, none);
  EXPECT_LT(full.activation_bytes, selective.activation_bytes / 2);
}

TEST(Model, StateDictsOfOtherFloatTypesLoadAndOthersAreNamed) {
  ModelConfig c;
  c.vocab = 16, c.hidden = 8, c.ffn = 8, c.heads = 2, c.kv_heads = 2, c.layers = 1;
  c.bf16_params = true;
  Model m(c);
  m.InitWeights();
  ckpt::Value sd = ckpt::CopyForSnapshot(m.StateDict(), nullptr, ckpt::DType::kFloat64);
  const std::string emb = "language_model.embedding.word_embeddings.weight";
  reinterpret_cast<double*>(sd.as_dict().Find(emb)->as_tensor().mutable_data())[0] = 1.0 + 1.0 / 1024;  // not a bfloat16
  Model loaded(c);
  loaded.LoadStateDict(sd);
  EXPECT_EQ(reinterpret_cast<const float*>(loaded.param(emb).data())[0], ckpt::RoundToBFloat16(1.0f + 1.0f / 1024));
  sd.as_dict().Set(emb, ckpt::Value(ckpt::Tensor::Zeros(ckpt::DType::kInt64, {16, 8})));
  EXPECT_EQ(ckpt::testing::ErrorOf([&] { loaded.LoadStateDict(sd); }),
            "state dict '" + emb + "' is int64; parameters load from float32, float64 or bfloat16");
}

TEST(Model, LearnedPositionsRefuseLongerSequences) {
  ModelConfig c;
  c.vocab = 16, c.hidden = 8, c.ffn = 8, c.heads = 2, c.kv_heads = 2, c.layers = 1;
  c.learned_positions = true, c.max_positions = 2;
  Model m(c);
  const int32_t tokens[3] = {1, 2, 3}, targets[3] = {2, 3, 4};
  EXPECT_EQ(ckpt::testing::ErrorOf([&] { m.Forward(tokens, targets, 1, 3); }),
            "sequence length 3 is longer than max_position_embeddings (2)");
}

TEST(Model, TokensOutsideTheVocabularyAreNamed) {
  ModelConfig c;
  c.vocab = 16, c.hidden = 8, c.ffn = 8, c.heads = 2, c.kv_heads = 2, c.layers = 1;
  Model m(c);
  const int32_t tokens[2] = {3, 16}, targets[2] = {1, 2};
  try {
    m.Forward(tokens, targets, 1, 2);
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_STREQ(e.what(), "token id 16 at position 1 is outside the vocabulary of 16");
  }
}

}  // namespace
}  // namespace train

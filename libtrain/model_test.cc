#include "libtrain/model.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace train {
namespace {

struct StepResult {
  std::vector<std::vector<float>> grads;
  size_t activation_bytes;
  float loss;
};

StepResult TrainStep(const std::string& recompute, int64_t kv_heads) {
  ModelConfig c;
  c.vocab = 64, c.hidden = 32, c.ffn = 48, c.heads = 4, c.kv_heads = kv_heads, c.layers = 3;
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
  r.loss = m.Forward(tokens.data(), targets.data(), B, T);
  r.activation_bytes = m.activation_bytes();
  m.Backward();
  for (const auto& p : m.layout()) {
    const float* g = reinterpret_cast<const float*>(m.grad(p.name).data());
    r.grads.emplace_back(g, g + m.grad(p.name).numel());
  }
  return r;
}

TEST(Recompute, GradientsAreBitIdenticalAndMemoryDrops) {
  for (int64_t kv : {4, 2}) {
    SCOPED_TRACE(kv);
    const StepResult none = TrainStep("", kv), selective = TrainStep("selective", kv), full = TrainStep("full", kv);
    for (const StepResult* r : {&selective, &full}) {
      EXPECT_EQ(r->loss, none.loss);
      ASSERT_EQ(r->grads.size(), none.grads.size());
      for (size_t i = 0; i < none.grads.size(); ++i)
        EXPECT_EQ(std::memcmp(r->grads[i].data(), none.grads[i].data(), none.grads[i].size() * sizeof(float)), 0) << i;
    }
    // Selective drops the [B, heads, T, T] probabilities; full keeps one input per layer.
    EXPECT_EQ(none.activation_bytes - selective.activation_bytes, size_t{3} * 2 * 4 * 16 * 16 * sizeof(float));
    EXPECT_LT(full.activation_bytes, selective.activation_bytes / 2);
  }
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

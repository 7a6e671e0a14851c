#include "libtrain/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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


// A tiny HF-style Mixtral (NxDT's MixtralForCausalLM): 3 layers, MoE every
// `frequency` layers (0-based layer % frequency == 0), 4 experts, top 2.
ModelConfig TinyMixtral(int64_t frequency, double capacity_factor, double aux_coef) {
  ModelConfig c;
  c.family = ckpt::ModelFamily::kHfLlama;
  c.vocab = 32, c.hidden = 16, c.ffn = 24, c.heads = 4, c.kv_heads = 2, c.layers = 3;
  c.experts = 4, c.moe_top_k = 2, c.moe_frequency = frequency;
  c.capacity_factor = capacity_factor, c.router_aux_loss_coef = aux_coef;
  c.init_std = 0.3f;  // gradients well above float32's rounding of the loss, for the differences below
  return c;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
  int64_t B = 2, T = 8;
};
Batch MakeBatch() {
  Batch b;
  std::mt19937 rng(5);
  for (int64_t i = 0; i < b.B * b.T; ++i) b.tokens.push_back(static_cast<int32_t>(rng() % 32)), b.targets.push_back(static_cast<int32_t>(rng() % 32));
  return b;
}

TEST(MoeModel, LayersFrequencyPicksAreMoeWithNxdShapes) {
  Model m(TinyMixtral(2, 0, 0));
  for (int l : {0, 2}) {
    const std::string at = "model.layers." + std::to_string(l) + ".mlp.";
    EXPECT_EQ(m.param(at + "router.linear_router.weight").shape(), (std::vector<int64_t>{4, 16}));
    EXPECT_EQ(m.param(at + "expert_mlps.mlp_op.gate_up_proj.weight").shape(), (std::vector<int64_t>{4, 16, 48}));
    EXPECT_EQ(m.param(at + "expert_mlps.mlp_op.down_proj.weight").shape(), (std::vector<int64_t>{4, 24, 16}));
  }
  EXPECT_EQ(m.param("model.layers.1.mlp.gate_up_proj.weight").shape(), (std::vector<int64_t>{48, 16}));
  EXPECT_NE(ckpt::testing::ErrorOf([&] { m.param("model.layers.1.mlp.router.linear_router.weight"); }), "");
}

// The loss is cross-entropy plus coef * load_balancing_loss_func of both MoE
// layers' routing together; every gradient (router, experts, and through them
// the attention below) is its derivative: central differences on the
// elements of largest gradient agree within 3%.
TEST(MoeModel, GradientsAreTheLossesDerivativeAuxiliaryLossIncluded) {
  for (double capacity : {0.0, 1.0}) {
    SCOPED_TRACE(capacity);
    Model m(TinyMixtral(2, capacity, 0.5));
    m.InitWeights();
    const Batch b = MakeBatch();
    m.ZeroGrad();
    const float loss = m.Forward(b.tokens.data(), b.targets.data(), b.B, b.T);
    m.Backward();
    for (const std::string name : {"model.layers.0.mlp.router.linear_router.weight", "model.layers.2.mlp.router.linear_router.weight",
                                   "model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight",
                                   "model.layers.2.mlp.expert_mlps.mlp_op.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"}) {
      SCOPED_TRACE(name);
      float* w = reinterpret_cast<float*>(m.param(name).mutable_data());
      const float* g = reinterpret_cast<const float*>(m.grad(name).data());
      const int64_t n = m.param(name).numel();
      const int64_t i = std::max_element(g, g + n, [](float a, float c) { return std::fabs(a) < std::fabs(c); }) - g;
      const float keep = w[i], eps = 1e-2f;
      w[i] = keep + eps;
      const double up = m.Forward(b.tokens.data(), b.targets.data(), b.B, b.T);
      w[i] = keep - eps;
      const double down = m.Forward(b.tokens.data(), b.targets.data(), b.B, b.T);
      w[i] = keep;
      EXPECT_NEAR((up - down) / (2 * eps), g[i], 0.03 * std::fabs(g[i])) << "element " << i << " of loss " << loss;
    }
  }
}

TEST(MoeModel, AuxiliaryLossAndTokenDroppingChangeTheLoss) {
  const Batch b = MakeBatch();
  auto loss_of = [&](double capacity, double coef) {
    Model m(TinyMixtral(1, capacity, coef));
    m.InitWeights();
    return m.Forward(b.tokens.data(), b.targets.data(), b.B, b.T);
  };
  const float plain = loss_of(0, 0), with_aux = loss_of(0, 0.5), dropping = loss_of(0.5, 0);
  // Three MoE layers' routing together: E / k * sum_e share_e * mean affinity_e, in (0, E / k]; 1 when balanced.
  EXPECT_GT((with_aux - plain) / 0.5, 0.5);
  EXPECT_LE((with_aux - plain) / 0.5, 2.0);
  EXPECT_NE(dropping, plain);
  EXPECT_EQ(loss_of(2.0, 0), plain);  // capacity_factor E / k: no token dropped
}

TEST(MoeModel, FullRecomputeGradientsAreBitIdentical) {
  const Batch b = MakeBatch();
  auto grads_of = [&](const std::string& recompute) {
    ModelConfig c = TinyMixtral(2, 1.0, 0.5);
    c.recompute = recompute;
    Model m(c);
    m.InitWeights();
    m.ZeroGrad();
    m.Forward(b.tokens.data(), b.targets.data(), b.B, b.T);
    m.Backward();
    return std::vector<float>(m.flat_grads(), m.flat_grads() + m.flat_size());
  };
  EXPECT_EQ(grads_of("full"), grads_of(""));
}

// The Megatron-style Mixtral (NeuronSwitchMLP) under its names, in the layers
// whose 1-based layer_number % frequency == 0: frequency 2 makes layer 1 MoE.
TEST(MoeModel, MegatronStyleMoeLayersAreThe1BasedOnes) {
  ModelConfig c = TinyMixtral(2, 0, 0);
  c.family = ckpt::ModelFamily::kMegatron;
  Model m(c);
  const std::string at = "language_model.encoder.layers.";
  EXPECT_EQ(m.param(at + "1.mlp.moe.router.linear_router.weight").shape(), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(m.param(at + "1.mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight").shape(), (std::vector<int64_t>{4, 16, 48}));
  for (int l : {0, 2}) EXPECT_EQ(m.param(at + std::to_string(l) + ".mlp.dense_h_to_4h.weight").shape(), (std::vector<int64_t>{48, 16}));
}

TEST(MoeModel, WhatIsNotBuiltIsRefused) {
  ModelConfig c = TinyMixtral(1, 0, 0);
  c.moe_top_k = 1;
  EXPECT_NE(ckpt::testing::ErrorOf([&] { Model m(c); }).find("normalize_top_k_affinities needs top_k > 1"), std::string::npos);
}

}  // namespace
}  // namespace train

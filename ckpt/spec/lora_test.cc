#include "ckpt/spec/lora.h"

#include <gtest/gtest.h>

#include "ckpt/spec/model_family.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;

// The lora_config NxD saved in tests/data/upstream/nxd_lora (config.py
// selected_fields_to_save of the shipped config's peft block).
Value ShippedConfig(bool save_base = true, bool merge = false) {
  Value v = Value::NewDict();
  Dict& d = v.as_dict();
  d.Set("lora_rank", 16), d.Set("target_modules", Value::List({"qkv_proj"})), d.Set("lora_alpha", 32);
  d.Set("lora_dropout", 0.05), d.Set("bias", "none"), d.Set("use_rslora", false), d.Set("init_lora_weights", "default");
  d.Set("modules_to_save", Value()), d.Set("merge_lora", merge), d.Set("save_lora_base", save_base);
  d.Set("save_lora_config_adapter", true), d.Set("r", 16);
  return v;
}

// The fixture's model: hidden 32, 8 heads of 4, 2 KV heads replicated x2 over tp 4 (Trn1), qkv_linear, not fused.
ModelFormat Tiny(std::vector<std::string> targets, LoraSaved saved) {
  ModelFormat f;
  f.family = ModelFamily::kHfLlama;
  f.hidden = 32, f.ffn = 48, f.heads = 8, f.kv_heads = 2, f.layers = 2, f.vocab_size = 64;
  f.fuse_qkv = false, f.qkv_linear = true, f.kv_size_multiplier = 2, f.hw_backend = HwBackend::kTrn1;
  f.lora.rank = 16, f.lora.alpha = 32, f.lora.targets = std::move(targets), f.lora.saved = saved;
  return f;
}

const ParamRule& Named(const std::vector<ParamRule>& t, const std::string& name) {
  for (const auto& r : t)
    if (r.name == name) return r;
  throw Error("no " + name);
}

TEST(Lora, ReadsNxdConfigAndItsSaveMode) {
  LoraFormat l = LoraFormatOfConfig(ShippedConfig(), "f.pt");
  EXPECT_EQ(l.rank, 16);
  EXPECT_EQ(l.alpha, 32.0);
  EXPECT_EQ(l.targets, std::vector<std::string>{"qkv_proj"});
  EXPECT_EQ(l.saved, LoraSaved::kBaseAndAdapter);
  EXPECT_EQ(LoraScale(l), 2.0);
  EXPECT_EQ(LoraFormatOfConfig(ShippedConfig(false, true), "f.pt").saved, LoraSaved::kAdapterOnly);
  EXPECT_EQ(LoraFormatOfConfig(ShippedConfig(true, true), "f.pt").saved, LoraSaved::kMerged);
  l.use_rslora = true;
  EXPECT_EQ(LoraScale(l), 8.0);  // 32 / sqrt(16)
  EXPECT_EQ(LoraFormatOfJson(LoraToJson(l), "m"), l);
}

TEST(Lora, RefusesWhatItDoesNotLayOut) {
  auto with = [](const char* key, Value v) {
    Value c = ShippedConfig();
    c.as_dict().Set(key, std::move(v));
    return ErrorOf([&] { LoraFormatOfConfig(c, "f.pt"); });
  };
  EXPECT_NE(with("target_modules", Value::List({"lm_head"})).find("'lm_head'"), std::string::npos);
  EXPECT_NE(with("target_modules", Value::List({"o_proj", "o_proj"})).find("twice"), std::string::npos);
  EXPECT_NE(with("r", 8).find("'r' differs"), std::string::npos);
  EXPECT_NE(with("lora_rank", 0).find("'lora_rank'"), std::string::npos);
  EXPECT_NE(with("lora_alpha", "32").find("'lora_alpha'"), std::string::npos);
  EXPECT_NE(with("bias", "all").find("'bias'"), std::string::npos);
  EXPECT_NE(with("modules_to_save", Value::List({"lm_head"})).find("modules_to_save"), std::string::npos);
  EXPECT_NE(ErrorOf([] { LoraFormatOfConfig(Value(3), "f.pt"); }).find("f.pt: 'lora_config' is not a dict"), std::string::npos);
}

// The shipped config: qkv_proj's base renamed, lora_A whole on every rank, lora_B's rows cut as the base's Q, K and V.
TEST(Lora, GqaAdaptersFollowTheBaseRows) {
  const ModelFormat f = Tiny({"qkv_proj"}, LoraSaved::kBaseAndAdapter);
  const auto t = LogicalParameters(f, 4);
  const std::string p = "model.layers.0.self_attn.qkv_proj.";
  std::vector<std::string> names;
  for (const auto& r : t)
    if (r.name.starts_with(p)) names.push_back(r.name.substr(p.size()));
  EXPECT_EQ(names, (std::vector<std::string>{"base_layer.weight_q", "base_layer.weight_k", "base_layer.weight_v", "lora_A.weight",
                                             "lora_B.weight_q", "lora_B.weight_k", "lora_B.weight_v"}));
  EXPECT_EQ(LocalShape(Named(t, p + "lora_A.weight"), f, 4, 3), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(LocalShape(Named(t, p + "lora_B.weight_k"), f, 4, 1), (std::vector<int64_t>{4, 16}));
  const auto& k = Named(t, p + "lora_B.weight_k");
  const auto& q = Named(t, p + "lora_B.weight_q");
  for (int r = 0; r < 4; ++r) {  // Trn1: rank r holds KV head r % 2, queries (r % 2) * 2 + r / 2
    EXPECT_EQ(LocalRuns(k, f, 4, r), LocalRuns(Named(t, p + "base_layer.weight_k"), f, 4, r));
    EXPECT_EQ(LocalRuns(q, f, 4, r), LocalRuns(Named(t, p + "base_layer.weight_q"), f, 4, r));
    EXPECT_EQ(LocalRuns(k, f, 4, r).front().logical, (r % 2) * 4);
  }
  EXPECT_EQ(t.size(), LogicalParameters(Tiny({}, LoraSaved::kMerged), 4).size() + 2 * 4);
}

// Row-parallel targets: lora_A cut by the base's columns, lora_B whole; column-parallel: the reverse.
TEST(Lora, RowAndColumnParallelAdapters) {
  const ModelFormat f = Tiny({"o_proj", "gate_up_proj", "down_proj"}, LoraSaved::kBaseAndAdapter);
  const auto t = LogicalParameters(f, 4);
  const std::string l = "model.layers.1.";
  EXPECT_EQ(LocalShape(Named(t, l + "self_attn.o_proj.lora_A.weight"), f, 4, 2), (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(LocalShape(Named(t, l + "self_attn.o_proj.lora_B.weight"), f, 4, 2), (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(LocalShape(Named(t, l + "mlp.down_proj.lora_A.weight"), f, 4, 2), (std::vector<int64_t>{16, 12}));
  EXPECT_EQ(LocalShape(Named(t, l + "mlp.gate_up_proj.lora_A.weight"), f, 4, 2), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(LocalShape(Named(t, l + "mlp.gate_up_proj.lora_B.weight"), f, 4, 2), (std::vector<int64_t>{24, 16}));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(LocalRuns(Named(t, l + "self_attn.o_proj.lora_A.weight"), f, 4, r), LocalRuns(Named(t, l + "self_attn.o_proj.base_layer.weight"), f, 4, r));
    EXPECT_EQ(LocalRuns(Named(t, l + "mlp.gate_up_proj.lora_B.weight"), f, 4, r),
              LocalRuns(Named(t, l + "mlp.gate_up_proj.base_layer.weight"), f, 4, r));
  }
  EXPECT_EQ(Named(t, l + "mlp.down_proj.lora_B.weight").split, SplitDim::kReplicated);
}

TEST(Lora, SaveModesChooseTheTable) {
  const auto adapters = LogicalParameters(Tiny({"qkv_proj"}, LoraSaved::kAdapterOnly), 4);
  ASSERT_EQ(adapters.size(), 2u * 4u);
  for (const auto& r : adapters) EXPECT_TRUE(IsLoraAdapterName(r.name)) << r.name;
  const auto merged = LogicalParameters(Tiny({"qkv_proj"}, LoraSaved::kMerged), 4);
  ModelFormat plain = Tiny({}, LoraSaved::kMerged);
  plain.lora = {};
  ASSERT_EQ(merged.size(), LogicalParameters(plain, 4).size());
  EXPECT_EQ(WithoutBaseLayer("model.layers.0.self_attn.qkv_proj.base_layer.weight_q"), "model.layers.0.self_attn.qkv_proj.weight_q");
  ModelFormat stride3 = Tiny({"qkv_proj"}, LoraSaved::kBaseAndAdapter);
  stride3.qkv_linear = false, stride3.kv_size_multiplier = 1, stride3.kv_heads = 8;
  EXPECT_NE(stride3.CheckTensorParallel(4).find("qkv_linear"), std::string::npos);
}

TEST(Lora, MergeSourcesOfATargetedBaseTensor) {
  const ModelFormat f = Tiny({"qkv_proj", "gate_up_proj"}, LoraSaved::kBaseAndAdapter);
  const auto q = LoraMergeOf(f, "model.layers.1.self_attn.qkv_proj.weight_k");
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->base, "model.layers.1.self_attn.qkv_proj.base_layer.weight_k");
  EXPECT_EQ(q->a, "model.layers.1.self_attn.qkv_proj.lora_A.weight");
  EXPECT_EQ(q->b, "model.layers.1.self_attn.qkv_proj.lora_B.weight_k");
  EXPECT_EQ(LoraMergeOf(f, "model.layers.0.mlp.gate_up_proj.weight")->b, "model.layers.0.mlp.gate_up_proj.lora_B.weight");
  // every source it names is a tensor of the tag's table
  const auto table = LogicalParameters(f, 4);
  for (const std::string& n : {q->base, q->a, q->b}) EXPECT_NO_THROW(Named(table, n)) << n;
  EXPECT_FALSE(LoraMergeOf(f, "model.layers.0.mlp.down_proj.weight"));  // not a target
  EXPECT_FALSE(LoraMergeOf(f, "model.embed_tokens.weight"));
  EXPECT_FALSE(LoraMergeOf(Tiny({"qkv_proj"}, LoraSaved::kMerged), "model.layers.0.self_attn.qkv_proj.weight_q"));
  EXPECT_EQ(LoraHfUnsupported(f), "");
  EXPECT_NE(LoraHfUnsupported(Tiny({"qkv_proj"}, LoraSaved::kAdapterOnly)).find("needs the base weights"), std::string::npos);
}

TEST(Lora, AnAdapterOnlyTagNamesItsAdaptersButDoesNotMerge) {
  const ModelFormat f = Tiny({"qkv_proj", "down_proj"}, LoraSaved::kAdapterOnly);
  EXPECT_FALSE(LoraMergeOf(f, "model.layers.0.self_attn.qkv_proj.weight_q"));  // no base in the tag to merge into
  const auto q = LoraAdaptersOf(f, "model.layers.0.self_attn.qkv_proj.weight_q");
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->b, "model.layers.0.self_attn.qkv_proj.lora_B.weight_q");
  EXPECT_EQ(LoraAdaptersOf(f, "model.layers.1.mlp.down_proj.weight")->a, "model.layers.1.mlp.down_proj.lora_A.weight");
  EXPECT_FALSE(LoraAdaptersOf(f, "model.layers.1.mlp.gate_up_proj.weight"));
  EXPECT_FALSE(LoraAdaptersOf(Tiny({"qkv_proj"}, LoraSaved::kMerged), "model.layers.0.self_attn.qkv_proj.weight_q"));
  EXPECT_EQ(LoraAdaptersOf(Tiny({"qkv_proj"}, LoraSaved::kBaseAndAdapter), "model.layers.0.self_attn.qkv_proj.weight_v")->b,
            "model.layers.0.self_attn.qkv_proj.lora_B.weight_v");
}

// NxD saves the training's optimizer in every mode: an adapter-only tag's lists base and adapters, in module order.
TEST(Lora, AnAdapterOnlyTagsOptimizerListsTheTraining) {
  const ModelFormat only = Tiny({"qkv_proj"}, LoraSaved::kAdapterOnly), both = Tiny({"qkv_proj"}, LoraSaved::kBaseAndAdapter);
  const auto model = LogicalParameters(only, 4), optimizer = OptimizerParameters(only, 4), trained = LogicalParameters(both, 4);
  ASSERT_EQ(model.size(), 2u * 4);  // per layer: lora_A, lora_B q, k, v
  ASSERT_EQ(optimizer.size(), trained.size());
  for (size_t i = 0; i < trained.size(); ++i) EXPECT_EQ(optimizer[i].name, trained[i].name) << i;
  EXPECT_EQ(OptimizerParameters(both, 4).size(), trained.size());
  const ModelFormat merged = Tiny({"qkv_proj"}, LoraSaved::kMerged);
  EXPECT_EQ(OptimizerParameters(merged, 4).size(), LogicalParameters(merged, 4).size());
}

TEST(Lora, ReadsLoraDropout) {
  EXPECT_EQ(LoraDropoutOfConfig(ShippedConfig(), "f.pt"), 0.05);
  Value c = ShippedConfig();
  c.as_dict().Set("lora_dropout", 0);
  EXPECT_EQ(LoraDropoutOfConfig(c, "f.pt"), 0.0);
  for (Value bad : {Value(1.5), Value(-0.1), Value("0.1")}) {
    c.as_dict().Set("lora_dropout", bad);
    EXPECT_NE(ErrorOf([&] { LoraFormatOfConfig(c, "f.pt"); }).find("f.pt: 'lora_config' 'lora_dropout' is not a number from 0 up to 1"),
              std::string::npos);
  }
}

TEST(Lora, DescribesItself) {
  EXPECT_EQ(DescribeLora(Tiny({"qkv_proj", "o_proj"}, LoraSaved::kBaseAndAdapter).lora),
            "LoRA rank 16, alpha 32 (scale 2) on qkv_proj, o_proj; base and adapters");
}

}  // namespace
}  // namespace ckpt

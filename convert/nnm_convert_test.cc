#include "convert/nnm_convert.h"

#include <gtest/gtest.h>

#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace convert {
namespace {

using ckpt::Tensor;
using ckpt::Value;
using ckpt::testing::Arange;
using ckpt::testing::ErrorOf;

constexpr int64_t H = 4;

// One stage's NNM state dict ("model." keys, local layer numbers) with
// `layers` layers, in module order.
Value StageDict(int layers, bool first, bool last) {
  Value sd = Value::NewDict(true);
  auto add = [&](const std::string& k, std::vector<int64_t> shape) { sd.as_dict().Set("model." + k, Value(Arange(shape))); };
  if (first) add("language_model.embedding.word_embeddings.weight", {16, H});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "language_model.encoder.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H});
    add(p + "self_attention.query_key_value.weight", {3 * H, H});
    add(p + "self_attention.core_attention.rotary_emb.inv_freq", {H / 2});
    add(p + "self_attention.dense.weight", {H, H});
    add(p + "post_attention_layernorm.weight", {H});
    add(p + "mlp.dense_h_to_4h.weight", {4 * H, H});
    add(p + "mlp.dense_4h_to_h.weight", {H, 2 * H});
  }
  if (last) {
    add("language_model.encoder.final_layernorm.weight", {H});
    add("language_model.output_layer.weight", {16, H});
  }
  sd.as_dict().Set("untrained_buffer_names", Value::List({Value("x")}));
  return sd;
}

// torch.optim state for a state dict: group 0 = weights, group 1 = norms, in
// module order; exp_avg of id i holds i everywhere.
Value OptimizerFor(const Value& sd) {
  std::vector<std::pair<std::string, Tensor>> g0, g1;
  for (const auto& [k, v] : sd.as_dict().items) {
    if (!v.is_tensor() || k.as_str().ends_with("inv_freq")) continue;
    (k.as_str().find("norm") != std::string::npos ? g1 : g0).emplace_back(k.as_str(), v.as_tensor());
  }
  Value state = Value::NewDict();
  std::vector<Value> ids0, ids1;
  int64_t id = 0;
  for (auto* g : {&g0, &g1})
    for (const auto& [name, t] : *g) {
      Tensor m = Tensor::Zeros(ckpt::DType::kFloat32, t.shape());
      for (int64_t i = 0; i < m.numel(); ++i) reinterpret_cast<float*>(m.mutable_data())[i] = static_cast<float>(id);
      Value e = Value::NewDict();
      e.as_dict().Set("step", Value(int64_t{3}));
      e.as_dict().Set("exp_avg", Value(m));
      e.as_dict().Set("exp_avg_sq", Value(m));
      state.as_dict().items.emplace_back(Value(id), e);
      (g == &g0 ? ids0 : ids1).emplace_back(id++);
    }
  auto group = [](std::vector<Value> ids, double wd) {
    Value g = Value::NewDict();
    g.as_dict().Set("lr", Value(1e-3));
    g.as_dict().Set("weight_decay", Value(wd));
    g.as_dict().Set("params", Value::List(std::move(ids)));
    return g;
  };
  Value osd = Value::NewDict();
  osd.as_dict().Set("state", state);
  osd.as_dict().Set("param_groups", Value::List({group(ids0, 0.1), group(ids1, 0.0)}));
  return osd;
}

RankInput Input(const std::string& path, Value sd, int64_t step = 7) {
  RankInput in;
  in.path = path;
  in.checkpoint = Value::NewDict();
  in.checkpoint.as_dict().Set("epoch", Value(int64_t{0}));
  in.checkpoint.as_dict().Set("global_step", Value(step));
  in.checkpoint.as_dict().Set("optimizer_states", Value::List({OptimizerFor(sd)}));
  in.checkpoint.as_dict().Set("state_dict", sd);
  return in;
}

NnmSource TwoStages() {
  NnmSource s;
  s.root = "nnm";
  s.grid.tp = 1, s.grid.pp = 2;
  s.file_name = "m--step=7-consumed_samples=56.0.ckpt";
  s.name = ckpt::ParseTagName(s.file_name);
  s.files = {"nnm/tp_rank_00_pp_rank_000/" + s.file_name, "nnm/tp_rank_00_pp_rank_001/" + s.file_name};
  return s;
}

const PlannedFile& FileNamed(const ConvertPlan& p, const std::string& rel) {
  for (const auto& f : p.files)
    if (f.file.relpath == rel) return f;
  throw ckpt::Error("no planned file " + rel);
}

TEST(NnmConvert, ShiftLayerIndexTouchesOnlyTheLayerSegment) {
  std::string out;
  int local = -1;
  EXPECT_TRUE(ShiftLayerIndex("language_model.encoder.layers.7.mlp.dense_4h_to_h.weight", 3, &out, &local));
  EXPECT_EQ(out, "language_model.encoder.layers.10.mlp.dense_4h_to_h.weight");
  EXPECT_EQ(local, 7);
  EXPECT_TRUE(ShiftLayerIndex("layers.0.x", 12, &out, &local));
  EXPECT_EQ(out, "layers.12.x");
  EXPECT_FALSE(ShiftLayerIndex("language_model.embedding.word_embeddings.weight", 3, &out, &local));
  EXPECT_FALSE(ShiftLayerIndex("a.sublayers.3.x", 3, &out, &local));
  EXPECT_EQ(out, "a.sublayers.3.x");
}

TEST(NnmConvert, UnevenStagesRenumberFromActualCounts) {
  const NnmSource src = TwoStages();
  std::vector<RankInput> in = {Input(src.files[0], StageDict(3, true, false)), Input(src.files[1], StageDict(2, false, true))};
  const ConvertPlan plan = PlanConversion(src, in, {.optimizer_groups = OptimizerGroups::kNxdt});
  EXPECT_EQ(plan.total_layers, 5);
  EXPECT_EQ(plan.layers, (std::vector<std::vector<int>>{{3, 2}}));
  const Value& m1 = FileNamed(plan, "model/dp_rank_00_tp_rank_00_pp_rank_01.pt").file.value;
  // Stage 1's local layer 0 is global layer 3; "model." is gone.
  EXPECT_TRUE(m1.as_dict().Find("language_model.encoder.layers.3.self_attention.dense.weight"));
  EXPECT_TRUE(m1.as_dict().Find("language_model.encoder.layers.4.self_attention.core_attention.rotary_emb.inv_freq"));
  EXPECT_FALSE(m1.as_dict().Find("language_model.encoder.layers.0.self_attention.dense.weight"));
  EXPECT_FALSE(m1.as_dict().Find("untrained_buffer_names"));
  EXPECT_TRUE(m1.as_dict().Find("language_model.output_layer.weight"));
  // Tensors are the inputs' own (no copy).
  EXPECT_EQ(m1.as_dict().At("language_model.output_layer.weight").as_tensor().storage(),
            in[1].checkpoint.as_dict().At("state_dict").as_dict().At("model.language_model.output_layer.weight").as_tensor().storage());
  EXPECT_EQ(plan.global_step, 7);
  EXPECT_DOUBLE_EQ(plan.consumed_samples, 56.0);
  const Value& uc = FileNamed(plan, "user_content.pt").file.value;
  EXPECT_EQ(uc.as_dict().At("global_step").as_int(), 7);
  EXPECT_EQ(ErrorOf([&] { PlanConversion(src, in, {.n_layers = 6}); }),
            "nnm: --n_layers is 6 but the checkpoint holds 5 layers (stage 0: 3, stage 1: 2)");
}

TEST(NnmConvert, OptimizerIdsFollowNnmGroupsAndMomentsKeepTheirParameter) {
  const NnmSource src = TwoStages();
  std::vector<RankInput> in = {Input(src.files[0], StageDict(1, true, false)), Input(src.files[1], StageDict(1, false, true))};
  // NNM kept the norms apart (its class rule for apex norms); NxDT's megatron
  // models decay them (NeMo's rule, no bias here: one group), so `keep` cannot.
  const std::string e = ErrorOf([&] { PlanConversion(src, in, {}); });
  EXPECT_NE(e.find("language_model.encoder.layers.0.input_layernorm.weight would start decaying"), std::string::npos) << e;
  EXPECT_NE(e.find("--optimizer_groups nxdt"), std::string::npos) << e;
  const ConvertPlan plan = PlanConversion(src, in, {.optimizer_groups = OptimizerGroups::kNxdt});
  const Value& o0 = FileNamed(plan, "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt").file.value;
  // Stage 0 in one group, module order: embedding, input_layernorm, qkv, dense, post_attention_layernorm, h_to_4h, 4h_to_h.
  const auto& groups = o0.as_dict().At("param_groups").as_seq().items;
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].as_dict().At("params").as_seq().items.size(), 7u);
  EXPECT_DOUBLE_EQ(groups[0].as_dict().At("weight_decay").as_float(), 0.1);
  const auto& state = o0.as_dict().At("state").as_dict();
  ASSERT_EQ(state.items.size(), 7u);
  // Each moment keeps its parameter: NNM's id (the value it holds) moves to NxDT's.
  const std::vector<std::pair<std::vector<int64_t>, float>> want = {{{16, H}, 0}, {{H}, 5},     {{3 * H, H}, 1}, {{H, H}, 2},
                                                                    {{H}, 6},     {{4 * H, H}, 3}, {{H, 2 * H}, 4}};
  for (size_t i = 0; i < want.size(); ++i) {
    const Tensor& m = state.items[i].second.as_dict().At("exp_avg").as_tensor();
    EXPECT_EQ(m.shape(), want[i].first) << i;
    EXPECT_EQ(reinterpret_cast<const float*>(m.data())[0], want[i].second) << i;
  }
}

TEST(NnmConvert, OptimizerThatDoesNotFitTheModelIsAnError) {
  const NnmSource src = TwoStages();
  std::vector<RankInput> in = {Input(src.files[0], StageDict(1, true, false)), Input(src.files[1], StageDict(1, false, true))};
  // A group size that does not match the model.
  Value groups = in[1].checkpoint.as_dict().At("optimizer_states").as_seq().items[0].as_dict().At("param_groups");
  groups.as_seq().items[1].as_dict().At("params").as_seq().items.pop_back();
  std::string e = ErrorOf([&] { PlanConversion(src, in, {}); });
  EXPECT_NE(e.find("tp_rank_00_pp_rank_001"), std::string::npos) << e;
  EXPECT_NE(e.find("2 parameter group(s) of 5/2 ids fit no grouping"), std::string::npos) << e;
  EXPECT_NE(e.find("nnm-layernorm"), std::string::npos) << e;
  EXPECT_NE(e.find("needs 2 groups of 5/3 parameters"), std::string::npos) << e;
  // Moments of the wrong shape: no grouping ties them to a parameter of that shape.
  in[1] = Input(src.files[1], StageDict(1, false, true));
  Value st = in[1].checkpoint.as_dict().At("optimizer_states").as_seq().items[0].as_dict().At("state");
  st.as_dict().items[0].second.as_dict().Set("exp_avg", Value(Arange({2, 2})));
  e = ErrorOf([&] { PlanConversion(src, in, {}); });
  EXPECT_NE(e.find("state[0]['exp_avg'] has shape [2, 2] but would be "
                   "language_model.encoder.layers.1.self_attention.query_key_value.weight"), std::string::npos) << e;
  // One rank without optimizer state beside one with it: different saves.
  in[1] = Input(src.files[1], StageDict(1, false, true));
  in[1].checkpoint.as_dict().Erase("optimizer_states");
  e = ErrorOf([&] { PlanConversion(src, in, {}); });
  EXPECT_NE(e.find("holds no optimizer state, but"), std::string::npos) << e;
  const ConvertPlan w = PlanConversion(src, in, {.weights_only = true});
  EXPECT_EQ(w.files.size(), 2u);
  EXPECT_FALSE(w.optimizer);
}

TEST(NnmConvert, InputWithoutOptimizerStateConvertsItsWeightsUnlessRequired) {
  const NnmSource src = TwoStages();
  std::vector<RankInput> in = {Input(src.files[0], StageDict(1, true, false)), Input(src.files[1], StageDict(1, false, true))};
  for (auto& i : in) i.checkpoint.as_dict().Erase("optimizer_states");
  const ConvertPlan plan = PlanConversion(src, in, {});
  EXPECT_FALSE(plan.optimizer);
  std::vector<std::string> files;
  for (const auto& f : plan.files) files.push_back(f.file.relpath);
  EXPECT_EQ(files, (std::vector<std::string>{"model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_00_pp_rank_01.pt",
                                             "scheduler.pt", "user_content.pt"}));
  bool said = false;
  for (const auto& n : plan.notes) said |= n.find("holds no optimizer state") != std::string::npos;
  EXPECT_TRUE(said);
  EXPECT_THROW(PlanConversion(src, in, {.require_optimizer = true}), MissingOptimizerState);
  // NNM recorded ZeRO-1 but its optimizer folder is gone: not a weights-only input.
  Value cfg = Value::NewDict();
  cfg.as_dict().Set("wrap_with_zero", Value(true));
  Value hp = Value::NewDict();
  hp.as_dict().Set("cfg", cfg);
  in[0].checkpoint.as_dict().Set("hyper_parameters", hp);
  const std::string e = ErrorOf([&] { PlanConversion(src, in, {}); });
  EXPECT_NE(e.find("wrap_with_zero is True"), std::string::npos) << e;
}

TEST(NnmConvert, RanksFromDifferentStepsAreAnError) {
  const NnmSource src = TwoStages();
  std::vector<RankInput> in = {Input(src.files[0], StageDict(1, true, false)), Input(src.files[1], StageDict(1, false, true), 8)};
  const std::string e = ErrorOf([&] { PlanConversion(src, in, {}); });
  EXPECT_NE(e.find("global_step 8 differs"), std::string::npos) << e;
}

TEST(NnmConvert, VirtualPipelineChunksAsNnmSavesThemAreRefusedNamingIt) {
  // NNM's on_save_checkpoint: model0, model1, ... = state_dict_for_save_checkpoint() (nested
  // dicts), beside the LightningModule's empty state_dict.
  const NnmSource src = TwoStages();
  std::vector<RankInput> in = {Input(src.files[0], StageDict(1, true, false)), Input(src.files[1], StageDict(1, false, true))};
  for (RankInput& r : in) {
    Value nested = Value::NewDict(), lm = Value::NewDict();
    lm.as_dict().Set("encoder", r.checkpoint.as_dict().At("state_dict"));
    nested.as_dict().Set("language_model", lm);
    r.checkpoint.as_dict().Set("model0", nested);
    r.checkpoint.as_dict().Set("model1", nested);
    r.checkpoint.as_dict().Set("state_dict", Value::NewDict(true));
  }
  const std::string e = ErrorOf([&] { PlanConversion(src, in, {}); });
  EXPECT_EQ(e, src.files[0] + ": 'model0' is a virtual pipeline model chunk (NNM's virtual_pipeline_model_parallel_size) saved as "
               "nested dicts ('language_model': {...}, as NNM's on_save_checkpoint writes them), which nnm2nxdt-ckpt does not convert; "
               "convert a save made without the virtual pipeline, or re-save it with NNM at virtual_pipeline_model_parallel_size null");
  // A state_dict with parameters beside chunks: which holds the model is not guessed.
  in[0].checkpoint.as_dict().Set("state_dict", StageDict(1, true, false));
  EXPECT_NE(ErrorOf([&] { PlanConversion(src, in, {}); }).find("holds both a 'state_dict' with parameters and virtual pipeline model chunks"),
            std::string::npos);
}

TEST(NnmConvert, XserSplitsEachRankFileIntoReferencesTensorsAndInfo) {
  const NnmSource src = TwoStages();
  std::vector<RankInput> in = {Input(src.files[0], StageDict(1, true, false)), Input(src.files[1], StageDict(1, false, true))};
  const ConvertPlan plan = PlanConversion(src, in, {.save_xser = true, .optimizer_groups = OptimizerGroups::kNxdt});
  const Value& refs = FileNamed(plan, "model/dp_rank_00_tp_rank_00_pp_rank_01.pt").file.value;
  const Value& info = FileNamed(plan, "model/dp_rank_00_tp_rank_00_pp_rank_01.pt.info.pt").file.value;
  const Value& t0 = FileNamed(plan, "model/dp_rank_00_tp_rank_00_pp_rank_01.pt.tensors/tensor_0.pt").file.value;
  const Value& first = refs.as_dict().items[0].second;
  ASSERT_TRUE(first.is_object());
  EXPECT_EQ(first.as_object().cls.full(), "torch_xla.utils.serialization.TensorReference");
  EXPECT_TRUE(t0.is_tensor());
  EXPECT_EQ(info.as_dict().items[0].second.as_dict().At("dtype").as_global().full(), "torch.float32");
  EXPECT_FALSE(FileNamed(plan, "model/dp_rank_00_tp_rank_00_pp_rank_01.pt").file.options.weights_only);
}

}  // namespace
}  // namespace convert

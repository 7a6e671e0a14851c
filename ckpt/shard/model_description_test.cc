// DescribeModel: stages and a model format from what the model files' names and shapes say, hints and a recorded job config.
#include "ckpt/shard/model_description.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "ckpt/spec/model_family.h"

#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;

Value Zeros(std::vector<int64_t> shape) { return Value(Tensor::Zeros(DType::kFloat32, std::move(shape))); }

// Megatron-style model files of hidden 8, ffn 16 (swiglu: h_to_4h holds 2 x ffn rows), vocab rows
// 16 per rank, 4 KV heads of head_dim 2, one layer per stage, over tp x pp.
struct MegatronFiles {
  int tp, pp;
  std::vector<Value> files;  // by (p, t)
  MegatronFiles(int tp_, int pp_) : tp(tp_), pp(pp_) {
    for (int p = 0; p < pp; ++p)
      for (int t = 0; t < tp; ++t) {
        Value d = Value::NewDict();
        const std::string layer = "language_model.encoder.layers." + std::to_string(p) + ".";
        if (p == 0) d.as_dict().Set("language_model.embedding.word_embeddings.weight", Zeros({16, 8}));
        d.as_dict().Set(layer + "self_attention.key_value.weight", Zeros({4 * 2 * 2 / tp, 8}));
        d.as_dict().Set(layer + "mlp.dense_h_to_4h.weight", Zeros({2 * 16 / tp, 8}));
        d.as_dict().Set(layer + "mlp.dense_4h_to_h.weight", Zeros({8, 16 / tp}));
        if (p + 1 == pp) d.as_dict().Set("language_model.encoder.final_layernorm.weight", Zeros({8}));
        files.push_back(d);
      }
  }
  ModelEvidence Evidence() const {
    ModelEvidence e;
    e.dir = "tag";
    e.grid.tp = tp, e.grid.pp = pp;
    e.model = [this](int t, int p) -> const Dict& { return files[static_cast<size_t>(p) * tp + t].as_dict(); };
    e.path = [](const std::string& rel) { return "tag/" + rel; };
    return e;
  }
};

TEST(ModelDescription, StagesAreTheLayerNumbersOfEachStagesFiles) {
  MegatronFiles m(1, 2);
  EXPECT_EQ(StageBoundsOfFiles(m.Evidence()), (std::vector<int64_t>{0, 1, 2}));
  // Stage 1 starting past the layer after stage 0's last: refused, naming its file.
  Value& s1 = m.files[1];
  Value moved = Value::NewDict();
  for (const auto& [k, v] : s1.as_dict().items) {
    std::string name = k.as_str();
    if (auto at = name.find("layers.1."); at != std::string::npos) name.replace(at, 9, "layers.3.");
    moved.as_dict().Set(name, v);
  }
  s1 = moved;
  EXPECT_EQ(ErrorOf([&] { StageBoundsOfFiles(m.Evidence()); }),
            "tag/model/dp_rank_00_tp_rank_00_pp_rank_01.pt: starts at layer 3 but the stage before ends at layer 0; stages must hold "
            "consecutive layers");
}

// Adds layer `to`'s keys to a stage file: a copy of its layer `from`'s.
void AddLayerCopy(Value& file, int from, int to) {
  std::vector<std::pair<std::string, Value>> add;
  for (const auto& [k, v] : file.as_dict().items)
    if (LayerOfName(k.as_str()) == from) {
      std::string name = k.as_str();
      name.replace(name.find("layers." + std::to_string(from) + "."), 7 + std::to_string(from).size() + 1, "layers." + std::to_string(to) + ".");
      add.push_back({name, v});
    }
  for (auto& [k, v] : add) file.as_dict().Set(k, v);
}

TEST(ModelDescription, VirtualPipelineStagesAreLearnedFromTheLayerNames) {
  // NxD's virtual_pipeline_size 2 at pp 2: pp rank 0 holds layers 0 and 2, pp rank 1 layers 1 and 3.
  MegatronFiles m(1, 2);
  AddLayerCopy(m.files[0], 0, 2);
  AddLayerCopy(m.files[1], 1, 3);
  const StageSplit split = StageSplitOfFiles(m.Evidence());
  EXPECT_EQ(split, (StageSplit{{0, 1, 2, 3, 4}, 2}));
  // A recorded stage map saying the same is taken; one saying otherwise is refused naming the manifest.
  ModelEvidence e = m.Evidence();
  const StageMap same = StageMapOf({0, 1, 2, 3, 4}, 2), other = StageMapOf({0, 2, 4});
  e.recorded_stages = &same;
  EXPECT_EQ(StageSplitOfFiles(e), split);
  e.recorded_stages = &other;
  EXPECT_EQ(ErrorOf([&] { StageSplitOfFiles(e); }),
            "tag/manifest.json: 'layout' 'stages' records layers 0..1 for pp rank 0, but tag/model/dp_rank_00_tp_rank_00_pp_rank_00.pt "
            "holds layers 0..0, 2..2");
  // Ranges that are no virtual pipeline either (rank 1 holds one range, rank 0 two) are refused naming it.
  MegatronFiles bad(1, 2);
  AddLayerCopy(bad.files[0], 0, 3);
  EXPECT_EQ(ErrorOf([&] { StageSplitOfFiles(bad.Evidence()); }),
            "tag/model: its pp ranks hold layers pp rank 0: 0..0, 3..3; pp rank 1: 1..1, which are neither consecutive stages nor NxD's "
            "virtual pipeline stages (pp rank p holding stages p, p + pp, ..., as many on every rank, each starting where the stage "
            "before ends)");
}

// NxDT's Mixtral (either style) is told for what it is, before any Llama inference asks for its MLP.
TEST(ModelDescription, MoeModelsAreRefusedNamingMoe) {
  MegatronFiles m(1, 1);
  m.files[0].as_dict().Set("language_model.encoder.layers.0.mlp.moe.router.linear_router.weight", Zeros({4, 8}));
  const std::string megatron = ErrorOf([&] { DescribeModel(m.Evidence(), {}); });
  EXPECT_NE(megatron.find("MoE (Mixtral) model, Megatron-style"), std::string::npos) << megatron;
  EXPECT_NE(megatron.find("mlp.moe.router.linear_router.weight"), std::string::npos) << megatron;
  Value hf = Value::NewDict();
  hf.as_dict().Set("model.embed_tokens.weight", Zeros({16, 8}));
  hf.as_dict().Set("model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight", Zeros({4, 8, 32}));
  hf.as_dict().Set("model.norm.weight", Zeros({8}));
  m.files[0] = hf;
  const std::string hf_why = ErrorOf([&] { DescribeModel(m.Evidence(), {}); });
  EXPECT_NE(hf_why.find("MoE (Mixtral) model, HF-style"), std::string::npos) << hf_why;
  EXPECT_EQ(hf_why.find("mlp.down_proj"), std::string::npos) << hf_why;
}

// user_content.pt as NxDT saves it: the job config under hyper_parameters.cfg.
Value UserContentWith(const Value& cfg) {
  Value hp = Value::NewDict();
  hp.as_dict().Set("cfg", cfg);
  Value uc = Value::NewDict();
  uc.as_dict().Set("hyper_parameters", hp);
  return uc;
}

// --- Mixtral (MoE), issue #38: a tag without a manifest at tp 1, ep 1 ---

// An HF-style Mixtral's model file (tp 1): hidden 8, ffn 16, 4 experts, 2 heads of head_dim 4 (q/k/v_proj);
// `moe_layers` of its 4 layers hold the MoE, the others a dense MLP.
Value HfMixtralFile(const std::vector<int>& moe_layers) {
  Value d = Value::NewDict();
  d.as_dict().Set("model.embed_tokens.weight", Zeros({16, 8}));
  for (int l = 0; l < 4; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* x : {"q_proj", "k_proj", "v_proj"}) d.as_dict().Set(p + "self_attn." + x + ".weight", Zeros({8, 8}));
    if (std::find(moe_layers.begin(), moe_layers.end(), l) != moe_layers.end()) {
      d.as_dict().Set(p + "mlp.router.linear_router.weight", Zeros({4, 8}));
      d.as_dict().Set(p + "mlp.expert_mlps.mlp_op.gate_up_proj.weight", Zeros({4, 8, 32}));
      d.as_dict().Set(p + "mlp.expert_mlps.mlp_op.down_proj.weight", Zeros({4, 16, 8}));
    } else {
      d.as_dict().Set(p + "mlp.gate_up_proj.weight", Zeros({32, 8}));
      d.as_dict().Set(p + "mlp.down_proj.weight", Zeros({8, 16}));
    }
  }
  d.as_dict().Set("model.norm.weight", Zeros({8}));
  d.as_dict().Set("lm_head.weight", Zeros({16, 8}));
  return d;
}

TEST(ModelDescription, MoeSizesComeFromTheExpertsAndTopKFromTheJobConfigOrAHint) {
  MegatronFiles m(1, 1);
  m.files[0] = HfMixtralFile({0, 2});
  FormatHints hints;
  hints.heads = 2;
  const std::string unknown = ErrorOf([&] { DescribeModel(m.Evidence(), hints); });
  EXPECT_NE(unknown.find("so give --moe_top_k"), std::string::npos) << unknown;
  hints.moe_top_k = 2;
  const ModelDescription d = DescribeModel(m.Evidence(), hints);
  EXPECT_EQ(std::tuple(d.format.hidden, d.format.ffn, d.format.experts, d.format.moe_top_k, d.format.moe_frequency), std::tuple(8, 16, 4, 2, 2));
  EXPECT_EQ(FamilyLabel(d.format), "hf_mixtral");
  // The job config (hyper_parameters.cfg.moe) gives top_k, and what it says must be what the files hold.
  Value moe = Value::NewDict();
  moe.as_dict().Set("top_k", Value(int64_t{1}));
  moe.as_dict().Set("frequency", Value(int64_t{3}));
  Value cfg = Value::NewDict();
  cfg.as_dict().Set("moe", moe);
  const Value uc = UserContentWith(cfg);
  ModelEvidence e = m.Evidence();
  e.user_content = [&] { return &uc; };
  hints.moe_top_k.reset();
  const std::string freq = ErrorOf([&] { DescribeModel(e, hints); });
  EXPECT_NE(freq.find("moe frequency 3 (given, or the job config's model.moe.frequency) contradicts the model files, whose MoE layers are 0, 2"),
            std::string::npos) << freq;
  moe.as_dict().Set("frequency", Value(int64_t{2}));
  EXPECT_EQ(DescribeModel(e, hints).format.moe_top_k, 1);
  hints.experts = 8;
  EXPECT_NE(ErrorOf([&] { DescribeModel(e, hints); }).find("num_experts 8 (given, or the job config's model.moe.num_experts) contradicts"),
            std::string::npos);
  hints.experts.reset();
  hints.moe_top_k = 2;
  EXPECT_EQ(ErrorOf([&] { DescribeModel(e, hints); }),
            "--moe_top_k 2 contradicts tag/user_content.pt, whose job config (hyper_parameters.cfg.moe.top_k) is 1");
}

// What the family table does not hold (shared experts, a router bias) is refused naming it; tensors at tp 2
// must be cut as the shard specs cut them.
TEST(ModelDescription, MoePartsTheTableDoesNotHoldAreRefused) {
  MegatronFiles m(1, 1);
  m.files[0] = HfMixtralFile({0, 1, 2, 3});
  m.files[0].as_dict().Set("model.layers.1.mlp.shared_experts.gate_proj.weight", Zeros({16, 8}));
  FormatHints hints;
  hints.heads = 2, hints.moe_top_k = 2;
  const std::string shared = ErrorOf([&] { DescribeModel(m.Evidence(), hints); });
  EXPECT_NE(shared.find("'model.layers.1.mlp.shared_experts.gate_proj.weight', a part of NxD's MoE layer"), std::string::npos) << shared;
  m.files[0] = HfMixtralFile({0, 1, 2, 3});
  m.files[0].as_dict().Set("model.layers.2.mlp.router.linear_router.bias", Zeros({4}));
  EXPECT_NE(ErrorOf([&] { DescribeModel(m.Evidence(), hints); }).find("router or expert biases"), std::string::npos);
  m.files[0] = HfMixtralFile({0, 1, 2, 3});
  EXPECT_EQ(DescribeModel(m.Evidence(), hints).format.moe_frequency, 1);
  ModelEvidence split = m.Evidence();
  split.grid.tp = 2;
  const std::vector<Value> two{m.files[0], m.files[0]};
  split.model = [&](int t, int) -> const Dict& { return two[static_cast<size_t>(t)].as_dict(); };
  // Read at tp 2, every rank's tensors must be its cut of them: whole-size copies are refused (here by the
  // heads they imply; tests/interop/mixtral_reshard.py reads NxD's real tp 2 cut).
  EXPECT_NE(ErrorOf([&] { DescribeModel(split, hints); }).find("do not divide"), std::string::npos);
}

// NxDT's NeuronSwitchMLP at tp 2 (each rank's experts cut on dim 2 / dim 1): described, as the HF style is, at
// ep 1 and at ep 2, where ep rank 0's files hold experts / ep of them (NxD's get_experts_for_expert_parallel_rank).
TEST(ModelDescription, MegatronMoeIsDescribedAtAnyTpAndEp) {
  for (const int ep : {1, 2}) {
    MegatronFiles m(2, 1);
    for (Value& file : m.files) {
      Value d = Value::NewDict();
      for (const auto& [k, v] : file.as_dict().items)
        if (k.as_str().find(".mlp.") == std::string::npos) d.as_dict().Set(k.as_str(), v);
      const std::string moe = "language_model.encoder.layers.0.mlp.moe.";
      d.as_dict().Set(moe + "router.linear_router.weight", Zeros({4, 8}));
      d.as_dict().Set(moe + "expert_mlps.mlp_op.gate_up_proj.weight", Zeros({4 / ep, 8, 2 * 16 / 2}));
      d.as_dict().Set(moe + "expert_mlps.mlp_op.down_proj.weight", Zeros({4 / ep, 16 / 2, 8}));
      file = d;
    }
    FormatHints hints;
    hints.heads = 4, hints.moe_top_k = 2;
    ModelEvidence e = m.Evidence();
    e.grid.ep = ep;
    const ModelDescription d = DescribeModel(e, hints);
    EXPECT_EQ(FamilyLabel(d.format), "megatron_mixtral");
    EXPECT_EQ(std::tuple(d.format.hidden, d.format.ffn, d.format.experts, d.format.moe_frequency), std::tuple(8, 16, 4, 1)) << "ep " << ep;
    if (ep == 1) {  // the same files named at ep 3: 3 does not divide the 4 experts
      e.grid.ep = 3;
      const std::string ep3 = ErrorOf([&] { DescribeModel(e, hints); });
      EXPECT_NE(ep3.find("are not a router (experts, hidden 8) and experts' (experts / ep 3"), std::string::npos) << ep3;
    }
  }
}

TEST(ModelDescription, MegatronSizesComeFromShapesAndHeadsFromAHint) {
  const MegatronFiles m(2, 1);
  const ModelEvidence e = m.Evidence();
  std::vector<std::string> notes;
  const std::string unknown = ErrorOf([&] { DescribeMegatronModel(e, {0, 1}, {}, &notes); });
  EXPECT_TRUE(unknown.ends_with("so give --heads (model.num_attention_heads)")) << unknown;
  FormatHints hints;
  hints.heads = 4;
  const ModelFormat f = DescribeMegatronModel(e, {0, 1}, hints, &notes);
  EXPECT_EQ(f.family, ModelFamily::kMegatron);
  EXPECT_EQ(std::tuple(f.hidden, f.ffn, f.layers, f.heads, f.kv_heads), std::tuple(8, 16, 1, 4, 4));
  EXPECT_FALSE(f.gelu);  // h_to_4h holds 2 x ffn rows: swiglu
  EXPECT_EQ(std::pair(f.vocab_size, f.make_vocab_size_divisible_by), std::pair(int64_t{32}, int64_t{1}));  // every row, no rule known
  EXPECT_TRUE(f.tied_output);
}

TEST(ModelDescription, TheRecordedJobConfigGivesHeadsAndContradictsAHint) {
  const MegatronFiles m(2, 1);
  Value cfg = Value::NewDict();
  cfg.as_dict().Set("num_attention_heads", Value(int64_t{4}));
  cfg.as_dict().Set("make_vocab_size_divisible_by", Value(int64_t{8}));
  const Value uc = UserContentWith(cfg);
  ModelEvidence e = m.Evidence();
  e.user_content = [&] { return &uc; };
  std::vector<std::string> notes;
  const ModelFormat f = DescribeMegatronModel(e, {0, 1}, {}, &notes);
  EXPECT_EQ(f.heads, 4);
  EXPECT_EQ(f.make_vocab_size_divisible_by, 8);
  ASSERT_FALSE(notes.empty());
  EXPECT_EQ(notes[0], "num_attention_heads 4 from the job config in user_content.pt");
  FormatHints hints;
  hints.heads = 2;
  EXPECT_EQ(ErrorOf([&] { DescribeMegatronModel(e, {0, 1}, hints, &notes); }),
            "--heads 2 contradicts tag/user_content.pt, whose job config (hyper_parameters.cfg.num_attention_heads) is 4");
}

TEST(ModelDescription, ARecordedFormatIsTakenAndHintsMustAgree) {
  const MegatronFiles m(2, 1);
  FormatHints hints;
  hints.heads = 4;
  std::vector<std::string> notes;
  ModelFormat recorded = DescribeMegatronModel(m.Evidence(), {0, 1}, hints, &notes);
  ModelEvidence e = m.Evidence();
  e.recorded = &recorded;
  const ModelDescription d = DescribeModel(e, {});
  EXPECT_TRUE(d.from_manifest);
  EXPECT_EQ(d.format, recorded);
  EXPECT_EQ(d.stage_bounds, (std::vector<int64_t>{0, 1}));
  EXPECT_FALSE(d.params.empty());
  hints.heads = 8;
  EXPECT_EQ(ErrorOf([&] { DescribeModel(e, hints); }), "--heads 8 contradicts tag/manifest.json, which records 4");
}


// An adapter-only LoRA tag (NxD's save_lora_base False) at tp 2: qkv_proj's adapters of a model of
// hidden 16, 4 heads of 4, 2 KV heads (one per rank, none replicated), rank 4, two layers.
std::vector<Value> AdapterOnlyFiles() {
  std::vector<Value> files;
  for (int t = 0; t < 2; ++t) {
    Value d = Value::NewDict();
    Value config = Value::NewDict();
    auto& c = config.as_dict();
    c.Set("lora_rank", 4), c.Set("r", 4), c.Set("lora_alpha", 8), c.Set("target_modules", Value::List({"qkv_proj"}));
    c.Set("lora_dropout", 0.05), c.Set("bias", "none"), c.Set("use_rslora", false), c.Set("modules_to_save", Value());
    c.Set("merge_lora", false), c.Set("save_lora_base", false);
    for (int layer = 0; layer < 2; ++layer) {
      const std::string m = "model.layers." + std::to_string(layer) + ".self_attn.qkv_proj.";
      d.as_dict().Set(m + "lora_A.weight", Zeros({4, 16}));
      d.as_dict().Set(m + "lora_B.weight_q", Zeros({8, 4}));
      for (const char* kv : {"lora_B.weight_k", "lora_B.weight_v"}) {
        Tensor x = Tensor::Zeros(DType::kFloat32, {4, 4});
        reinterpret_cast<float*>(x.mutable_data())[0] = static_cast<float>(t + 1);  // each rank its own KV head
        d.as_dict().Set(m + kv, Value(x));
      }
    }
    d.as_dict().Set("lora_config", config);
    files.push_back(d);
  }
  return files;
}

TEST(ModelDescription, AnAdapterOnlyTagsSizesComeFromItsAdaptersAndHints) {
  const std::vector<Value> files = AdapterOnlyFiles();
  ModelEvidence e;
  e.dir = "tag";
  e.grid.tp = 2, e.grid.pp = 1;
  e.model = [&files](int t, int) -> const Dict& { return files[static_cast<size_t>(t)].as_dict(); };
  e.path = [](const std::string& rel) { return "tag/" + rel; };
  FormatHints hints;
  hints.heads = 4, hints.vocab_size = 32;
  // qkv_proj's adapters show no FFN width: refused naming it
  EXPECT_NE(ErrorOf([&] { DescribeModel(e, hints); }).find("neither its adapters nor a hint give the FFN width"), std::string::npos);
  hints.ffn = 24;
  const ModelDescription d = DescribeModel(e, hints);
  EXPECT_EQ(d.format.hidden, 16);  // lora_A's columns
  EXPECT_EQ(d.format.kv_heads, 2);  // lora_B.weight_k's rows per rank, unreplicated
  EXPECT_EQ(d.format.kv_size_multiplier, 1);
  EXPECT_EQ(d.format.layers, 2);
  EXPECT_TRUE(d.format.qkv_linear);
  EXPECT_FALSE(d.format.fuse_qkv);
  EXPECT_EQ(d.format.lora.saved, LoraSaved::kAdapterOnly);
  EXPECT_EQ(d.params.size(), 2u * 4);  // lora_A and lora_B q, k, v per layer
  hints.vocab_size.reset();
  EXPECT_NE(ErrorOf([&] { DescribeModel(e, hints); }).find("the vocabulary size: give --model_config with the base model's HF config.json, or --vocab_size"),
            std::string::npos);
}

}  // namespace
}  // namespace ckpt

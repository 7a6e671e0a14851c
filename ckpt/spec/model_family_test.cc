#include "ckpt/spec/model_family.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;

// The tiny HF Llama of tests/data/upstream/hf_llama: hidden 64, 8 heads of 8, 2 KV heads.
ModelFormat Tiny(int64_t m, HwBackend backend, bool fuse = true, bool qkv_linear = true) {
  ModelFormat f;
  f.family = ModelFamily::kHfLlama;
  f.hidden = 64, f.ffn = 96, f.heads = 8, f.kv_heads = 2, f.layers = 4, f.vocab_size = 128;
  f.fuse_qkv = fuse, f.qkv_linear = qkv_linear, f.kv_size_multiplier = m, f.hw_backend = backend;
  return f;
}

std::vector<int64_t> Flat(const std::vector<std::vector<int64_t>>& per_rank) {
  std::vector<int64_t> out;
  for (const auto& v : per_rank) out.insert(out.end(), v.begin(), v.end());
  return out;
}

// The head tables of tests/data/upstream/hf_llama/README.md, measured from the
// converter's tags: Trn1 tp8 m4 queries Q0,Q4,Q1,Q5,Q2,Q6,Q3,Q7 with KV r % 2;
// Trn1 tp4 m2 [Q0,Q1],[Q4,Q5],[Q2,Q3],[Q6,Q7]; Trn2 (runtime rule) tp4 m2
// natural queries with KV r / 2.
TEST(ModelFamily, HeadPlacementMatchesNxd) {
  std::vector<std::vector<int64_t>> q, kv;
  for (int r = 0; r < 8; ++r) q.push_back(QueryHeadsOfRank(Tiny(4, HwBackend::kTrn1), 8, r)), kv.push_back(KvHeadsOfRank(Tiny(4, HwBackend::kTrn1), 8, r));
  EXPECT_EQ(Flat(q), (std::vector<int64_t>{0, 4, 1, 5, 2, 6, 3, 7}));
  EXPECT_EQ(Flat(kv), (std::vector<int64_t>{0, 1, 0, 1, 0, 1, 0, 1}));
  q.clear(), kv.clear();
  for (int r = 0; r < 4; ++r) q.push_back(QueryHeadsOfRank(Tiny(2, HwBackend::kTrn1), 4, r)), kv.push_back(KvHeadsOfRank(Tiny(2, HwBackend::kTrn1), 4, r));
  EXPECT_EQ(Flat(q), (std::vector<int64_t>{0, 1, 4, 5, 2, 3, 6, 7}));
  EXPECT_EQ(Flat(kv), (std::vector<int64_t>{0, 1, 0, 1}));
  q.clear(), kv.clear();
  for (int r = 0; r < 4; ++r) q.push_back(QueryHeadsOfRank(Tiny(2, HwBackend::kTrn2), 4, r)), kv.push_back(KvHeadsOfRank(Tiny(2, HwBackend::kTrn2), 4, r));
  EXPECT_EQ(Flat(q), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(Flat(kv), (std::vector<int64_t>{0, 0, 1, 1}));
  // m = 1: KV heads in order, one per rank at tp 2... here tp 2 holds one each.
  EXPECT_EQ(KvHeadsOfRank(Tiny(1, HwBackend::kUnknown), 2, 1), (std::vector<int64_t>{1}));
  EXPECT_EQ(QueryHeadsOfRank(Tiny(1, HwBackend::kUnknown), 2, 1), (std::vector<int64_t>{4, 5, 6, 7}));
}

TEST(ModelFamily, FusedRunsAreQueryThenKThenV) {
  const ModelFormat f = Tiny(2, HwBackend::kTrn1);
  const auto params = LogicalParameters(f, 4);
  const ParamRule& qkv = params.at(1);
  ASSERT_EQ(qkv.name, "model.layers.0.self_attn.qkv_proj.weight_qkv");
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{64 + 16 + 16, 64}));
  // Rank 1: queries 4, 5 (rows 32..47), K head 1 (rows 64 + 8..), V head 1 (rows 80 + 8..).
  const auto runs = LocalRuns(qkv, f, 4, 1);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ((std::vector<int64_t>{runs[0].local, runs[0].logical, runs[0].count}), (std::vector<int64_t>{0, 32, 16}));
  EXPECT_EQ((std::vector<int64_t>{runs[1].local, runs[1].logical, runs[1].count}), (std::vector<int64_t>{16, 72, 8}));
  EXPECT_EQ((std::vector<int64_t>{runs[2].local, runs[2].logical, runs[2].count}), (std::vector<int64_t>{24, 88, 8}));
  EXPECT_EQ(LocalShape(qkv, f, 4, 1), (std::vector<int64_t>{32, 64}));
  // Regions are never merged: tp 4 m 1 rank... (Trn1 m2 rank 3 holds Q6, Q7 then K1: logical 56..64 and 72.., apart anyway);
  // at tp 8 m 4 rank 7 holds query 7 (rows 56..63) and K1 (rows 72..79): two runs.
  const ModelFormat g = Tiny(4, HwBackend::kTrn1);
  const auto r7 = LocalRuns(LogicalParameters(g, 8).at(1), g, 8, 7);
  EXPECT_EQ(r7.size(), 3u);
  // o_proj: columns of the same query heads.
  const ParamRule& o = params.at(2);
  ASSERT_EQ(o.name, "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(o.split, SplitDim::kColumns);
  const auto oruns = LocalRuns(o, f, 4, 2);
  ASSERT_EQ(oruns.size(), 1u);
  EXPECT_EQ(oruns[0].logical, 16);  // rank 2 holds Q2, Q3
}

TEST(ModelFamily, NamesAndStages) {
  const auto params = LogicalParameters(Tiny(1, HwBackend::kUnknown, false, true), 2);
  std::vector<std::string> names;
  for (const auto& p : params) names.push_back(p.name);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names.at(1), "model.layers.0.self_attn.qkv_proj.weight_q");
  EXPECT_EQ(names.at(3), "model.layers.0.self_attn.qkv_proj.weight_v");
  EXPECT_EQ(names.back(), "lm_head.weight");
  const auto stage1 = StageParameters(params, {0, 2, 4}, 1);
  EXPECT_EQ(stage1.front().name, "model.layers.2.self_attn.qkv_proj.weight_q");
  EXPECT_EQ(stage1.back().name, "lm_head.weight");
  EXPECT_EQ(stage1.at(stage1.size() - 2).name, "model.norm.weight");
  EXPECT_EQ(StageParameters(params, {0, 2, 4}, 0).front().name, "model.embed_tokens.weight");
  EXPECT_EQ(FamilyOfNames({"model.layers.0.mlp.down_proj.weight"}, "f"), ModelFamily::kHfLlama);
  EXPECT_EQ(FamilyOfNames({"language_model.embedding.word_embeddings.weight", "x.inv_freq"}, "f"), ModelFamily::kMegatron);
  const std::string mixed = ErrorOf([] { FamilyOfNames({"language_model.encoder.final_layernorm.weight", "lm_head.weight"}, "f.pt"); });
  EXPECT_NE(mixed.find("f.pt: mixes model families"), std::string::npos) << mixed;
  EXPECT_NE(mixed.find("lm_head.weight"), std::string::npos) << mixed;
}

TEST(ModelFamily, InfersReplicationFromEqualRanks) {
  auto by = [](std::function<int(int)> slot) { return [slot](int a, int b) { return slot(a) == slot(b); }; };
  KvReplicationSeen s = InferKvReplication(8, by([](int r) { return r % 2; }));
  EXPECT_EQ(s.multiplier, 4);
  EXPECT_EQ(s.backend, HwBackend::kTrn1);
  EXPECT_EQ(s.groups, "[[0, 2, 4, 6], [1, 3, 5, 7]]");
  s = InferKvReplication(4, by([](int r) { return r / 2; }));
  EXPECT_EQ(s.multiplier, 2);
  EXPECT_EQ(s.backend, HwBackend::kTrn2);
  s = InferKvReplication(4, by([](int r) { return r; }));
  EXPECT_EQ(s.multiplier, 1);
  EXPECT_EQ(s.backend, HwBackend::kUnknown);
  s = InferKvReplication(4, by([](int) { return 0; }));
  EXPECT_EQ(s.multiplier, 4);
  EXPECT_EQ(s.backend, HwBackend::kUnknown);
  const std::string odd = ErrorOf([&] { InferKvReplication(4, by([](int r) { return r == 3 ? 1 : 0; })); });
  EXPECT_NE(odd.find("[[0, 1, 2], [3]]"), std::string::npos) << odd;
  const std::string mixed = ErrorOf([&] { InferKvReplication(4, by([](int r) { return r == 0 || r == 3 ? 0 : 1; })); });
  EXPECT_NE(mixed.find("fit neither"), std::string::npos) << mixed;
}

TEST(ModelFamily, ReplicationProblems) {
  EXPECT_EQ(KvReplicationProblem(Tiny(4, HwBackend::kTrn1), 8), "");
  EXPECT_EQ(KvReplicationProblem(Tiny(1, HwBackend::kUnknown), 2), "");
  // 2 KV heads x 1 over tp 4: not a whole head per rank.
  EXPECT_NE(KvReplicationProblem(Tiny(1, HwBackend::kTrn1), 4).find("kv_size_multiplier 2 fits"), std::string::npos);
  // Replication needs qkv_linear.
  EXPECT_NE(KvReplicationProblem(Tiny(2, HwBackend::kTrn1, true, false), 4).find("qkv_linear"), std::string::npos);
  // Two KV heads per rank with replication: refused, naming the multiplier that fits.
  EXPECT_NE(KvReplicationProblem(Tiny(4, HwBackend::kTrn1), 4).find("use kv_size_multiplier 2"), std::string::npos);
  EXPECT_TRUE(BackendMatters(Tiny(2, HwBackend::kUnknown), 4));
  EXPECT_FALSE(BackendMatters(Tiny(2, HwBackend::kUnknown), 2));
}

TEST(ModelFamily, FusedAndSeparateAttentionMapRowForRow) {
  const ModelFormat fused = Tiny(2, HwBackend::kTrn1), split = Tiny(2, HwBackend::kTrn1, false, true);
  const auto to_split = LogicalRowsIn(fused, split);
  const auto& k = to_split.at("model.layers.3.self_attn.qkv_proj.weight_k");
  ASSERT_EQ(k.size(), 1u);
  EXPECT_EQ(k[0].row, 0);
  EXPECT_EQ(k[0].from.name, "model.layers.3.self_attn.qkv_proj.weight_qkv");
  EXPECT_EQ(k[0].from.row, 64);
  EXPECT_EQ(k[0].from.rows, 16);
  const auto to_fused = LogicalRowsIn(split, fused);
  const auto& qkv = to_fused.at("model.layers.0.self_attn.qkv_proj.weight_qkv");
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_EQ(qkv[0].from.name, "model.layers.0.self_attn.qkv_proj.weight_q");
  EXPECT_EQ(qkv[2].from.name, "model.layers.0.self_attn.qkv_proj.weight_v");
  EXPECT_EQ(qkv[2].row, 80);
  EXPECT_EQ(to_fused.at("model.norm.weight").at(0).from.name, "model.norm.weight");
}

// Megatron's per-head [q_h; k_h; v_h] rows and padded vocabulary from the HF-style family's [Q; K; V].
TEST(ModelFamily, AcrossFamiliesThroughHfTensors) {
  ModelFormat hf = Tiny(1, HwBackend::kUnknown, true, true), mega = hf;
  hf.kv_heads = mega.kv_heads = 8;
  mega.family = ModelFamily::kMegatron, mega.make_vocab_size_divisible_by = 96;  // pads 128 to 192
  const auto m = LogicalRowsIn(hf, mega);
  const auto& qkv = m.at("language_model.encoder.layers.2.self_attention.query_key_value.weight");
  ASSERT_EQ(qkv.size(), 24u);  // 8 heads x q, k, v
  EXPECT_EQ(qkv[1].row, 8);    // head 0's k
  EXPECT_EQ(qkv[1].from.name, "model.layers.2.self_attn.qkv_proj.weight_qkv");
  EXPECT_EQ(qkv[1].from.row, 64);
  const auto& emb = m.at("language_model.embedding.word_embeddings.weight");
  ASSERT_EQ(emb.size(), 1u);
  EXPECT_EQ(emb[0].from.rows, 128);  // rows 128..191 are padding: zeros
  ModelFormat other = mega;
  other.hidden = 32;
  EXPECT_NE(ErrorOf([&] { LogicalRowsIn(hf, other); }).find("different models"), std::string::npos);
}

TEST(ModelFamily, MegatronReplicationBelowTpIsSaidToLoadInShardkitOnly) {
  ModelFormat f = Tiny(1, HwBackend::kUnknown);
  f.family = ModelFamily::kMegatron;  // 8 heads, 2 KV heads
  EXPECT_EQ(MegatronKvReplicationNote(f, 2), "");
  EXPECT_NE(MegatronKvReplicationNote(f, 4).find("2 KV heads over tp 4 are replicated by shardkit's rule"), std::string::npos);
  EXPECT_EQ(MegatronKvReplicationNote(Tiny(2, HwBackend::kTrn1), 4), "");  // NxD's own replication
}

TEST(ModelFamily, FormatRoundTripsThroughJson) {
  ModelFormat f = Tiny(4, HwBackend::kTrn2, false, true);
  EXPECT_EQ(ModelFormat::FromJson(f.ToJson(), "m"), f);
  auto old = nlohmann::json(ModelFormat{}.ToJson());
  for (const char* k : {"model_family", "fuse_qkv", "qkv_linear", "kv_size_multiplier", "hw_backend"}) old.erase(k);
  old["num_layers"] = 1, old["hidden_size"] = 8, old["ffn_hidden_size"] = 8, old["num_attention_heads"] = 2, old["num_kv_heads"] = 2,
  old["vocab_size"] = 8;
  EXPECT_EQ(ModelFormat::FromJson(old, "old manifest").family, ModelFamily::kMegatron);
}

// transformers' AutoConfig reads model_type when a config.json lists no architectures.
TEST(ModelFamily, HfConfigWithoutArchitecturesIsReadByModelType) {
  nlohmann::json llama = {{"model_type", "llama"}, {"hidden_size", 64}, {"intermediate_size", 96}, {"num_attention_heads", 8},
                          {"num_key_value_heads", 2}, {"num_hidden_layers", 2}, {"vocab_size", 128}};
  const ModelFormat f = FormatOfHfConfig(llama, "c.json");
  EXPECT_EQ(f.hidden, 64);
  EXPECT_EQ(f.kv_heads, 2);
  EXPECT_FALSE(f.gelu);
  nlohmann::json gpt = {{"model_type", "gpt2"}, {"n_embd", 64}, {"n_head", 8}, {"n_layer", 2}, {"vocab_size", 128},
                        {"n_positions", 32}, {"activation_function", "gelu"}};
  EXPECT_TRUE(FormatOfHfConfig(gpt, "c.json").learned_positions);
  llama["model_type"] = "mistral";
  EXPECT_NE(ErrorOf([&] { FormatOfHfConfig(llama, "c.json"); }).find("model_type 'mistral'"), std::string::npos);
  llama.erase("model_type");
  EXPECT_NE(ErrorOf([&] { FormatOfHfConfig(llama, "c.json"); }).find("neither architectures nor model_type"), std::string::npos);
}

}  // namespace

// A tiny HF-style Mixtral: Tiny's Llama with 4 experts, top 2, an MoE layer every 2nd.
ModelFormat TinyMixtral() {
  ModelFormat f = Tiny(1, HwBackend::kUnknown);
  f.experts = 4, f.moe_top_k = 2, f.moe_frequency = 2;
  return f;
}

const ParamRule& Rule(const std::vector<ParamRule>& ps, const std::string& name) {
  for (const ParamRule& p : ps)
    if (p.name == name) return p;
  throw Error("no rule " + name);
}

// NxDT modeling_mixtral.py: 0-based layer_index % moe_frequency; transformer.py: 1-based layer_number.
TEST(ModelFamily, MoeLayersFollowEachStylesFrequencyRule) {
  ModelFormat f = TinyMixtral();
  std::vector<int64_t> hf, megatron;
  for (int64_t l = 0; l < 4; ++l) {
    if (IsMoeLayer(f, l)) hf.push_back(l);
    f.family = ModelFamily::kMegatron;
    if (IsMoeLayer(f, l)) megatron.push_back(l);
    f.family = ModelFamily::kHfLlama;
  }
  EXPECT_EQ(hf, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(megatron, (std::vector<int64_t>{1, 3}));
  EXPECT_FALSE(IsMoeLayer(Tiny(1, HwBackend::kUnknown), 0));
}

// NxD's SPMDRank at ep > 1 (parallel_layers/layers.py): `rank` (1,) and
// `local_expert_indices` (1, experts / ep) in each MoE layer, after the router;
// none at ep 1 or in a dense layer. Expert weights are the 3-D ones alone.
TEST(ModelFamily, SpmdRankTensorsFollowTheEpOfEachMoeLayer) {
  ModelFormat f = TinyMixtral();  // 4 experts, HF-style, MoE layers 0 and 2
  const auto at2 = SpmdRankTensors(f, 0, 2);
  ASSERT_EQ(at2.size(), 2u);
  EXPECT_EQ(at2[0].name, "model.layers.0.mlp.expert_mlps.spmd_rank.rank");
  EXPECT_EQ(at2[0].shape, (std::vector<int64_t>{1}));
  EXPECT_EQ(at2[1].name, "model.layers.0.mlp.expert_mlps.spmd_rank.local_expert_indices");
  EXPECT_EQ(at2[1].shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(SpmdRankTensors(f, 2, 4)[1].shape, (std::vector<int64_t>{1, 1}));
  EXPECT_TRUE(SpmdRankTensors(f, 0, 1).empty());
  EXPECT_TRUE(SpmdRankTensors(f, 1, 2).empty());  // a dense layer
  EXPECT_TRUE(IsExpertWeight(f, "model.layers.2.mlp.expert_mlps.mlp_op.gate_up_proj.weight"));
  EXPECT_TRUE(IsExpertWeight(f, "model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight"));
  EXPECT_FALSE(IsExpertWeight(f, "model.layers.0.mlp.router.linear_router.weight"));
  EXPECT_FALSE(IsExpertWeight(f, "model.layers.1.mlp.down_proj.weight"));
  f.family = ModelFamily::kMegatron;  // MoE layers 1 and 3
  EXPECT_EQ(SpmdRankTensors(f, 1, 2)[0].name, "language_model.encoder.layers.1.mlp.moe.expert_mlps.spmd_rank.rank");
}

TEST(ModelFamily, MixtralTableHoldsRouterAndThreeDimensionalExperts) {
  const ModelFormat f = TinyMixtral();
  const auto ps = LogicalParameters(f, 2);
  // Layer 0 is MoE (router, gate_up, down in MoE's module order), layer 1 dense.
  const ParamRule& router = Rule(ps, "model.layers.0.mlp.router.linear_router.weight");
  EXPECT_EQ(router.shape, (std::vector<int64_t>{4, 64}));
  EXPECT_FALSE(router.norm);
  EXPECT_EQ(router.spec.replicated_over, (std::vector<Axis>{Axis::kTp, Axis::kDp}));
  const ParamRule& in = Rule(ps, "model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight");
  const ParamRule& out = Rule(ps, "model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight");
  EXPECT_EQ(in.shape, (std::vector<int64_t>{4, 64, 192}));
  EXPECT_EQ(out.shape, (std::vector<int64_t>{4, 96, 64}));
  EXPECT_EQ(&in - &router, 1);
  EXPECT_EQ(&out - &in, 1);
  EXPECT_EQ(Rule(ps, "model.layers.1.mlp.gate_up_proj.weight").shape, (std::vector<int64_t>{192, 64}));
  EXPECT_THROW(Rule(ps, "model.layers.0.mlp.gate_up_proj.weight"), Error);
  EXPECT_THROW(Rule(ps, "model.layers.1.mlp.router.linear_router.weight"), Error);
  // ep rank 1 of 2, tp rank 1 of 2: experts [2, 4); gate columns [48, 96) and up columns [144, 192).
  AxisCoords at = AxisCoords::Tp(2, 1);
  at[Axis::kEp] = {2, 1};
  const auto boxes = BoxesOf(in.spec, at);
  ASSERT_EQ(boxes.size(), 2u);
  EXPECT_EQ(boxes[0].offset, (std::vector<int64_t>{2, 0, 48}));
  EXPECT_EQ(boxes[1].offset, (std::vector<int64_t>{2, 0, 144}));
  EXPECT_EQ(boxes[1].local, (std::vector<int64_t>{0, 0, 48}));
  EXPECT_EQ(LocalShapeOf(in.spec, at), (std::vector<int64_t>{2, 64, 96}));
  // down_proj: the ffn rows [48, 96) of experts [2, 4).
  const auto down = BoxesOf(out.spec, at);
  ASSERT_EQ(down.size(), 1u);
  EXPECT_EQ(down[0].offset, (std::vector<int64_t>{2, 48, 0}));
  EXPECT_EQ(down[0].size, (std::vector<int64_t>{2, 48, 64}));
}

TEST(ModelFamily, MixtralFormatRecordsItsExpertsAndRefusesWhatIsNotDone) {
  const ModelFormat f = TinyMixtral();
  const auto j = f.ToJson();
  EXPECT_EQ(j.at("num_experts"), 4);
  EXPECT_EQ(ModelFormat::FromJson(j, "m"), f);
  EXPECT_FALSE(Tiny(1, HwBackend::kUnknown).ToJson().contains("num_experts"));  // dense manifests unchanged
  EXPECT_EQ(FamilyLabel(f), "hf_mixtral");
  EXPECT_NE(f.Describe().find("MoE: 4 experts, top 2"), std::string::npos) << f.Describe();
  EXPECT_EQ(f.CheckExpertParallel(2), "");
  EXPECT_NE(f.CheckExpertParallel(3).find("does not divide the 4 MoE experts"), std::string::npos);
  EXPECT_NE(Tiny(1, HwBackend::kUnknown).CheckExpertParallel(2).find("dense"), std::string::npos);
  EXPECT_NE(HfUnsupported(f).find("MoE (Mixtral"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { HfTensorsFor(f, DType::kFloat32); }).find("MoE"), std::string::npos);
  // (Before issue #38's Megatron-style table and HF import, a Megatron-style MoE format and a
  // MixtralForCausalLM config were refused here; MegatronMixtral* and MixtralHf* below test them.)
  ModelFormat gelu = f;
  gelu.gelu = true;
  EXPECT_NE(gelu.CheckTensorParallel(1).find("SwiGLU"), std::string::npos) << gelu.CheckTensorParallel(1);
}

// --- Mixtral (MoE), issue #38: the Megatron-style table, and HF's MixtralForCausalLM ---

ModelFormat MegatronMixtral(int64_t frequency) {
  ModelFormat f;  // tests/data/upstream/nxd_mixtral's model: hidden 16, 4 heads, 2 KV heads, ffn 32, 4 experts
  f.hidden = 16, f.ffn = 32, f.heads = 4, f.kv_heads = 2, f.layers = 2, f.vocab_size = 64;
  f.experts = 4, f.moe_top_k = 2, f.moe_frequency = frequency;
  return f;
}

std::vector<std::string> Names(const std::vector<ParamRule>& ps) {
  std::vector<std::string> out;
  for (const ParamRule& p : ps) out.push_back(p.name);
  return out;
}

// The parameter order NxDT's GPTModel with NeuronSwitchMLP saves (nxd_mixtral/generate_megatron.out.txt).
TEST(ModelFamily, MegatronMixtralTableFollowsNeuronSwitchMlp) {
  const ModelFormat f = MegatronMixtral(1);
  EXPECT_EQ(f.CheckTensorParallel(2), "");
  const auto ps = LogicalParameters(f, 2);
  const std::string l1 = "language_model.encoder.layers.1.";
  auto names = Names(ps);
  const auto at = std::find(names.begin(), names.end(), l1 + "input_layernorm.weight");
  ASSERT_NE(at, names.end());
  EXPECT_EQ(std::vector<std::string>(at, names.end()),
            (std::vector<std::string>{l1 + "input_layernorm.weight", l1 + "self_attention.query.weight", l1 + "self_attention.key_value.weight",
                                      l1 + "self_attention.dense.weight", l1 + "post_attention_layernorm.weight",
                                      l1 + "mlp.moe.router.linear_router.weight", l1 + "mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight",
                                      l1 + "mlp.moe.expert_mlps.mlp_op.down_proj.weight", "language_model.encoder.final_layernorm.weight",
                                      "language_model.output_layer.weight"}));
  const ParamRule& in = Rule(ps, l1 + "mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight");
  EXPECT_EQ(in.shape, (std::vector<int64_t>{4, 16, 64}));
  EXPECT_EQ(LocalShapeOf(in.spec, AxisCoords::Tp(2, 1)), (std::vector<int64_t>{4, 16, 32}));  // the fixture's per-rank shape
  EXPECT_EQ(Rule(ps, l1 + "mlp.moe.router.linear_router.weight").spec.replicated_over, (std::vector<Axis>{Axis::kTp, Axis::kDp}));
  // moe_frequency 2: the 1-based rule makes layer 1 MoE and layer 0 dense (NxDT transformer.py).
  const auto mixed = Names(LogicalParameters(MegatronMixtral(2), 1));
  EXPECT_NE(std::find(mixed.begin(), mixed.end(), "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"), mixed.end());
  EXPECT_EQ(std::find(mixed.begin(), mixed.end(), "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight"), mixed.end());
  // NxDT's Megatron grouping (NeMo get_params_for_weight_decay_optimization): one group, experts included.
  const Grouping g = FamilyGrouping(f, names, GroupingRule::kNxdt);
  EXPECT_EQ(g.GroupSizes(), (std::vector<size_t>{names.size()}));
  // NeuronSwitchMLP is built for more than one expert only; GeLU or biases it asserts against.
  ModelFormat one = f;
  one.experts = 1, one.moe_top_k = 1;
  EXPECT_NE(one.CheckTensorParallel(1).find("num_moe_experts > 1"), std::string::npos);
  ModelFormat bias = f;
  bias.bias = true;
  EXPECT_NE(bias.CheckTensorParallel(1).find("biases"), std::string::npos);
}

const HfTensorSpec& Spec(const std::vector<HfTensorSpec>& specs, const std::string& name) {
  for (const HfTensorSpec& s : specs)
    if (s.name == name) return s;
  throw Error("no HF tensor " + name);
}

// HF's MixtralSparseMoeBlock from NxD's fused, input-major experts
// (nxd_mixtral/README.md "HF reference"): w1[e] = gate_up[e][:, :I].T, w3 the up half, w2 = down[e].T.
TEST(ModelFamily, MixtralHfTensorsTransposeEachExpertsHalves) {
  for (const ModelFamily family : {ModelFamily::kHfLlama, ModelFamily::kMegatron}) {
    ModelFormat f = MegatronMixtral(1);
    f.family = family, f.fuse_qkv = false;
    EXPECT_EQ(HfUnsupported(f), "");
    EXPECT_STREQ(HfArchitecture(f), "MixtralForCausalLM");
    const auto specs = HfTensorsFor(f, DType::kFloat32);
    const std::string gate_up = ParamName(f, Module::kExpertsIn, 1), down = ParamName(f, Module::kExpertsOut, 1);
    const HfTensorSpec& w1 = Spec(specs, "model.layers.1.block_sparse_moe.experts.3.w1.weight");
    EXPECT_EQ(w1.shape, (std::vector<int64_t>{32, 16}));
    EXPECT_TRUE(w1.transpose);
    EXPECT_EQ(w1.width, 32);  // gate_up_proj seen as rows of I: row 2(eH + h) is gate[e][h], the next up[e][h]
    ASSERT_EQ(w1.blocks.size(), 1u);
    EXPECT_EQ(w1.blocks[0].name, gate_up);
    EXPECT_EQ(w1.blocks[0].row, 2 * 3 * 16);
    EXPECT_EQ(w1.blocks[0].rows, 16);
    EXPECT_EQ(w1.blocks[0].step, 2);
    EXPECT_EQ(Spec(specs, "model.layers.1.block_sparse_moe.experts.3.w3.weight").blocks[0].row, 2 * 3 * 16 + 1);
    const HfTensorSpec& w2 = Spec(specs, "model.layers.1.block_sparse_moe.experts.3.w2.weight");
    EXPECT_EQ(w2.shape, (std::vector<int64_t>{16, 32}));
    EXPECT_EQ(w2.width, 16);
    EXPECT_EQ(w2.blocks[0].name, down);
    EXPECT_EQ(w2.blocks[0].row, 3 * 32);
    EXPECT_EQ(w2.blocks[0].step, 1);
    const HfTensorSpec& gate = Spec(specs, "model.layers.0.block_sparse_moe.gate.weight");
    EXPECT_FALSE(gate.transpose);
    EXPECT_EQ(gate.blocks[0].name, ParamName(f, Module::kRouter, 0));
    EXPECT_THROW(Spec(specs, "model.layers.0.mlp.gate_proj.weight"), Error);
  }
  // A dense layer has no MixtralForCausalLM form (HF makes every layer MoE).
  EXPECT_NE(HfUnsupported(MegatronMixtral(2)).find("layer 0 of this MoE (Mixtral) model is dense"), std::string::npos) << HfUnsupported(MegatronMixtral(2));
}

TEST(ModelFamily, MixtralHfConfigGivesExpertsAndRefusesWhatNxdtDoesNotCompute) {
  nlohmann::json c = {{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", 16}, {"intermediate_size", 32},
                      {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"num_hidden_layers", 2},
                      {"vocab_size", 64}, {"max_position_embeddings", 32}, {"num_local_experts", 4},
                      {"num_experts_per_tok", 2}, {"sliding_window", nullptr}};
  const ModelFormat f = FormatOfHfConfig(c, "config.json");
  EXPECT_EQ(f.experts, 4);
  EXPECT_EQ(f.moe_top_k, 2);
  EXPECT_EQ(f.moe_frequency, 1);
  c.erase("num_experts_per_tok");
  EXPECT_EQ(FormatOfHfConfig(c, "config.json").moe_top_k, 2);  // MixtralConfig's default
  c["num_experts_per_tok"] = 5;
  EXPECT_NE(ErrorOf([&] { FormatOfHfConfig(c, "config.json"); }).find("'num_experts_per_tok' 5 exceeds 'num_local_experts' 4"), std::string::npos);
  c["num_experts_per_tok"] = 2, c["sliding_window"] = 8;
  EXPECT_NE(ErrorOf([&] { FormatOfHfConfig(c, "config.json"); }).find("'sliding_window' is 8"), std::string::npos);
  c["sliding_window"] = nullptr, c["hidden_act"] = "gelu";
  EXPECT_NE(ErrorOf([&] { FormatOfHfConfig(c, "config.json"); }).find("'hidden_act'"), std::string::npos);
}

// What a config.json leaves out takes its architecture's transformers defaults
// (MixtralConfig's differ from LlamaConfig's), and one reader owns the Mixtral
// fields: FormatOfHfConfig (the import) and FormatOfHfMixtralConfig (the trainer)
// read and refuse them alike, the import also refusing a sliding window.
TEST(ModelFamily, MixtralConfigDefaultsAreMixtralsAndOneReaderOwnsItsFields) {
  nlohmann::json c = {{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", 16}, {"intermediate_size", 32},
                      {"num_attention_heads", 4}, {"num_hidden_layers", 2}, {"vocab_size", 64}, {"num_local_experts", 4}};
  for (const ModelFormat& f : {FormatOfHfConfig(c, "c.json"), FormatOfHfMixtralConfig(c, "c.json")}) {
    EXPECT_EQ(std::tuple(f.rope_theta, f.norm_eps, f.max_positions), std::tuple(1e6, 1e-5, int64_t{131072}));
    EXPECT_EQ(std::tuple(f.experts, f.moe_top_k, f.moe_frequency, f.kv_heads), std::tuple(4, 2, 1, 4));
  }
  nlohmann::json llama = c;
  llama["architectures"] = {"LlamaForCausalLM"};
  const ModelFormat l = FormatOfHfConfig(llama, "c.json");
  EXPECT_EQ(std::tuple(l.rope_theta, l.norm_eps, l.max_positions, l.experts), std::tuple(10000.0, 1e-6, int64_t{2048}, 0));
  for (const auto& [key, value, why] : {std::tuple("router_jitter_noise", nlohmann::json(0.1), "router_jitter_noise is set"),
                                        std::tuple("hidden_act", nlohmann::json("gelu"), "'hidden_act' is 'gelu'")}) {
    nlohmann::json bad = c;
    bad[key] = value;
    EXPECT_NE(ErrorOf([&] { FormatOfHfConfig(bad, "c.json"); }).find(why), std::string::npos) << key;
    EXPECT_NE(ErrorOf([&] { FormatOfHfMixtralConfig(bad, "c.json"); }).find(why), std::string::npos) << key;
  }
  c["sliding_window"] = 4096;  // the import refuses what a model format cannot carry; the trainer checks it against its sequence
  EXPECT_NE(ErrorOf([&] { FormatOfHfConfig(c, "c.json"); }).find("'sliding_window' is 4096"), std::string::npos);
  EXPECT_EQ(FormatOfHfMixtralConfig(c, "c.json").experts, 4);
}

// Either style's MoE module names a Mixtral tag; a dense Llama's names do not.
TEST(ModelFamily, MoeNamesAreToldFromDenseOnes) {
  EXPECT_EQ(FirstMoeName({"model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight"}), std::nullopt);
  EXPECT_EQ(FirstMoeName({"model.layers.0.input_layernorm.weight", "model.layers.0.mlp.router.linear_router.weight"}),
            "model.layers.0.mlp.router.linear_router.weight");
  EXPECT_EQ(FirstMoeName({"language_model.encoder.layers.1.mlp.moe.expert_mlps.mlp_op.down_proj.weight"}),
            "language_model.encoder.layers.1.mlp.moe.expert_mlps.mlp_op.down_proj.weight");
  EXPECT_EQ(FirstMoeName({"model.layers.0.mlp.shared_experts.gate_proj.weight"}), "model.layers.0.mlp.shared_experts.gate_proj.weight");
  EXPECT_EQ(FirstMoeName({"model.router.weight"}), std::nullopt);  // outside the layers
  const std::string why = MoeRefusal("model.layers.0.mlp.shared_experts.gate_proj.weight");
  EXPECT_NE(why.find("HF-style"), std::string::npos) << why;
  EXPECT_NE(why.find("shared experts"), std::string::npos) << why;
  EXPECT_EQ(MoeRefusal("model.layers.0.mlp.router.linear_router.weight").find("shared experts"), std::string::npos);
  EXPECT_EQ(MoeLeaves(ModelFamily::kMegatron).at(0), "mlp.moe.router.linear_router.weight");
}

// What the family holds of an MoE layer (router, gate_up_proj, down_proj) is read at ep 1; any other part is named.
TEST(ModelFamily, MoePartsOutsideTheFamilyAreNamed) {
  const std::string held = "language_model.encoder.layers.0.mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight";
  EXPECT_EQ(FirstUnheldMoeName({"model.layers.0.mlp.router.linear_router.weight", held, "model.norm.weight"}), std::nullopt);
  EXPECT_EQ(FirstUnheldMoeName({held, "model.layers.1.mlp.expert_mlps.spmd_rank.rank"}), "model.layers.1.mlp.expert_mlps.spmd_rank.rank");
  EXPECT_EQ(FirstUnheldMoeName({"model.layers.0.mlp.router.linear_router.bias"}), "model.layers.0.mlp.router.linear_router.bias");
  // A model file is read when each MoE layer holds router and experts; else its problem names what is missing.
  const std::string p = "model.layers.1.mlp.";
  std::vector<std::string> layer{p + "router.linear_router.weight", p + "expert_mlps.mlp_op.gate_up_proj.weight", p + "expert_mlps.mlp_op.down_proj.weight"};
  EXPECT_EQ(MoeFileProblem(layer), "");
  EXPECT_EQ(MoeFileProblem({"model.norm.weight"}), "");
  layer.pop_back();
  const std::string missing = MoeFileProblem(layer);
  EXPECT_NE(missing.find("MoE (Mixtral) model, HF-style"), std::string::npos) << missing;
  EXPECT_NE(missing.find("but not '" + p + "expert_mlps.mlp_op.down_proj.weight'"), std::string::npos) << missing;
  EXPECT_NE(MoeFileProblem({held, "model.layers.1.mlp.shared_experts.gate_proj.weight"}).find("shared experts"), std::string::npos);
}

}  // namespace ckpt

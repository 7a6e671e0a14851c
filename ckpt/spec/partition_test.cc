#include "ckpt/spec/partition.h"

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "ckpt/spec/model_family.h"
#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

ModelFormat Llama() {
  ModelFormat f;
  f.hidden = 64, f.ffn = 96, f.heads = 8, f.kv_heads = 8, f.layers = 5;
  f.vocab_size = 250, f.make_vocab_size_divisible_by = 8;
  return f;
}

ModelFormat Gpt() {
  ModelFormat f = Llama();
  f.layernorm = f.gelu = f.bias = f.learned_positions = f.tied_output = true;
  f.max_positions = 16;
  return f;
}

const ParamRule& Find(const std::vector<ParamRule>& ps, const std::string& suffix) {
  for (const auto& p : ps)
    if (p.name.ends_with(suffix)) return p;
  throw Error("no parameter ends with " + suffix);
}

// The logical indices rank `rank` holds along the split dim, in local order.
std::vector<int64_t> Indices(const ParamRule& p, const ModelFormat& f, int tp, int rank) {
  std::vector<int64_t> out;
  for (const Run& r : LocalRuns(p, f, tp, rank)) {
    EXPECT_EQ(r.local, static_cast<int64_t>(out.size()));
    for (int64_t i = 0; i < r.count; ++i) out.push_back(r.logical + i);
  }
  return out;
}

TEST(Partition, ARuleWithoutItsShardSpecIsRefusedNamingIt) {
  const ParamRule bare{.name = "w", .shape = {4, 6}, .split = SplitDim::kRows};
  try {
    LocalRuns(bare, ModelFormat{}, 2, 0);
    FAIL() << "a rule with no spec gave runs";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter w of shape [4, 6] has no shard spec"), std::string::npos) << e.what();
  }
  ParamRule made = bare;
  made.spec = TensorParallelSpec(made.shape, made.split, FusedRows::kPlain, ModelFormat{});  // no heads: a plain cut needs none
  EXPECT_EQ(LocalShape(made, ModelFormat{}, 2, 1), (std::vector<int64_t>{2, 6}));
}

TEST(Partition, GptNamesInModuleOrderWithSplitsStatedPerLayer) {
  ModelFormat f = Gpt();
  f.layers = 1;
  std::vector<std::string> names;
  for (const auto& p : LogicalParameters(f)) names.push_back(p.name);
  const std::string L = "language_model.encoder.layers.0.";
  EXPECT_EQ(names, (std::vector<std::string>{
                       "language_model.embedding.word_embeddings.weight", "language_model.embedding.position_embeddings.weight",
                       L + "input_layernorm.weight", L + "input_layernorm.bias", L + "self_attention.query_key_value.weight",
                       L + "self_attention.query_key_value.bias", L + "self_attention.dense.weight", L + "self_attention.dense.bias",
                       L + "post_attention_layernorm.weight", L + "post_attention_layernorm.bias", L + "mlp.dense_h_to_4h.weight",
                       L + "mlp.dense_h_to_4h.bias", L + "mlp.dense_4h_to_h.weight", L + "mlp.dense_4h_to_h.bias",
                       "language_model.encoder.final_layernorm.weight", "language_model.encoder.final_layernorm.bias"}));
  const auto ps = LogicalParameters(f);
  EXPECT_EQ(Find(ps, "query_key_value.bias").split, SplitDim::kRows);  // column-parallel bias: split like its rows
  EXPECT_EQ(Find(ps, "query_key_value.bias").fused, FusedRows::kPerHeadQkv);
  EXPECT_EQ(Find(ps, "dense_h_to_4h.bias").fused, FusedRows::kPlain);  // GeLU: one projection
  EXPECT_EQ(Find(ps, "dense.bias").split, SplitDim::kReplicated);      // row-parallel bias: whole
  EXPECT_EQ(Find(ps, "4h_to_h.weight").split, SplitDim::kColumns);
  EXPECT_EQ(Find(ps, "position_embeddings.weight").split, SplitDim::kReplicated);
}

TEST(Partition, PaddingRuleIsInferredFromRows) {
  EXPECT_EQ(ModelFormat::PaddingRuleGiving(32000, 32000, 2), 128);  // NNM's default fits: 32000 = 125 x 128 x 2
  EXPECT_EQ(ModelFormat::PaddingRuleGiving(250, 256, 2), 128);
  EXPECT_EQ(ModelFormat::PaddingRuleGiving(40, 48, 2), 6);   // 128 x 2 would give 256 rows; 4 x 2 gives 40, 6 x 2 gives 48
  EXPECT_EQ(ModelFormat::PaddingRuleGiving(48, 48, 2), 1);
  EXPECT_EQ(ModelFormat::PaddingRuleGiving(50, 48, 2), std::nullopt);  // more tokens than rows
  EXPECT_EQ(ModelFormat::PaddingRuleGiving(48, 49, 2), std::nullopt);  // rows not split over tp
  for (const auto& [vocab, rows, tp] : std::vector<std::tuple<int64_t, int64_t, int>>{{50257, 51200, 8}, {40, 48, 2}, {7, 64, 4}}) {
    ModelFormat f;
    f.vocab_size = vocab, f.make_vocab_size_divisible_by = *ModelFormat::PaddingRuleGiving(vocab, rows, tp);
    EXPECT_EQ(f.PaddedVocab(tp), rows) << vocab << " " << rows << " " << tp;
  }
}

TEST(Partition, VocabIsPaddedToDivisibleTimesTp) {
  const ModelFormat f = Llama();  // 250 tokens, divisible by 8
  EXPECT_EQ(f.PaddedVocab(1), 256);
  EXPECT_EQ(f.PaddedVocab(4), 256);
  EXPECT_EQ(f.PaddedVocab(3), 264);
  EXPECT_EQ(LogicalParameters(f, 3).front().shape, (std::vector<int64_t>{264, 64}));
  EXPECT_TRUE(LogicalParameters(f, 3).back().vocab);  // the output layer
  EXPECT_EQ(LocalShape(LogicalParameters(f, 3).back(), f, 3, 2), (std::vector<int64_t>{88, 64}));
}

TEST(Partition, PerHeadQkvRanksHoldWholeHeadsInOrder) {
  const ModelFormat f = Llama();
  const auto ps = LogicalParameters(f);
  const ParamRule& qkv = Find(ps, "query_key_value.weight");
  const int64_t per_head = 3 * f.head_dim();
  for (int tp : {1, 2, 4, 8}) {
    for (int r = 0; r < tp; ++r) {
      const auto idx = Indices(qkv, f, tp, r);
      ASSERT_EQ(static_cast<int64_t>(idx.size()), 3 * f.hidden / tp);
      // Rank r's first row is the q row 0 of its first head, h = r * heads / tp.
      EXPECT_EQ(idx.front(), r * (f.heads / tp) * per_head);
      EXPECT_EQ(idx.back() + 1, (r + 1) * (f.heads / tp) * per_head);
    }
  }
}

TEST(Partition, GateUpRanksHoldTheirGateRowsThenTheirUpRows) {
  const ModelFormat f = Llama();
  const auto ps = LogicalParameters(f);
  const ParamRule& fc = Find(ps, "dense_h_to_4h.weight");
  ASSERT_EQ(fc.fused, FusedRows::kGateUp);
  const int tp = 4;
  const int64_t part = f.ffn / tp;
  for (int r = 0; r < tp; ++r) {
    std::vector<int64_t> want;
    for (int64_t i = 0; i < part; ++i) want.push_back(r * part + i);           // gate_r
    for (int64_t i = 0; i < part; ++i) want.push_back(f.ffn + r * part + i);   // up_r
    EXPECT_EQ(Indices(fc, f, tp, r), want) << "rank " << r;
  }
}

TEST(Partition, RowParallelSplitsColumnsAndEveryIndexIsHeldOnce) {
  const ModelFormat f = Llama();
  for (const auto& p : LogicalParameters(f)) {
    if (p.split == SplitDim::kReplicated) continue;
    for (int tp : {2, 4}) {
      std::map<int64_t, int> seen;
      for (int r = 0; r < tp; ++r)
        for (int64_t i : Indices(p, f, tp, r)) ++seen[i];
      const int64_t extent = p.shape[p.split == SplitDim::kRows ? 0 : 1];
      ASSERT_EQ(static_cast<int64_t>(seen.size()), extent) << p.name;
      for (const auto& [i, n] : seen) EXPECT_EQ(n, 1) << p.name << " index " << i;
      EXPECT_EQ(seen.begin()->first, 0);
    }
  }
  EXPECT_EQ(LocalShape(Find(LogicalParameters(f), "4h_to_h.weight"), f, 4, 1), (std::vector<int64_t>{64, 24}));
}

TEST(Partition, FewerKvGroupsThanRanksAreReplicatedOverConsecutiveRanks) {
  ModelFormat f = Llama();
  f.kv_heads = 2;  // 8 query heads, 2 KV groups
  const auto ps = LogicalParameters(f);
  const ParamRule& kv = Find(ps, "key_value.weight");
  ASSERT_EQ(kv.fused, FusedRows::kPerGroupKv);
  const int64_t group = 2 * f.head_dim();
  ASSERT_EQ(kv.shape[0], 2 * group);
  // tp 8: kv_size_multiplier 4; ranks 0-3 hold group 0 (whose query heads are 0-3), ranks 4-7 group 1.
  for (int r = 0; r < 8; ++r) {
    const auto idx = Indices(kv, f, 8, r);
    ASSERT_EQ(static_cast<int64_t>(idx.size()), group);
    EXPECT_EQ(idx.front(), (r / 4) * group) << "rank " << r;
    // The query heads of rank r are r (one per rank) and belong to group r / (heads / kv_heads).
    EXPECT_EQ(idx.front() / group, r / (f.heads / f.kv_heads));
    // The ranks that hold the same group with it: 0-3 or 4-7.
    const KvReplicas kvr = KvReplicasOf(f.kv_heads, 8, r);
    EXPECT_EQ(kvr.group, r / 4);
    EXPECT_EQ(kvr.first, r / 4 * 4);
    EXPECT_EQ(kvr.count, 4);
  }
  EXPECT_EQ(f.CheckTensorParallel(8), "");
  EXPECT_EQ(f.CheckTensorParallel(2), "");
  f.heads = 24, f.kv_heads = 6, f.hidden = 96;
  EXPECT_NE(f.CheckTensorParallel(4).find("KV heads (6)"), std::string::npos);  // 4 neither divides 6 nor is a multiple of it
}

TEST(Partition, DegreesThatDoNotDivideAreNamed) {
  const ModelFormat f = Llama();
  EXPECT_NE(f.CheckTensorParallel(3).find("attention heads (8)"), std::string::npos);
  ModelFormat g = f;
  g.ffn = 90;
  EXPECT_NE(g.CheckTensorParallel(4).find("FFN width (90)"), std::string::npos);
  EXPECT_THROW(StageBounds(5, 6), Error);
  EXPECT_THROW(StageBounds(5, 2, {0}), Error);
  EXPECT_THROW(StageBounds(5, 3, {3, 2}), Error);
  EXPECT_THROW(StageBounds(5, 3, {2}), Error);
}

TEST(Partition, StagesSplitEvenlyWithTheRemainderLastOrAtCuts) {
  EXPECT_EQ(StageBounds(32, 3), (std::vector<int64_t>{0, 10, 21, 32}));  // 10, 11, 11
  EXPECT_EQ(StageBounds(10, 3), (std::vector<int64_t>{0, 3, 6, 10}));
  EXPECT_EQ(StageBounds(5, 1), (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(StageBounds(5, 3, {1, 4}), (std::vector<int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(CutsOf(StageBounds(5, 3, {1, 4})), (std::vector<int64_t>{1, 4}));
}

TEST(Partition, VirtualStagesCutPpTimesVAndRankPHoldsStagesPPlusPp) {
  // NxD create_partitions(pp * V, layers): 10 layers in 4 stages 2, 2, 3, 3; pp rank 0 runs stages 0 and 2.
  const auto b = VirtualStageBounds(10, 2, 2);
  EXPECT_EQ(b, (std::vector<int64_t>{0, 2, 4, 7, 10}));
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(RankLayerRanges(b, 2, 0), (R{{0, 2}, {4, 7}}));
  EXPECT_EQ(RankLayerRanges(b, 2, 1), (R{{2, 4}, {7, 10}}));
  EXPECT_EQ(RankLayerRanges(b, 1, 3), (R{{7, 10}}));  // V = 1: stage and pp rank are one
  EXPECT_TRUE(RankHoldsLayer(b, 2, 0, 5));
  EXPECT_FALSE(RankHoldsLayer(b, 2, 0, 3));
  EXPECT_EQ(LayerRangesString(RankLayerRanges(b, 2, 0)), "0..1, 4..6");
  EXPECT_EQ(VirtualStageBounds(10, 2, 1), StageBounds(10, 2));
  EXPECT_EQ(VirtualStageBounds(4, 2, 2, {1, 2, 3}), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(testing::ErrorOf([] { VirtualStageBounds(3, 2, 2); }),
            "virtual_pipeline_size 2 at pp 2 cuts the 3 layers in 4 virtual pipeline stages: every stage needs at least one layer");
  EXPECT_NE(testing::ErrorOf([] { VirtualStageBounds(8, 2, 2, {4}); }).find("4 virtual pipeline stages (pp 2 x virtual_pipeline_size 2) need 3"),
            std::string::npos);
}

TEST(Partition, AVirtualStageRanksParametersAreInModuleOrderAsNxdsOptimizerSeesThem) {
  const ModelFormat f = Gpt();  // 5 layers
  const auto ps = LogicalParameters(f);
  const auto b = VirtualStageBounds(f.layers, 2, 2);  // stages 1, 1, 1, 2: rank 0 layers 0 and 2, rank 1 layers 1 and 3..4
  const auto r0 = StageParameters(ps, b, 0, TiedCopyNaming::kNxdt, 2), r1 = StageParameters(ps, b, 1, TiedCopyNaming::kNxdt, 2);
  auto names = [](const std::vector<StageParam>& s) {
    std::vector<std::string> n;
    for (const auto& p : s) n.push_back(p.name);
    return n;
  };
  // Chunk by chunk in stage order (NxDPPModel.local_named_parameters), which is module order.
  std::vector<std::string> want0, want1;
  for (const auto& p : ps) {
    const int l = LayerOfName(p.name);
    if (p.name.find("word_embeddings") != std::string::npos || p.name.find("position_embeddings") != std::string::npos || l == 0 || l == 2)
      want0.push_back(p.name);
    else
      want1.push_back(p.name);
  }
  want1.push_back(kTiedOutputCopy);  // GPT's tied copy on the last stage (pp rank 1's chunk 1)
  EXPECT_EQ(names(r0), want0);
  EXPECT_EQ(names(r1), want1);
  EXPECT_EQ(r0.size() + r1.size(), ps.size() + 1);
}

TEST(Partition, StagesOwnTheirLayersAndGptsTiedCopySitsOnTheLastStage) {
  const ModelFormat f = Gpt();  // 5 layers
  const auto ps = LogicalParameters(f);
  const auto bounds = StageBounds(f.layers, 2);  // 2, 3
  const auto first = StageParameters(ps, bounds, 0), last = StageParameters(ps, bounds, 1);
  EXPECT_EQ(first.front().name, "language_model.embedding.word_embeddings.weight");
  EXPECT_EQ(first.back().name, "language_model.encoder.layers.1.mlp.dense_4h_to_h.bias");
  EXPECT_EQ(last.front().name, "language_model.encoder.layers.2.input_layernorm.weight");
  // NxDT's naming: the copy is the last stage's language_model.output_layer.weight.
  EXPECT_EQ(last.back().name, "language_model.output_layer.weight");
  EXPECT_TRUE(last.back().tied_copy());
  EXPECT_EQ(last.back().rule->name, "language_model.embedding.word_embeddings.weight");
  EXPECT_EQ(first.size() + last.size(), ps.size() + 1);
  // One stage holds both names, the copy where an untied output layer would be (NxDT's state_dict).
  const auto one = StageParameters(ps, StageBounds(f.layers, 1), 0);
  EXPECT_EQ(one.size(), ps.size() + 1);
  EXPECT_EQ(one.front().name, "language_model.embedding.word_embeddings.weight");
  EXPECT_EQ(one.back().name, "language_model.output_layer.weight");
  EXPECT_TRUE(one.back().tied_copy());
  EXPECT_EQ(SameStageTiedCopy(one), "language_model.output_layer.weight");
  EXPECT_EQ(SameStageTiedCopy(last), "");  // the embedding is on stage 0
  // Megatron-LM's naming (NNM, shardkit before): word_embeddings.weight with pp > 1 only.
  EXPECT_EQ(StageParameters(ps, bounds, 1, TiedCopyNaming::kMegatronLm).back().name, "word_embeddings.weight");
  EXPECT_EQ(StageParameters(ps, StageBounds(f.layers, 1), 0, TiedCopyNaming::kMegatronLm).size(), ps.size());
  // Llama has its own output layer on the last stage and no copy.
  const auto lp = LogicalParameters(Llama());
  EXPECT_EQ(StageParameters(lp, StageBounds(5, 2), 1).back().name, "language_model.output_layer.weight");
  EXPECT_FALSE(StageParameters(lp, StageBounds(5, 2), 1).back().tied_copy());
}

// NxDT's own Megatron GPT and Llama, built on CPU (tests/data/upstream/nxdt_megatron):
// one stage holds exactly the state_dict's parameters, in its order and
// shapes, GPT's tied output layer included. NxDT loads with a strict key check.
TEST(Partition, OneStageHoldsWhatNxdtsModelsStateDictHolds) {
  std::ifstream in(std::string(SHARDKIT_TEST_DATA) + "/upstream/nxdt_megatron/megatron_groups.json");
  ASSERT_TRUE(in) << "missing fixture tests/data/upstream/nxdt_megatron/megatron_groups.json";
  const nlohmann::json j = nlohmann::json::parse(in);
  for (const char* model : {"gpt", "llama"}) {
    const nlohmann::json& m = j.at("models").at(model);
    const nlohmann::json& o = m.at("config_overrides");
    ModelFormat f;
    f.hidden = o.at("hidden_size"), f.ffn = o.at("ffn_hidden_size"), f.heads = o.at("num_attention_heads");
    f.kv_heads = o.at("num_kv_heads"), f.layers = o.at("num_layers");
    f.vocab_size = o.at("padded_vocab_size"), f.make_vocab_size_divisible_by = 1;
    if (std::string(model) == "gpt") {
      f.layernorm = f.gelu = f.bias = f.learned_positions = f.tied_output = true;
      f.max_positions = o.at("max_position_embeddings");
    }
    std::vector<std::pair<std::string, std::vector<int64_t>>> want, got;
    for (const auto& e : m.at("model").at("state_dict"))
      if (e.at("kind") == "parameter") want.emplace_back(e.at("key"), e.at("shape").get<std::vector<int64_t>>());
    const auto ps = LogicalParameters(f);
    for (const StageParam& sp : StageParameters(ps, StageBounds(f.layers, 1), 0)) got.emplace_back(sp.name, LocalShape(*sp.rule, f, 1, 0));
    EXPECT_EQ(got, want) << model;
    // Each rank of tensor-parallel size 2 (buffers left out: the fixture lists parameters and buffers alike).
    for (int r = 0; r < 2; ++r) {
      std::vector<std::pair<std::string, std::vector<int64_t>>> rank_want, rank_got;
      for (const auto& e : m.at("tp2").at("tp_rank_" + std::to_string(r)).at("state_dict"))
        if (!e.at("key").get<std::string>().ends_with("inv_freq")) rank_want.emplace_back(e.at("key"), e.at("shape").get<std::vector<int64_t>>());
      const auto ps2 = LogicalParameters(f, 2);  // StageParams point into it
      for (const StageParam& sp : StageParameters(ps2, StageBounds(f.layers, 1), 0))
        rank_got.emplace_back(sp.name, LocalShape(*sp.rule, f, 2, r));
      EXPECT_EQ(rank_got, rank_want) << model << " tp rank " << r;
    }
  }
}

TEST(Partition, ModelFormatRoundTripsThroughJsonAndBadFieldsAreNamed) {
  const ModelFormat f = Gpt();
  EXPECT_EQ(ModelFormat::FromJson(f.ToJson(), "m"), f);
  auto j = nlohmann::json(f.ToJson());
  j["num_kv_heads"] = 3;
  try {
    ModelFormat::FromJson(j, "manifest.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("num_kv_heads"), std::string::npos);
  }
  j = f.ToJson();
  j["activation"] = "relu";
  EXPECT_THROW(ModelFormat::FromJson(j, "m"), Error);
  j = f.ToJson();
  j.erase("hidden_size");
  EXPECT_THROW(ModelFormat::FromJson(j, "m"), Error);
}

// LocalRuns as it was before shard specs (b7a6ebd: partition.cc LocalRuns and
// model_family.cc HeadRuns, KvHeadsOfRank, QueryHeadsOfRank), kept verbatim as
// the oracle the boxes of the specs must match.
namespace before_specs {
void AddHeadRuns(std::vector<Run>& runs, int64_t& local, int64_t base, const std::vector<int64_t>& heads, int64_t hd) {
  const size_t first = runs.size();
  for (int64_t h : heads) {
    if (runs.size() > first && runs.back().local + runs.back().count == local && runs.back().logical + runs.back().count == base + h * hd)
      runs.back().count += hd;
    else
      runs.push_back({local, base + h * hd, hd});
    local += hd;
  }
}
std::vector<int64_t> KvHeads(const ModelFormat& f, int tp, int rank) {
  const int64_t m = f.kv_size_multiplier, kv = f.kv_heads, n = kv * m / tp;
  std::vector<int64_t> heads;
  if (m == 1) {
    for (int64_t i = 0; i < n; ++i) heads.push_back(rank * n + i);
  } else {
    heads.push_back(f.hw_backend == HwBackend::kTrn2 ? rank / m : rank % kv);
  }
  return heads;
}
std::vector<int64_t> QueryHeads(const ModelFormat& f, int tp, int rank) {
  const int64_t m = f.kv_size_multiplier, kv = f.kv_heads, qn = f.heads / tp;
  const int64_t block = m > 1 && f.hw_backend != HwBackend::kTrn2 ? rank % kv * m + rank / kv : rank;
  std::vector<int64_t> heads;
  for (int64_t i = 0; i < qn; ++i) heads.push_back(block * qn + i);
  return heads;
}
std::vector<Run> HeadRuns(const ParamRule& p, const ModelFormat& f, int tp, int rank) {
  const int64_t hd = f.head_dim();
  std::vector<Run> runs;
  int64_t local = 0;
  if (p.fused == FusedRows::kQueryHeads) AddHeadRuns(runs, local, 0, QueryHeads(f, tp, rank), hd);
  if (p.fused == FusedRows::kKvHeads) AddHeadRuns(runs, local, 0, KvHeads(f, tp, rank), hd);
  if (p.fused == FusedRows::kQkvHeads) {
    const auto kv = KvHeads(f, tp, rank);
    AddHeadRuns(runs, local, 0, QueryHeads(f, tp, rank), hd);
    AddHeadRuns(runs, local, f.heads * hd, kv, hd);
    AddHeadRuns(runs, local, (f.heads + f.kv_heads) * hd, kv, hd);
  }
  return runs;
}
std::vector<Run> LocalRuns(const ParamRule& p, const ModelFormat& f, int tp, int rank) {
  if (p.split == SplitDim::kReplicated) return {{0, 0, p.shape.at(0)}};
  if (p.fused == FusedRows::kQueryHeads || p.fused == FusedRows::kKvHeads || p.fused == FusedRows::kQkvHeads) return HeadRuns(p, f, tp, rank);
  const int64_t extent = p.shape.at(p.split == SplitDim::kRows ? 0 : 1);
  if (p.fused == FusedRows::kGateUp) {
    const int64_t half = extent / 2 / tp;
    return {{0, rank * half, half}, {half, extent / 2 + rank * half, half}};
  }
  if (p.fused == FusedRows::kPerGroupKv && f.kv_heads < tp) {
    const int64_t group = extent / f.kv_heads;
    return {{0, KvReplicasOf(f.kv_heads, tp, rank).group * group, group}};
  }
  const int64_t n = extent / tp;
  return {{0, rank * n, n}};
}
}  // namespace before_specs

// Every format the families lay out: Megatron-style llama (MHA and GQA, KV
// groups replicated below tp), GPT, and the HF-style family in each attention
// form, with KV replication by each backend.
std::vector<ModelFormat> EveryLayoutFormat() {
  std::vector<ModelFormat> out{Llama(), Gpt()};
  ModelFormat gqa = Llama();
  gqa.kv_heads = 2;
  out.push_back(gqa);
  for (auto [fuse, linear, kv] : {std::tuple{true, true, 2}, {false, true, 2}, {true, false, 8}, {false, false, 2}})
    for (int64_t m : {1, 2, 4})
      for (HwBackend hw : {HwBackend::kUnknown, HwBackend::kTrn1, HwBackend::kTrn2}) {
        ModelFormat f = Llama();
        f.family = ModelFamily::kHfLlama, f.vocab_size = 256, f.make_vocab_size_divisible_by = 1;
        f.fuse_qkv = fuse, f.qkv_linear = linear, f.kv_heads = kv, f.kv_size_multiplier = m, f.hw_backend = hw;
        out.push_back(f);
      }
  return out;
}

TEST(Partition, BoxesOfEverySpecGiveTheRunsOfTheRulesBeforeSpecs) {
  int compared = 0, replicated_kv = 0;
  std::set<FusedRows> kinds;
  for (const ModelFormat& f : EveryLayoutFormat())
    for (int tp : {1, 2, 4, 8}) {
      if (!f.CheckTensorParallel(tp).empty()) continue;
      for (const ParamRule& p : LogicalParameters(f, tp))
        for (int r = 0; r < tp; ++r) {
          const std::vector<ckpt::Run> want = before_specs::LocalRuns(p, f, tp, r);
          const std::vector<ckpt::Run> got = LocalRuns(p, f, tp, r);
          ASSERT_EQ(got, want) << p.name << " at tp " << tp << " rank " << r << ": " << f.Describe();
          std::vector<int64_t> shape = p.shape;
          if (p.split != SplitDim::kReplicated) {
            shape[p.split == SplitDim::kRows ? 0 : 1] = 0;
            for (const ckpt::Run& run : want) shape[p.split == SplitDim::kRows ? 0 : 1] += run.count;
          }
          ASSERT_EQ(LocalShape(p, f, tp, r), shape) << p.name << " at tp " << tp << " rank " << r;
          ++compared, kinds.insert(p.fused);
          replicated_kv += (p.fused == FusedRows::kPerGroupKv || p.fused == FusedRows::kKvHeads) && f.kv_heads < tp;
        }
    }
  // Every fused layout, KV replication of both families, and enough cases to mean it.
  EXPECT_EQ(kinds.size(), 7u);
  EXPECT_GT(replicated_kv, 100);
  EXPECT_GT(compared, 5000);
}

TEST(Partition, LayerOfName) {
  EXPECT_EQ(LayerOfName("language_model.encoder.layers.17.mlp.dense_h_to_4h.weight"), 17);
  EXPECT_EQ(LayerOfName("language_model.embedding.word_embeddings.weight"), -1);
  EXPECT_EQ(LayerOfName("x.layers.abc.y"), -1);
}

TEST(Partition, Zero1ShardsPadDimZeroToAMultipleOfDp) {
  EXPECT_EQ(Zero1ShardRows(10, 4), 3);
  EXPECT_EQ(Zero1ShardRows(8, 4), 2);
  EXPECT_EQ(Zero1ShardRows(1, 2), 1);
}

}  // namespace
}  // namespace ckpt

// The reshard planner and writer (WriteInLayout) over a fake source: every
// logical element's value is a function of its tensor and index, so each rank
// file's local tensor is checked element for element against the placement the
// rules name, for every KV replication rule and across many stream chunks.
#include "ckpt/shard/reshard.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <set>

#include "ckpt/util/crc32.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/shard/sharded_tag.h"
#include "ckpt/shard/fake_state.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::FakeState;
using testing::TempDir;

ModelFormat HfLlama(int64_t heads, int64_t kv, int64_t m, HwBackend backend, bool fused = true) {
  ModelFormat f;
  f.family = ModelFamily::kHfLlama;
  f.hidden = 8 * heads, f.ffn = 32, f.heads = heads, f.kv_heads = kv, f.layers = 2, f.vocab_size = 64;
  f.fuse_qkv = fused, f.qkv_linear = true, f.kv_size_multiplier = m, f.hw_backend = backend;
  return f;
}

// Writes the fake source at tp (pp 1) and returns every rank file's model dict.
std::vector<Value> Write(const TempDir& dir, const ModelFormat& f, int tp, const ReshardArgs& extra = {}, ReshardSummary* out = nullptr) {
  Env* env = Env::Default();
  env->CreateDirs(dir / "src");
  FakeState src(dir / "src", f);
  ReshardArgs a = extra;
  a.dst = dir / "out", a.tp = tp, a.pp = 1, a.threads = 1;
  ReshardSummary sum;
  sum.src_tag = src.path();
  sum = WriteInLayout(src, "", a, env, [](const std::string&) {}, std::chrono::steady_clock::now(), sum);
  if (out) *out = sum;
  std::vector<Value> files;
  for (int t = 0; t < tp; ++t) files.push_back(LoadPt(dir / ("out/model/" + RankFileName({0, t, 0}))));
  return files;
}

// Row `row` of a local tensor.
std::vector<float> Row(const Value& file, const std::string& name, int64_t row) {
  const Tensor& t = file.as_dict().At(name).as_tensor();
  const int64_t width = t.shape()[1];
  std::vector<float> out(width);
  std::memcpy(out.data(), t.data() + row * width * 4, width * 4);
  return out;
}
std::vector<float> LogicalRow(const std::string& name, int64_t row, int64_t width) {
  std::vector<float> out(width);
  for (int64_t c = 0; c < width; ++c) out[c] = FakeState::ValueOf(name, row * width + c);
  return out;
}

TEST(Reshard, Trn1ReplicationPlacesQueriesAndKvAsNxd) {
  TempDir dir("reshard");
  const ModelFormat f = HfLlama(8, 2, 4, HwBackend::kTrn1);  // tp 8: query block (r % 2) * 4 + r / 2, KV head r % 2
  const auto files = Write(dir, f, 8);
  const std::string qkv = "model.layers.1.self_attn.qkv_proj.weight_qkv";
  const int64_t H = f.hidden, hd = f.head_dim(), Q = f.heads * hd;
  for (int r = 0; r < 8; ++r) {
    const int64_t q = (r % 2) * 4 + r / 2, kv = r % 2;
    for (int64_t i = 0; i < hd; ++i) {
      EXPECT_EQ(Row(files[r], qkv, i), LogicalRow(qkv, q * hd + i, H)) << r;
      EXPECT_EQ(Row(files[r], qkv, hd + i), LogicalRow(qkv, Q + kv * hd + i, H)) << r;
      EXPECT_EQ(Row(files[r], qkv, 2 * hd + i), LogicalRow(qkv, Q + 2 * hd + kv * hd + i, H)) << r;
    }
    // o_proj: the same query head's columns.
    const Tensor& o = files[r].as_dict().At("model.layers.1.self_attn.o_proj.weight").as_tensor();
    ASSERT_EQ(o.shape(), (std::vector<int64_t>{H, hd}));
    for (int64_t row = 0; row < H; ++row)
      for (int64_t c = 0; c < hd; ++c) {
        float got;
        std::memcpy(&got, o.data() + (row * hd + c) * 4, 4);
        ASSERT_EQ(got, FakeState::ValueOf("model.layers.1.self_attn.o_proj.weight", row * Q + q * hd + c)) << r;
      }
  }
}

TEST(Reshard, Trn2ReplicationKeepsQueriesInOrder) {
  TempDir dir("reshard");
  const ModelFormat f = HfLlama(8, 2, 2, HwBackend::kTrn2, false);  // tp 4: queries 2r, 2r+1; KV head r / 2
  const auto files = Write(dir, f, 4);
  const int64_t H = f.hidden, hd = f.head_dim();
  for (int r = 0; r < 4; ++r)
    for (int64_t i = 0; i < hd; ++i) {
      EXPECT_EQ(Row(files[r], "model.layers.0.self_attn.qkv_proj.weight_q", i), LogicalRow("model.layers.0.self_attn.qkv_proj.weight_q", 2 * r * hd + i, H));
      EXPECT_EQ(Row(files[r], "model.layers.0.self_attn.qkv_proj.weight_k", i), LogicalRow("model.layers.0.self_attn.qkv_proj.weight_k", r / 2 * hd + i, H));
    }
}

TEST(Reshard, MegatronKvGroupsBelowTpAreConsecutive) {
  TempDir dir("reshard");
  ModelFormat f;
  f.hidden = 32, f.ffn = 32, f.heads = 4, f.kv_heads = 2, f.layers = 1, f.vocab_size = 64;
  const auto files = Write(dir, f, 4);  // shardkit's rule: rank r holds group r / 2 ([k_g; v_g] rows)
  const std::string kv = "language_model.encoder.layers.0.self_attention.key_value.weight";
  for (int r = 0; r < 4; ++r)
    for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(Row(files[r], kv, i), LogicalRow(kv, r / 2 * 16 + i, 32)) << r;
}

// A tensor many stream chunks long (the smallest chunk, 256 KiB, at the smallest budget) is written whole and exact.
TEST(Reshard, ATensorOfManyChunksIsExact) {
  TempDir dir("reshard");
  ModelFormat f = HfLlama(8, 8, 1, HwBackend::kUnknown);
  f.vocab_size = 131072;  // the embedding: 131072 x 64 float32 = 32 MiB, 16 MiB per rank at tp 2
  ReshardArgs a;
  // What is held now and a few MiB: chunks of a few MiB. The process's own allocations before the
  // writer measures (about 1 MiB, 6 under ASan) come off that margin; a margin they leave below
  // one writing thread's minimum is refused ("smaller than one slice"), and the next is tried.
  ReshardSummary sum;
  std::vector<Value> files;
  for (uint64_t margin : {10, 12, 14}) {
    a.memory_budget = CurrentRss() + (margin << 20);
    const std::string e = testing::ErrorOf([&] { files = Write(dir, f, 2, a, &sum); });
    if (e.empty()) break;
    ASSERT_NE(e.find("is smaller than one slice"), std::string::npos) << e;
    Env::Default()->RemoveAll(dir / "out");
  }
  ASSERT_EQ(files.size(), 2u);
  EXPECT_LE(sum.stream_chunk * 4, uint64_t{16} << 20) << "each rank's embedding must span several chunks";
  EXPECT_LE(sum.peak_rss, a.memory_budget + (16 << 20));
  const auto m = Manifest::Load(Env::Default(), dir / "out/manifest.json");
  const auto tag = ShardedTag::Open(Env::Default(), dir / "out");
  for (const auto& p : tag->params()) {
    const uint64_t n = static_cast<uint64_t>(ShapeNumel(p.shape));
    std::vector<uint8_t> got(n * 4);
    tag->Read(p.name, StateField::kParam, 0, got, nullptr);
    for (uint64_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, got.data() + 4 * i, 4);
      ASSERT_EQ(v, FakeState::ValueOf(p.name, i)) << p.name << " element " << i;
    }
  }
  EXPECT_EQ(m.model->family, ModelFamily::kHfLlama);
  const Tensor& emb = files[1].as_dict().At("model.embed_tokens.weight").as_tensor();
  EXPECT_EQ(emb.shape(), (std::vector<int64_t>{65536, 64}));
}

TEST(Reshard, VirtualPipelineStagesAreWrittenAsNxdLaysThemOutAndReadBack) {
  TempDir dir("reshard");
  Env* env = Env::Default();
  env->CreateDirs(dir / "src");
  ModelFormat f = testing::SmallLlama();
  f.layers = 5;
  FakeState src(dir / "src", f);
  ReshardArgs a;
  a.dst = dir / "out", a.tp = 1, a.pp = 2, a.threads = 1, a.virtual_pipeline_size = 2;
  ReshardSummary sum;
  sum.src_tag = src.path();
  sum = WriteInLayout(src, "", a, env, [](const std::string&) {}, std::chrono::steady_clock::now(), sum);
  EXPECT_EQ(sum.to_bounds, (std::vector<int64_t>{0, 1, 2, 3, 5}));  // NxD's create_partitions(4, 5 layers): 1, 1, 1, 2
  // Each pp rank's file holds its stages' layers under their global names, and nothing else of the layers.
  std::vector<std::set<int>> layers(2);
  for (int p = 0; p < 2; ++p) {
    const Value file = LoadPt(dir / ("out/model/" + RankFileName({0, 0, p})));
    for (const auto& [k, v] : file.as_dict().items)
      if (const int l = LayerOfName(k.as_str()); l >= 0) layers[p].insert(l);
  }
  EXPECT_EQ(layers[0], (std::set<int>{0, 2}));
  EXPECT_EQ(layers[1], (std::set<int>{1, 3, 4}));
  const Manifest m = Manifest::Load(env, dir / "out/manifest.json");
  EXPECT_EQ(m.layout->stages, (StageMap{{{0, 1}, {2, 3}}, {{1, 2}, {3, 5}}}));
  const auto tag = ShardedTag::Open(env, dir / "out");
  EXPECT_EQ(tag->layout().virtual_stages, 2);
  EXPECT_EQ(tag->layout().stage_bounds, sum.to_bounds);
  for (const auto& p : tag->params()) {
    std::vector<uint8_t> got(static_cast<size_t>(ShapeNumel(p.shape)) * 4);
    tag->Read(p.name, StateField::kParam, 0, got, nullptr);
    float v;
    std::memcpy(&v, got.data() + got.size() - 4, 4);
    ASSERT_EQ(v, FakeState::ValueOf(p.name, got.size() / 4 - 1)) << p.name;
  }
  // A V that leaves a stage without a layer is refused naming the virtual pipeline.
  a.dst = dir / "bad", a.virtual_pipeline_size = 3;
  EXPECT_NE(testing::ErrorOf([&] { WriteInLayout(src, "", a, env, [](const std::string&) {}, std::chrono::steady_clock::now(), sum); })
                .find("virtual_pipeline_size 3 at pp 2 cuts the 5 layers in 6 virtual pipeline stages"),
            std::string::npos);
}

}  // namespace
}  // namespace ckpt

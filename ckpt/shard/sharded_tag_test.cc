// ShardedTag: a tag on disk read as logical tensors, whatever its parallel
// layout; rank files it cannot trust are refused, naming them.
#include "ckpt/shard/sharded_tag.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "ckpt/pt/pt_file.h"
#include "ckpt/shard/fake_state.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;
using testing::FakeState;
using testing::SmallLlama;
using testing::TempDir;
using testing::WriteFake;

// Every element of every parameter `tag` holds, against the fake's values (up to the real vocabulary).
void ExpectFakesValues(const LogicalState& tag) {
  for (const auto& p : tag.params()) {
    const uint64_t n = static_cast<uint64_t>(ShapeNumel(p.shape));
    std::vector<uint8_t> got(n * 4);
    tag.Read(p.name, StateField::kParam, 0, got, nullptr);
    for (uint64_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, got.data() + 4 * i, 4);
      ASSERT_EQ(v, FakeState::ValueOf(p.name, i)) << p.name << " element " << i;
    }
  }
}

// NxD's ep 2 Mixtral tags (tests/data/upstream/nxd_mixtral hf_ep2_*: tp 2, dp 2, ep 2,
// NeuronEPZero1Optimizer): every moment read through the index equals the gathered full
// state bit for bit (non-expert ones from dp chunks, experts from each ep rank's file); no masters.
TEST(ShardedTag, ReadsNxdsExpertParallelOptimizerAsTheFullState) {
  const std::string data = std::string(SHARDKIT_TEST_DATA) + "/upstream/nxd_mixtral/";
  const Value full = LoadPt(data + "hf_ep2_full_state.pt").as_dict().At("optimizer");
  FormatHints hints;
  hints.heads = 4, hints.moe_top_k = 2, hints.rope_theta = 1e6, hints.norm_eps = 1e-5;
  for (const char* name : {"hf_ep2_pt", "hf_ep2_xser"}) {
    const auto tag = ShardedTag::Open(Env::Default(), data + name + "/step_2", hints);
    EXPECT_EQ(tag->layout().grid.ep, 2);
    EXPECT_FALSE(tag->layout().master_weights);
    int checked = 0;
    for (const auto& [k, v] : full.as_dict().items)
      for (auto [field, key] : {std::pair{StateField::kExpAvg, "exp_avg"}, {StateField::kExpAvgSq, "exp_avg_sq"}}) {
        const Tensor want = v.as_dict().At(key).as_tensor().Contiguous();
        std::vector<uint8_t> got(want.nbytes());
        tag->Read(k.as_str(), field, 0, got, nullptr);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << name << " " << k.as_str() << " " << key;
        ++checked;
      }
    EXPECT_EQ(checked, 2 * 21);
  }
}

TEST(ShardedTag, ReadsTheLogicalTensorsOfAnyLayout) {
  TempDir dir("sharded_tag");
  const FakeState src(dir / "src", SmallLlama());
  for (auto [tp, pp] : {std::pair{1, 1}, {2, 2}, {4, 1}}) {
    const std::string out = dir / ("tp" + std::to_string(tp) + "pp" + std::to_string(pp));
    ReshardArgs a;
    a.tp = tp, a.pp = pp;
    WriteFake(src, out, a);
    const auto tag = ShardedTag::Open(Env::Default(), out);
    EXPECT_EQ(std::pair(tag->layout().grid.tp, tag->layout().grid.pp), std::pair(tp, pp));
    EXPECT_TRUE(tag->layout().format_from_manifest);
    EXPECT_EQ(tag->layout().format.kv_heads, 2);
    ASSERT_EQ(tag->params().size(), src.params().size());
    ExpectFakesValues(*tag);
  }
}

// FromFiles reads loaded values as Open reads the files they came from: the
// same layout, format and elements, and a manifest given in memory decides
// the grouping and step. A missing rank is refused as on disk.
TEST(ShardedTag, FromFilesReadsLoadedValuesAsOpenReadsTheFiles) {
  TempDir dir("sharded_tag");
  ReshardArgs a;
  a.tp = 2, a.pp = 2;
  WriteFake(FakeState(dir / "src", SmallLlama()), dir / "out", a);
  const Manifest manifest = Manifest::Load(Env::Default(), dir / "out/manifest.json");
  Manifest given = manifest;
  given.model.reset();  // learned from the values, with hints
  std::map<std::string, Value> files;
  for (const char* sub : {"model"})  // the fake has no optimizer state
    for (const auto& e : std::filesystem::directory_iterator(dir / ("out/" + std::string(sub))))
      files.emplace(std::string(sub) + "/" + e.path().filename().string(), LoadPt(e.path().string()));
  FormatHints hints;
  hints.heads = 4, hints.kv_heads = 2, hints.vocab_size = manifest.model->vocab_size;
  hints.make_vocab_size_divisible_by = manifest.model->make_vocab_size_divisible_by;
  const auto tag = ShardedTag::FromFiles("converted", files, given, hints);
  EXPECT_EQ(tag->layout().grid.tp, 2);
  EXPECT_EQ(tag->layout().stage_bounds, ShardedTag::Open(Env::Default(), dir / "out")->layout().stage_bounds);
  EXPECT_EQ(tag->layout().format.Describe(), manifest.model->Describe());
  EXPECT_EQ(tag->step(), manifest.step);
  EXPECT_FALSE(tag->layout().has_optimizer);
  ExpectFakesValues(*tag);
  // A hint that contradicts a format the in-memory manifest records is refused.
  given.model = manifest.model;
  FormatHints wrong;
  wrong.heads = 8;
  const std::string contradiction = ErrorOf([&] { ShardedTag::FromFiles("converted", files, given, wrong); });
  EXPECT_NE(contradiction.find("--heads 8 contradicts converted, which records 4"), std::string::npos) << contradiction;
  files.erase("model/" + RankFileName({0, 1, 1}));
  const std::string err = ErrorOf([&] { ShardedTag::FromFiles("converted", files, given); });
  EXPECT_NE(err.find("converted (as model/" + RankFileName({0, 1, 1}) + "): missing"), std::string::npos) << err;
}

TEST(ShardedTag, AMissingRankFileIsRefusedNamingIt) {
  TempDir dir("sharded_tag");
  ReshardArgs a;
  a.tp = 2, a.pp = 2;
  WriteFake(FakeState(dir / "src", SmallLlama()), dir / "out", a);
  const std::string gone = "model/" + RankFileName({0, 1, 1});
  std::filesystem::remove(dir / ("out/" + gone));
  const std::string err = ErrorOf([&] { ShardedTag::Open(Env::Default(), dir / "out"); });
  EXPECT_NE(err.find(RankFileName({0, 1, 1})), std::string::npos) << err;
}

// Rank files large enough to be mapped (over 64 KiB) are read with pread
// (ExtentIndex::ReadThrough), not out of the mapping: the same elements, an
// open of each file for reads besides its mapping, and a failed read reaching
// the caller naming the file.
TEST(ShardedTag, MappedRankFilesAreReadWithPreadThroughTheEnv) {
  TempDir dir("sharded_tag");
  ModelFormat f = SmallLlama();
  f.hidden = 256, f.ffn = 512, f.vocab_size = 512, f.layers = 1;
  ReshardArgs a;
  a.tp = 2, a.pp = 1;
  WriteFake(FakeState(dir / "src", f), dir / "out", a);
  FaultEnv env(Env::Default());
  const auto tag = ShardedTag::Open(&env, dir / "out");
  ExpectFakesValues(*tag);
  const std::string rank0 = dir / ("out/model/" + RankFileName({0, 0, 0}));
  const std::vector<std::string> reads = env.reads();
  EXPECT_EQ(std::count(reads.begin(), reads.end(), rank0), 2) << "files read: " << reads.size();
  env.FailReadAt(1);
  std::vector<uint8_t> got(4 * 256);
  const std::string err = ErrorOf([&] { tag->Read(tag->params().front().name, StateField::kParam, 0, got, nullptr); });
  EXPECT_NE(err.find(": read failed: Input/output error (injected)"), std::string::npos) << err;
  EXPECT_NE(err.find(dir / "out/model/"), std::string::npos) << err;
}

TEST(ShardedTag, ReplicasThatDifferAreRefusedUnlessTheFirstIsTrusted) {
  TempDir dir("sharded_tag");
  ReshardArgs a;
  a.tp = 2, a.pp = 1;
  WriteFake(FakeState(dir / "src", SmallLlama()), dir / "out", a);
  // tp rank 1's copy of a norm (replicated on every tp rank) gets one element changed.
  const std::string norm = "language_model.encoder.layers.1.input_layernorm.weight";
  const std::string file = dir / ("out/model/" + RankFileName({0, 1, 0}));
  Value m = LoadPt(file);
  Tensor t = m.as_dict().At(norm).as_tensor().Clone();
  reinterpret_cast<float*>(t.mutable_data())[3] += 1.0f;
  m.as_dict().Set(norm, Value(t));
  SavePt(file, m, {.weights_only = true});
  const std::string err = ErrorOf([&] {
    const auto tag = ShardedTag::Open(Env::Default(), dir / "out");
    ExpectFakesValues(*tag);
  });
  EXPECT_NE(err.find(norm), std::string::npos) << err;
  EXPECT_NE(err.find("tp ranks 0 and 1 hold different copies"), std::string::npos) << err;
  // Trusted, tp rank 0's copy is read: the fake's values.
  ExpectFakesValues(*ShardedTag::Open(Env::Default(), dir / "out", {}, {.trust_first_replica = true}));
}

}  // namespace
}  // namespace ckpt

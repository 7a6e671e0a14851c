#include "tools/hf_state.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "ckpt/testing/fault_env.h"
#include "ckpt/testing/test_util.h"
#include "ckpt/util/error.h"

namespace tools {
namespace {

using ckpt::testing::ErrorOf;
using ckpt::testing::TempDir;

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A safetensors file of `n` one-float tensors t0..t<n-1>, in order.
std::vector<uint8_t> Safetensors(int n) {
  std::string h = "{";
  for (int i = 0; i < n; ++i)
    h += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" + std::to_string(4 * i) + "," +
         std::to_string(4 * i + 4) + "]}";
  h += "}";
  std::vector<uint8_t> file(8 + h.size() + 4 * size_t(n));
  for (int b = 0; b < 8; ++b) file[b] = static_cast<uint8_t>(uint64_t(h.size()) >> (8 * b));
  std::copy(h.begin(), h.end(), file.begin() + 8);
  return file;
}

TEST(HfState, AHeaderOf100000EntriesIsParsedAndCheckedInLinearTime) {
  const auto file = Safetensors(100000);
  const auto entries = ParseSafetensors(file, "m.safetensors");
  ASSERT_EQ(entries.size(), 100000u);
  const uint64_t body = file.size() - 4 * 100000;
  EXPECT_EQ(entries.at("t99999").begin, body + 4 * 99999);
  EXPECT_EQ(entries.at("t99999").end, file.size());
  // The same with the last entry overlapping its neighbour: refused, naming both.
  std::vector<uint8_t> bad = file;
  const std::string was = "[399992,399996]", now = "[399990,399994]";
  const auto at = std::search(bad.begin(), bad.end(), was.begin(), was.end());
  ASSERT_NE(at, bad.end());
  std::copy(now.begin(), now.end(), at);
  EXPECT_NE(ErrorOf([&] { ParseSafetensors(bad, "m.safetensors"); }).find("tensors 't99997' and 't99998' overlap"), std::string::npos);
  // Four times the entries take about four times as long (the quadratic parse, 256 s at 100,000: sixteen).
  // Under 11: linear work measured 4 to 8.4 beside five builds (the caches are shared); quadratic is 16.
  const std::vector<std::vector<uint8_t>> files = {Safetensors(5000), Safetensors(20000)};
  EXPECT_LT(ckpt::testing::GrowthRatio([&](int n) { ParseSafetensors(files[n == 5000 ? 0 : 1], "m.safetensors"); }, 5000), 11.0);
}

TEST(HfState, AnIndexNamingManyMissingShardsFailsAtTheFirst) {
  TempDir d("hf_index");
  std::ofstream(d / "config.json") << R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 24,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 32})";
  std::ofstream index(d / "model.safetensors.index.json");
  index << R"({"metadata": {}, "weight_map": {)";
  for (int i = 0; i < 100000; ++i) index << (i ? ",\"w" : "\"w") << i << "\": \"shard-" << i << ".safetensors\"";
  index << "}}";
  index.close();
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = ErrorOf([&] { HfState::Open(ckpt::Env::Default(), d.path(), {}); });
  // weight_map is read in key order: w0 first.
  EXPECT_NE(e.find(d / "shard-0.safetensors: missing (named by " + d / "model.safetensors.index.json for tensor 'w0')"), std::string::npos) << e;
  EXPECT_LT(SecondsSince(t0), 10.0);  // about a quarter second; finding each shard among all took 53 s
}

// Writes `specs`' tensors as one float32 safetensors file whose elements hold 0, 1, 2, ...
// in file order; returns its path.
std::string WriteCountingSafetensors(const std::string& path, const std::vector<HfTensorSpec>& specs) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t at = 0;
  for (const auto& s : specs) {
    h[s.name] = {{"dtype", "F32"}, {"shape", s.shape}, {"data_offsets", {at, at + s.bytes()}}};
    at += s.bytes();
  }
  const std::string text = h.dump();
  std::vector<float> body(at / 4);
  for (size_t i = 0; i < body.size(); ++i) body[i] = static_cast<float>(i);
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = text.size();
  f.write(reinterpret_cast<const char*>(&n), 8).write(text.data(), static_cast<std::streamsize>(n));
  f.write(reinterpret_cast<const char*>(body.data()), static_cast<std::streamsize>(at));
  return path;
}

// A Llama folder whose float32 tensors hold 0, 1, 2, ... in file order: its
// plain pieces are read with pread (Env::NewRandomAccessFile), so an injected
// read failure reaches the caller naming the file.
TEST(HfState, PlainPiecesAreReadWithPreadThroughTheEnv) {
  TempDir d("hf_pread");
  const nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 16}, {"intermediate_size", 24}, {"num_attention_heads", 4},
                            {"num_key_value_heads", 2}, {"num_hidden_layers", 2}, {"vocab_size", 32}};
  std::ofstream(d / "config.json") << c.dump();
  const auto specs = ckpt::HfTensorsFor(FormatOfHfConfig(c, "config.json"), ckpt::DType::kFloat32);
  const std::string path = WriteCountingSafetensors(d / "model.safetensors", specs);
  ckpt::FaultEnv env(ckpt::Env::Default());
  const auto s = HfState::Open(&env, d.path(), {});
  ASSERT_EQ(specs.front().name, "model.embed_tokens.weight");  // first in the file: elements 0 .. 32 * 16
  const std::string emb = specs.front().blocks.front().name;
  std::vector<float> got(32 * 16);
  s->Read(emb, ckpt::StateField::kParam, 0, {reinterpret_cast<uint8_t*>(got.data()), got.size() * 4}, nullptr);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<float>(i)) << emb << " element " << i;
  // Mapped once at Open (its header), opened for reads at the first Read.
  const std::vector<std::string> reads = env.reads();
  EXPECT_EQ(std::count(reads.begin(), reads.end(), path), 2) << "files read: " << reads.size();
  env.FailReadAt(1);
  const std::string e = ErrorOf([&] { s->Read(emb, ckpt::StateField::kParam, 0, {reinterpret_cast<uint8_t*>(got.data()), 64}, nullptr); });
  EXPECT_NE(e.find(path + ": read failed"), std::string::npos) << e;
}

// A one-layer Mixtral folder in `d` of `experts` experts, hidden size `hidden` and FFN `ffn`, its float32
// tensors counting (WriteCountingSafetensors); returns its tensors.
std::vector<HfTensorSpec> WriteCountingMixtral(const TempDir& d, int64_t experts, int64_t hidden, int64_t ffn) {
  const nlohmann::json c = {{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", hidden}, {"intermediate_size", ffn},
                            {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"num_hidden_layers", 1}, {"vocab_size", 32},
                            {"num_local_experts", experts}, {"num_experts_per_tok", 1}, {"hidden_act", "silu"}};
  std::ofstream(d / "config.json") << c.dump();
  const auto specs = ckpt::HfTensorsFor(FormatOfHfConfig(c, "config.json"), ckpt::DType::kFloat32);
  WriteCountingSafetensors(d / "model.safetensors", specs);
  return specs;
}

// A Mixtral folder of counting float32 tensors: gate_up_proj[e][h] is [w1[e][:, h]; w3[e][:, h]] and
// down_proj[e][i] is w2[e][:, i] (the transposes NxD's converter makes), read whole and in ranges
// that start and end mid-row.
TEST(HfState, MixtralExpertTransposesAreStreamedIntoAnyRange) {
  TempDir d("hf_mixtral");
  const int64_t E = 2, H = 16, I = 24;
  const auto specs = WriteCountingMixtral(d, E, H, I);
  std::map<std::string, float> first;  // each HF tensor's first element: its offset in the file, in floats
  std::map<std::string, std::string> logical;
  float at = 0;
  for (const auto& s : specs) {
    first[s.name] = at, at += static_cast<float>(s.numel());
    logical[s.name] = s.blocks.front().name;
  }
  const std::string x = "model.layers.0.block_sparse_moe.experts.";
  const std::string gate_up = logical.at(x + "0.w1.weight"), down = logical.at(x + "0.w2.weight");
  std::vector<float> want_gate_up(E * H * 2 * I), want_down(E * I * H);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < I; ++j) {
        const std::string p = x + std::to_string(e);
        want_gate_up[(e * H + h) * 2 * I + j] = first.at(p + ".w1.weight") + static_cast<float>(j * H + h);
        want_gate_up[(e * H + h) * 2 * I + I + j] = first.at(p + ".w3.weight") + static_cast<float>(j * H + h);
        want_down[(e * I + j) * H + h] = first.at(p + ".w2.weight") + static_cast<float>(h * I + j);
      }
  const auto s = HfState::Open(ckpt::Env::Default(), d.path(), {});
  for (const auto& [name, want] : {std::pair{gate_up, want_gate_up}, std::pair{down, want_down}}) {
    // Whole, then ranges clipping rows at both ends (7 and 13 elements: never a row's width).
    for (const uint64_t len : {static_cast<uint64_t>(want.size()), uint64_t{7}, uint64_t{13 * 16 + 5}})
      for (uint64_t begin = 0; begin + len <= want.size(); begin += len == want.size() ? 1 : len + 3) {
        std::vector<float> got(len, -1.0f);
        s->Read(name, ckpt::StateField::kParam, begin, {reinterpret_cast<uint8_t*>(got.data()), len * 4}, nullptr);
        for (uint64_t i = 0; i < len; ++i) ASSERT_EQ(got[i], want[begin + i]) << name << " element " << begin + i << " (read from " << begin << ")";
      }
  }
}

// A column split's Reads (a row piece of every row: tp 4 of o_proj; for a Mixtral, a clipped
// gate_up_proj row per Read: tp 2 of [w1 | w3]) are copied out of a band of the source: one
// pread per band, not one per row piece or, for a transpose, per element. A chunk whose share of
// the budget holds no band of a few rows reads them directly: a row piece one pread each, a
// transposed one its short source rows whole (one pread) or, down_proj's 4200-element source rows
// being too long for that, one pread per element.
TEST(HfState, ColumnSplitReadsComeFromABandWithinTheChunksShare) {
  TempDir d("hf_band");
  const int64_t E = 2, H = 16, I = 4200;
  const auto specs = WriteCountingMixtral(d, E, H, I);
  std::map<std::string, const HfTensorSpec*> by_name;
  std::map<std::string, float> first;  // each HF tensor's first element: its offset in the file, in floats
  float at = 0;
  for (const auto& s : specs) by_name[s.name] = &s, first[s.name] = at, at += static_cast<float>(s.numel());
  ckpt::FaultEnv env(ckpt::Env::Default());
  const auto s = HfState::Open(&env, d.path(), {});
  // Reads `len` floats at each of `begins`, checks each element against want(flat index), returns the preads.
  auto reads = [&](const std::string& name, const std::vector<uint64_t>& begins, uint64_t len, uint64_t limit, auto want) {
    const int64_t before = env.reads_at();
    ckpt::Touched touched(limit);
    for (const uint64_t b : begins) {
      std::vector<float> got(len, -1.0f);
      s->Read(name, ckpt::StateField::kParam, b, {reinterpret_cast<uint8_t*>(got.data()), len * 4}, &touched);
      for (uint64_t i = 0; i < len; ++i) EXPECT_EQ(got[i], want(b + i)) << name << " element " << b + i;
    }
    return env.reads_at() - before;
  };
  const std::string o = "model.layers.0.self_attn.o_proj.weight";
  const std::string o_logical = by_name.at(o)->blocks.front().name;
  for (int t = 0; t < 4; ++t) {
    std::vector<uint64_t> begins;
    for (int64_t r = 0; r < H; ++r) begins.push_back(static_cast<uint64_t>(r * H + t * 4));
    const auto o_want = [&](uint64_t e) { return first.at(o) + static_cast<float>(e); };
    // The band outlives the chunk: the other ranks' pieces are in it already.
    EXPECT_EQ(reads(o_logical, begins, 4, 1 << 20, o_want), t == 0 ? 1 : 0) << "tp rank " << t << ": one band of o_proj's 16 rows";
    EXPECT_EQ(reads(o_logical, begins, 4, 4 * H * 4, o_want), H) << "tp rank " << t << ": a band of 2 rows is not worth it";
  }
  const std::string x = "model.layers.0.block_sparse_moe.experts.";
  const std::string gate_up = by_name.at(x + "0.w1.weight")->blocks.front().name;
  const auto gate_up_want = [&](uint64_t flat) {  // gate_up_proj (E, H, 2I): [w1[e][:, h]; w3[e][:, h]]
    const uint64_t e = flat / (H * 2 * I), h = flat / (2 * I) % H, j = flat % (2 * I);
    const std::string w = x + std::to_string(e) + (j < I ? ".w1.weight" : ".w3.weight");
    return first.at(w) + static_cast<float>((j % I) * H + h);
  };
  for (int t = 0; t < 2; ++t) {
    std::vector<uint64_t> begins;  // tp rank t's gate and up columns of every (expert, hidden) row
    for (int64_t r = 0; r < E * H; ++r)
      for (int64_t half = 0; half < 2; ++half) begins.push_back(static_cast<uint64_t>(r * 2 * I + half * I + t * I / 2));
    EXPECT_EQ(reads(gate_up, begins, I / 2, 1 << 20, gate_up_want), 2 * E) << "tp rank " << t << ": one band per w1 and w3";
    EXPECT_EQ(reads(gate_up, begins, I / 2, 8, gate_up_want), E * H * 2) << "tp rank " << t << ": no band: whole source rows, one pread";
  }
  const std::string down = by_name.at(x + "0.w2.weight")->blocks.front().name;
  const auto down_want = [&](uint64_t flat) {  // down_proj (E, I, H): w2[e][:, i]
    const uint64_t e = flat / (I * H), i = flat / H % I, h = flat % H;
    return first.at(x + std::to_string(e) + ".w2.weight") + static_cast<float>(h * I + i);
  };
  const std::vector<uint64_t> begins = {0, 20, 40, I * H - 3, I * H + 5, 2 * I * H - 7};
  EXPECT_EQ(reads(down, begins, 7, 8, down_want), 6 * 7) << "no band, source rows too long to read whole: a pread per element";
}

}  // namespace
}  // namespace tools

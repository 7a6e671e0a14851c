// SourceCheck: the source's checksum pass beside the copy. A damaged source
// still leaves no output and is named by its checksum, as the up-front pass did.
#include "ckpt/shard/source_check.h"

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>

#include <nlohmann/json.hpp>

#include "ckpt/shard/fake_state.h"
#include "ckpt/shard/reshard.h"
#include "ckpt/util/crc32.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;
using testing::FakeState;
using testing::TempDir;

ModelFormat Llama() {
  ModelFormat f;
  f.family = ModelFamily::kMegatron;
  f.hidden = 32, f.ffn = 64, f.heads = 4, f.kv_heads = 4, f.layers = 2, f.vocab_size = 64;
  return f;
}

// A complete tag (manifest with CRCs, `done`) at tp 2, written by the reshard engine.
std::string WriteTag(const TempDir& dir, const std::string& name) {
  FakeState src(dir / "fake", Llama());
  ReshardArgs a;
  a.dst = dir / name, a.tp = 2, a.pp = 1, a.threads = 1;
  ReshardSummary sum;
  sum.src_tag = src.path();
  WriteInLayout(src, "", a, Env::Default(), [](const std::string&) {}, std::chrono::steady_clock::now(), sum);
  return dir / name;
}

// Flips one byte in the middle of a rank file: its data, so it still parses.
void Damage(const std::string& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const std::streamoff middle = f.tellg() / 2;
  f.seekg(middle);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(middle);
  f.write(&c, 1);
}

TEST(SourceCheck, AnIntactTagPassesAndADamagedOneIsNamed) {
  TempDir dir("source_check");
  const std::string tag = WriteTag(dir, "tag");
  std::vector<std::string> said;
  const LogFn log = [&](const std::string& s) { said.push_back(s); };
  {
    SourceCheck check(Env::Default(), tag, true, false);
    check.Wait(log);
    check.Wait(log);  // idempotent
  }
  const std::string rank_file = "model/" + RankFileName({0, 1, 0});
  Damage(tag + "/" + rank_file);
  SourceCheck check(Env::Default(), tag, true, false);
  const std::string e = ErrorOf([&] { check.Wait(log); });
  EXPECT_NE(e.find(tag + ": fails verification, so it is not read"), std::string::npos) << e;
  EXPECT_NE(e.find(rank_file + ": checksum"), std::string::npos) << e;
  EXPECT_EQ(ErrorOf([&] { check.Wait(log); }), e);  // the same error again
  // A check not enabled (another rank's, or --no_verify) passes whatever the files hold.
  SourceCheck off(Env::Default(), tag, false, false);
  off.Wait(log);
  off.ThrowIfFailed(log);
}

TEST(SourceCheck, ThrowIfFailedPrefersTheCheckersError) {
  TempDir dir("source_check");
  const std::string tag = WriteTag(dir, "tag");
  const LogFn log = [](const std::string&) {};
  SourceCheck good(Env::Default(), tag, true, false);
  good.ThrowIfFailed(log);  // passed: the caller rethrows its own error
  Damage(tag + "/model/" + RankFileName({0, 0, 0}));
  SourceCheck bad(Env::Default(), tag, true, false);
  EXPECT_NE(ErrorOf([&] { bad.ThrowIfFailed(log); }).find("fails verification"), std::string::npos);
}

// Reads every file the manifest lists through `env`, a range at a time, as a job would.
void ReadAllThrough(Env* env, const std::string& tag) {
  const nlohmann::json m = nlohmann::json::parse(std::ifstream(tag + "/manifest.json"));
  for (const auto& [rel, _] : m.at("files").items()) {
    const std::string path = tag + "/" + rel;
    const uint64_t size = env->FileSize(path);
    auto f = env->NewRandomAccessFile(path);
    std::vector<uint8_t> buf(1000);
    for (uint64_t at = 0; at < size; at += buf.size()) f->ReadAt(at, {buf.data(), std::min<uint64_t>(buf.size(), size - at)});
  }
}

TEST(SourceCheck, AFoldedCheckReadsOnlyWhatTheJobDidNot) {
  TempDir dir("source_check");
  const std::string tag = WriteTag(dir, "tag");
  const LogFn log = [](const std::string&) {};
  FaultEnv failing(Env::Default());
  failing.FailReadAt(1);  // a range read by the check, not the job, would fail it
  {
    ReadFold fold;
    FoldingEnv job(Env::Default(), &fold);
    ReadAllThrough(&job, tag);
    SourceCheck check(&failing, tag, true, false, &fold, nullptr);
    check.Wait(log);
  }
  {
    ReadFold nothing;  // nothing read by the job: the check reads every byte, and passes
    SourceCheck check(Env::Default(), tag, true, false, &nothing, nullptr);
    check.Wait(log);
  }
  const std::string rank_file = "model/" + RankFileName({0, 1, 0});
  Damage(tag + "/" + rank_file);
  for (bool job_read_it : {true, false}) {  // the damaged byte read by the job, or a gap the check reads
    ReadFold fold;
    FoldingEnv job(Env::Default(), &fold);
    if (job_read_it) ReadAllThrough(&job, tag);
    SourceCheck check(job_read_it ? static_cast<Env*>(&failing) : Env::Default(), tag, true, false, &fold, nullptr);
    const std::string e = ErrorOf([&] { check.Wait(log); });
    EXPECT_NE(e.find(tag + ": fails verification, so it is not read"), std::string::npos) << e;
    EXPECT_NE(e.find(rank_file + ": checksum"), std::string::npos) << e;
  }
}

// Drops the per-tensor fingerprints from the tag's manifest (NxD's own tags record none).
void ForgetFingerprints(const std::string& tag) {
  nlohmann::json m = nlohmann::json::parse(std::ifstream(tag + "/manifest.json"));
  ASSERT_TRUE(m.contains("tensors"));
  m.erase("tensors");
  std::ofstream(tag + "/manifest.json") << m.dump(1);
}

TEST(SourceCheck, ReshardOfADamagedTagWritesNothingAndNamesTheChecksum) {
  // The data byte parses and the tag records no fingerprints, so only the checksum pass (now
  // beside the copy) can refuse it: the copy runs, and the commit must not.
  TempDir dir("source_check");
  const std::string tag = WriteTag(dir, "tag");
  ForgetFingerprints(tag);
  {
    ReshardArgs a;
    a.src = tag, a.dst = dir / "intact", a.tp = 1, a.pp = 1, a.threads = 1;
    RunReshard(a, Env::Default(), [](const std::string&) {});  // the manifest without fingerprints still verifies
  }
  Damage(tag + "/model/" + RankFileName({0, 1, 0}));
  ReshardArgs a;
  a.src = tag, a.dst = dir / "out", a.tp = 1, a.pp = 1, a.threads = 1;
  const std::string e = ErrorOf([&] { RunReshard(a, Env::Default(), [](const std::string&) {}); });
  EXPECT_NE(e.find("fails verification"), std::string::npos) << e;
  EXPECT_NE(e.find("checksum"), std::string::npos) << e;
  EXPECT_FALSE(Env::Default()->Exists(dir / "out"));
  for (const auto& n : Env::Default()->ListDir(dir.path())) EXPECT_EQ(n.find("partial"), std::string::npos) << n;
}

TEST(SourceCheck, WriteInLayoutCommitsOnlyOnceTheCheckPassed) {
  // The engine waits for the check it is given before the commit, whatever source it copies.
  TempDir dir("source_check");
  const std::string damaged = WriteTag(dir, "damaged");
  Damage(damaged + "/model/" + RankFileName({0, 0, 0}));
  SourceCheck check(Env::Default(), damaged, true, false);
  FakeState src(dir / "fake2", Llama());
  ReshardArgs a;
  a.dst = dir / "out", a.tp = 2, a.pp = 1, a.threads = 1;
  a.source_check = &check;
  ReshardSummary sum;
  sum.src_tag = src.path();
  const std::string e = ErrorOf([&] { WriteInLayout(src, "", a, Env::Default(), [](const std::string&) {}, std::chrono::steady_clock::now(), sum); });
  EXPECT_NE(e.find("fails verification"), std::string::npos) << e;
  EXPECT_FALSE(Env::Default()->Exists(dir / "out"));
  for (const auto& n : Env::Default()->ListDir(dir.path())) EXPECT_EQ(n.find("partial"), std::string::npos) << n;
}

TEST(SourceCheck, ItsMemoryIsWhatItReservesAndNothingWhenOff) {
  EXPECT_EQ(SourceCheck(Env::Default(), "x", false, false).memory(), 0u);
  EXPECT_GE(SourceCheck(Env::Default(), "x", true, false).memory(), kCrcWindow);
}

}  // namespace
}  // namespace ckpt

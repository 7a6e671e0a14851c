// The tag writer's protocol, one step at a time: begin, each rank's files and
// completion record, the commit that merges them into the manifest and only
// then writes `done`; what may be deleted as a tag; xser's parts; which rank
// writes which unit. The store's end-to-end behaviour is checkpoint_store_test's.
#include "ckpt/store/tag_writer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <tuple>
#include <set>
#include <sstream>

#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/xser.h"
#include "ckpt/store/snapshot.h"
#include "ckpt/util/crc32.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::Arange;
using testing::ErrorOf;
using testing::TempDir;

std::string ReadText(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

FileToWrite ModelFile(const std::string& relpath, int64_t n) {
  Value m = Value::NewDict();
  m.as_dict().Set("w", Value(Arange({n})));
  return {relpath, m, {.weights_only = true}};
}

TEST(TagWriter, CommitMergesEveryRanksRecordAndWritesDoneLast) {
  TempDir dir("tag_writer");
  Env* env = Env::Default();
  const std::string tag = dir / "t.ckpt";
  BeginTag(env, tag, "run/step=3");
  EXPECT_TRUE(env->Exists(tag + "/" + kCheckpointMarker));
  const auto d0 = WriteRankFiles(env, tag, 0, "run/step=3", {ModelFile("model/dp_rank_00_tp_rank_00_pp_rank_00.pt", 5)});
  const auto d1 = WriteRankFiles(env, tag, 1, "run/step=3", {ModelFile("model/dp_rank_00_tp_rank_01_pp_rank_00.pt", 7)});
  // Each rank's vote is its record; without rank 1's the commit would wait.
  const RankRecord r1 = ParseRankRecord(ReadText(RankRecordPath(tag, 1)), "rank 1");
  EXPECT_EQ(r1.save_id, "run/step=3");
  EXPECT_EQ(r1.files, d1);
  EXPECT_FALSE(env->Exists(tag + "/" + kDoneMarker));

  CommitInfo info;
  info.save_id = "run/step=3", info.step = 3, info.consumed_samples = 24, info.grid = {2, 1, 1, false}, info.world_size = 2;
  info.rank_timeout = std::chrono::milliseconds(2000);
  CommitTag(env, tag, info);
  EXPECT_TRUE(env->Exists(tag + "/" + kDoneMarker));
  const Manifest m = Manifest::Load(env, tag + "/" + kManifestFile);
  EXPECT_EQ(std::tuple(m.step, m.consumed_samples, m.world_size), std::tuple(int64_t{3}, 24.0, 2));
  ASSERT_EQ(m.files.size(), 2u);
  // The manifest's digests are the bytes on disk.
  for (const auto& [rel, digest] : m.files) {
    EXPECT_EQ(digest, DigestFile(env, tag + "/" + rel)) << rel;
    EXPECT_EQ(digest, (d0.count(rel) ? d0 : d1).at(rel)) << rel;
  }
}

TEST(TagWriter, ARecordOfAnotherSaveDoesNotCommit) {
  TempDir dir("tag_writer");
  Env* env = Env::Default();
  const std::string tag = dir / "t.ckpt";
  BeginTag(env, tag, "run/step=4");
  WriteRankFiles(env, tag, 0, "run/step=3", {ModelFile("model/dp_rank_00_tp_rank_00_pp_rank_00.pt", 5)});
  CommitInfo info;
  info.save_id = "run/step=4", info.grid = {1, 1, 1, false}, info.rank_timeout = std::chrono::milliseconds(300);
  EXPECT_NE(ErrorOf([&] { CommitTag(env, tag, info); }), "");
  EXPECT_FALSE(env->Exists(tag + "/" + kDoneMarker));
}

TEST(TagWriter, NotATagNamesWhatATagDoesNotHold) {
  TempDir dir("tag_writer");
  Env* env = Env::Default();
  env->CreateDirs(dir / "tag/model");
  WriteMarker(env, dir / "tag/done");
  EXPECT_EQ(NotATag(env, dir / "tag"), "");
  env->CreateDirs(dir / "user");
  WriteMarker(env, dir / "user/notes.txt");
  EXPECT_EQ(NotATag(env, dir / "user"), "it has no checkpoint marker (.shardkit, checkpoint, done or manifest.json); "
                                        "it holds what a checkpoint tag does not: notes.txt");
  // A marker does not make a user's file part of a tag: replacing it would delete it.
  WriteMarker(env, dir / "user/done");
  EXPECT_EQ(NotATag(env, dir / "user"), "it holds what a checkpoint tag does not: notes.txt");
  EXPECT_NE(ErrorOf([&] { BeginTag(env, dir / "user", "s"); }).find("is not a checkpoint tag"), std::string::npos);
  EXPECT_TRUE(env->Exists(dir / "user/notes.txt"));
}

TEST(TagWriter, ParseRankRecordNamesWhatIsMalformed) {
  EXPECT_EQ(ParseRankRecord(R"({"save_id": "s", "files": {"a.pt": {"size": 3, "crc32": "0000002a"}}})", "r").files.at("a.pt").crc32,
            42u);
  EXPECT_NE(ErrorOf([] { ParseRankRecord("{", "rank_00001.json"); }).find("rank_00001.json"), std::string::npos);
  EXPECT_NE(ErrorOf([] { ParseRankRecord(R"({"save_id": 7, "files": {}})", "rank_00001.json"); }).find("rank_00001.json"),
            std::string::npos);
}

TEST(TagWriter, XserPartsAreTheTensorsThenTheReferenceFileAndItsInfo) {
  Value m = Value::NewDict();
  m.as_dict().Set("a", Value(Arange({4})));
  m.as_dict().Set("b", Value(Arange({2, 3})));
  const auto parts = XserFiles({"model/x.pt", m, {.weights_only = true}});
  std::vector<std::string> names;
  for (const auto& p : parts) names.push_back(p.relpath);
  EXPECT_EQ(names, (std::vector<std::string>{"model/x.pt.tensors/tensor_0.pt", "model/x.pt.tensors/tensor_1.pt", "model/x.pt",
                                             "model/x.pt.info.pt"}));
  EXPECT_EQ(parts[1].value.as_tensor().shape(), (std::vector<int64_t>{2, 3}));
  // Dealt over 2 dp ranks, every part is written once, the reference file and info by bin 0.
  std::multiset<std::string> written;
  for (int bin = 0; bin < 2; ++bin)
    for (const auto& p : XserFilesOfBin({"model/x.pt", m, {.weights_only = true}}, 2, bin)) written.insert(p.relpath);
  EXPECT_EQ(written, std::multiset<std::string>(names.begin(), names.end()));
}

// NxD's _xser_save_data under expert parallelism: an ep rank above 0 writes the
// expert tensors' files alone (its X.pt and info.pt too); info.pt marks them.
TEST(TagWriter, AnEpRankAboveZeroWritesItsExpertTensorsAlone) {
  Value m = Value::NewDict();
  m.as_dict().Set("norm", Value(Arange({4})));
  m.as_dict().Set("experts", Value(Arange({2, 3})));
  const auto expert = [](const std::string& key) { return key == "experts"; };
  std::vector<std::string> names;
  for (const auto& p : XserFiles({"model/x.pt", m, {}}, expert, true)) names.push_back(p.relpath);
  EXPECT_EQ(names, (std::vector<std::string>{"model/x.pt.tensors/tensor_1.pt", "model/x.pt", "model/x.pt.info.pt"}));
  const auto rank0 = XserFiles({"model/x.pt", m, {}}, expert, false);
  ASSERT_EQ(rank0.size(), 4u);
  const Dict& info = rank0[3].value.as_dict();
  EXPECT_FALSE(info.items.at(0).second.as_dict().At("expert_model_parallel").as_bool());
  EXPECT_TRUE(info.items.at(1).second.as_dict().At("expert_model_parallel").as_bool());
}

// The same dealt over an expert-data-parallel group (NxD's model save at ep > 1):
// the bins are cut over all of the file's tensors, and an ep rank above 0 keeps
// only the expert tensors of its bin; the reference file and info.pt (marks
// included) come from bin 0.
TEST(TagWriter, AnEpRankAboveZerosBinsKeepTheirExpertTensorsAlone) {
  Value m = Value::NewDict();
  m.as_dict().Set("norm", Value(Arange({4})));
  m.as_dict().Set("experts", Value(Arange({2, 3})));
  m.as_dict().Set("more_experts", Value(Arange({5})));
  const auto expert = [](const std::string& key) { return key != "norm"; };
  std::multiset<std::string> ep0, ep1;
  for (int bin = 0; bin < 2; ++bin) {
    for (const auto& p : XserFilesOfBin({"model/x.pt", m, {}}, 2, bin, expert, false)) ep0.insert(p.relpath);
    for (const auto& p : XserFilesOfBin({"model/x.pt", m, {}}, 2, bin, expert, true)) {
      ep1.insert(p.relpath);
      if (p.relpath.ends_with("info.pt")) {
        EXPECT_TRUE(p.value.as_dict().items.at(2).second.as_dict().At("expert_model_parallel").as_bool());
      }
    }
  }
  EXPECT_EQ(ep0, (std::multiset<std::string>{"model/x.pt.tensors/tensor_0.pt", "model/x.pt.tensors/tensor_1.pt",
                                             "model/x.pt.tensors/tensor_2.pt", "model/x.pt", "model/x.pt.info.pt"}));
  EXPECT_EQ(ep1, (std::multiset<std::string>{"model/x.pt.tensors/tensor_1.pt", "model/x.pt.tensors/tensor_2.pt", "model/x.pt",
                                             "model/x.pt.info.pt"}));
  // XserBins over the three tensors (16, 24 and 20 bytes): tensors 0 and 1 in bin 0, tensor 2 in bin 1.
  std::vector<std::string> bin0;
  for (const auto& p : XserFilesOfBin({"model/x.pt", m, {}}, 2, 0, expert, true)) bin0.push_back(p.relpath);
  EXPECT_EQ(bin0, (std::vector<std::string>{"model/x.pt.tensors/tensor_1.pt", "model/x.pt", "model/x.pt.info.pt"}));
}

TEST(TagWriter, EveryUnitIsWrittenByExactlyOneRank) {
  for (int world : {1, 2, 3, 8})
    for (int unit = 0; unit < 17; ++unit) {
      int writers = 0;
      for (int rank = 0; rank < world; ++rank) writers += WritesUnit(unit, rank, world);
      EXPECT_EQ(writers, 1) << unit << " of world " << world;
    }
}

TEST(TagWriter, EveryToolsStagingAndSetAsideFolderNameTheTargetsOneWriterLock) {
  for (const std::string tool : {"reshard", "import", "nnm2nxdt"}) {
    const StagedTag t = StageFor("/ckpts/step_5.ckpt", tool);
    EXPECT_EQ(t.lock, "/ckpts/.step_5.ckpt.writer-lock");  // the same for every tool: they exclude each other
    EXPECT_EQ(WriterLockOf(t.staging), t.lock);
    EXPECT_EQ(WriterLockOf(t.old), t.lock);
  }
  EXPECT_EQ(StageFor("out", "reshard").lock, "./.out.writer-lock");
  EXPECT_EQ(WriterLockOf("/ckpts/step_5.ckpt"), "");         // a tag, not a staging folder
  EXPECT_EQ(WriterLockOf("/ckpts/.hidden"), "");
  EXPECT_EQ(WriterLockOf("/ckpts/.reshard-partial"), "");    // no target name
}

TEST(TagWriter, ASecondWriterOfATargetIsRefusedNamingTheFirstsPidAndTouchesNothing) {
  TempDir d("second_writer");
  Env* env = Env::Default();
  const StagedTag t = StageFor(d / "out", "reshard");
  auto first = PrepareTarget(env, t, false, [](const std::string&) {});
  ASSERT_TRUE(first);
  const std::string holder = ReadText(t.lock);
  EXPECT_EQ(holder.rfind("pid " + std::to_string(::getpid()) + " on ", 0), 0u) << holder;
  BeginStaged(env, t, SoloGroup(), "reshard");  // the first writer's staging folder
  const std::string begun = ReadText(t.staging + "/" + kRankRecordDir + "/begin");
  const std::string err = ErrorOf([&] { (void)PrepareTarget(env, StageFor(d / "out", "nnm2nxdt"), true, [](const std::string&) {}); });
  EXPECT_EQ(err, d / "out" + ": another writer is writing this tag (" + holder + ", holding " + t.lock + "); nothing was written. Wait for it to end, or stop it; a writer that was killed holds nothing");
  EXPECT_EQ(ReadText(t.staging + "/" + kRankRecordDir + "/begin"), begun);  // its staging folder untouched
  first.reset();
  EXPECT_FALSE(std::filesystem::exists(t.lock));  // a finished writer leaves no lock file
  auto next = PrepareTarget(env, t, false, [](const std::string&) {});
  EXPECT_TRUE(next);
}

// Rank 0 of a group whose peers may abort the moment the outcome reaches
// them: by then its writer lock file must be gone, whatever the outcome.
TEST(TagWriter, TheWriterLockIsReleasedBeforeTheOutcomeIsBroadcast) {
  struct Rank0 final : WriterGroup {
    explicit Rank0(std::string lock) : lock(std::move(lock)) {}
    int rank() const override { return 0; }
    int size() const override { return 1; }
    void Broadcast(std::string*) override { lock_there_at_broadcast.push_back(std::filesystem::exists(lock)); }
    std::vector<std::string> Gather(const std::string& s) override { return {s}; }
    [[noreturn]] void Abort(int) override { std::abort(); }
    std::string lock;
    std::vector<bool> lock_there_at_broadcast;
  };
  for (const bool refuse : {false, true}) {
    TempDir d("lock_release");
    Env* env = Env::Default();
    const StagedTag t = StageFor(d / "out", "reshard");
    Rank0 group(t.lock);
    std::unique_ptr<FileLock> writing = PrepareTarget(env, t, false, [](const std::string&) {});
    const std::string save_id = BeginStaged(env, t, group, "reshard");
    WriteRankFiles(env, t.staging, 0, save_id, {{"model/a.pt", Value(Arange({4})), {}}});
    CommitInfo ci;
    ci.save_id = save_id;
    if (refuse) ci.complete_manifest = [](const std::vector<RankRecord>&, Manifest&) { throw Error("refused on purpose"); };
    const std::string err = ErrorOf([&] { CommitStaged(env, t, group, ci, &writing); });
    EXPECT_EQ(err, refuse ? "refused on purpose" : "");
    EXPECT_EQ(writing, nullptr);
    EXPECT_EQ(group.lock_there_at_broadcast, (std::vector<bool>{true, false}));  // held while beginning; gone before the outcome
    EXPECT_EQ(std::filesystem::exists(t.target + "/" + kDoneMarker), !refuse);
  }
}

// Each dp rank writes its bin of the tensor files; together they write each once, and
// dp rank 0 the references and info.pt. A tensor outside the bin is a placeholder
// (CopyForSnapshot with a filter), which fails if it is ever written.
TEST(Xser, BinsOfAFileWriteEachPartOnce) {
  Value root = Value::NewDict();
  for (int i = 0; i < 7; ++i) root.as_dict().Set("t" + std::to_string(i), Value(testing::Arange({i + 1, 3})));
  const std::vector<FileToWrite> all = XserFiles({"model/x.pt", root, {}});
  std::map<std::string, int> writers;
  for (int bin = 0; bin < 3; ++bin) {
    const std::vector<int> bins = XserBins([&] {
      std::vector<uint64_t> b;
      for (int i = 0; i < 7; ++i) b.push_back(static_cast<uint64_t>(i + 1) * 3 * 4);
      return b;
    }(), 3);
    Value snap = CopyForSnapshot(root, nullptr, std::nullopt, [&](size_t i) { return bins[i] == bin; });
    for (const FileToWrite& f : XserFilesOfBin({"model/x.pt", snap, {}}, 3, bin)) {
      ++writers[f.relpath];
      if (f.value.is_tensor()) {
        testing::TempDir dir("bins");
        EXPECT_NO_THROW(SavePt(dir / "t.pt", f.value)) << f.relpath;  // its own tensors are real copies
      }
    }
    for (size_t i = 0; i < bins.size(); ++i)
      if (bins[i] != bin) {
        testing::TempDir dir("placeholder");
        EXPECT_THROW(SavePt(dir / "t.pt", snap.as_dict().items[i].second), Error) << i;
      }
  }
  ASSERT_EQ(writers.size(), all.size());
  for (const FileToWrite& f : all) EXPECT_EQ(writers[f.relpath], 1) << f.relpath;
}

}  // namespace
}  // namespace ckpt

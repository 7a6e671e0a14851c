#include "ckpt/store/checkpoint_store.h"

#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "ckpt/util/error.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/store/manifest.h"
#include "ckpt/store/resume.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::MakeSnapshot;
using testing::TempDir;

const RankGrid kGrid{2, 1, 2, true};

std::string TagPath(const TempDir& d, int64_t step) {
  return d.path() + "/" + FormatTagName({"m", step, static_cast<double>(step * 8), false});
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.read(&c, 1);
  c ^= 0x40;
  f.seekp(offset);
  f.write(&c, 1);
}

// Splits a whole-grid snapshot between two ranks: rank 1 writes tp rank 1's
// model file, rank 0 everything else.
std::pair<Snapshot, Snapshot> SplitForTwoRanks(const Snapshot& all) {
  Snapshot r0 = all, r1 = all;
  r0.files.clear();
  r1.files.clear();
  for (const auto& f : all.files) (f.relpath == "model/" + RankFileName({0, 1, 0}) ? r1 : r0).files.push_back(f);
  return {r0, r1};
}

TEST(CheckpointStore, SyncSaveWritesTheNxdtLayoutAndVerifies) {
  TempDir d("store");
  CheckpointStore store({.dir = d.path()});
  store.Save(MakeSnapshot("m", 5, kGrid, 1000, 1));
  const std::string tag = TagPath(d, 5);
  for (const char* f : {"checkpoint", "done", "manifest.json", "scheduler.pt", "user_content.pt",
                        "model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_01_pp_rank_00.pt",
                        "optim/dp_rank_01_tp_rank_01_pp_rank_00.pt", ".shardkit/rank_00000.json"})
    EXPECT_TRUE(Env::Default()->Exists(tag + "/" + f)) << f;
  const Manifest m = Manifest::Load(Env::Default(), tag + "/manifest.json");
  EXPECT_EQ(m.step, 5);
  EXPECT_EQ(m.grid, kGrid);
  EXPECT_EQ(m.files.size(), 8u);
  EXPECT_EQ(m.files.at("scheduler.pt"), DigestFile(Env::Default(), tag + "/scheduler.pt"));
  const TagReport r = VerifyTag(Env::Default(), tag);
  EXPECT_TRUE(r.ok()) << (r.problems.empty() ? "" : r.problems[0].file + ": " + r.problems[0].what);
  EXPECT_EQ(r.files_checked, 8u);
  EXPECT_EQ(store.committed(), std::vector<std::string>{tag});
  // The files are real .pt files.
  Value model = LoadPt(tag + "/model/dp_rank_00_tp_rank_00_pp_rank_00.pt");
  EXPECT_EQ(model.as_dict().items.size(), 1u);
}

TEST(CheckpointStore, AsyncSaveCommitsEveryTagAndKeepsLastK) {
  TempDir d("store");
  {
    CheckpointStore store({.dir = d.path(), .save_top_k = 2, .async = true});
    for (int step = 1; step <= 5; ++step) store.Save(MakeSnapshot("m", step, kGrid, 20000, 2));
    store.Finalize();
    EXPECT_EQ(store.committed().size(), 5u);
  }
  std::vector<std::string> names;
  for (const auto& t : ListTags(Env::Default(), d.path())) names.push_back(t.dir_name);
  EXPECT_EQ(names, (std::vector<std::string>{"m--step=5-consumed_samples=40.0.ckpt", "m--step=4-consumed_samples=32.0.ckpt"}));
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr), TagPath(d, 5));
}

TEST(CheckpointStore, EnospcAndShortWritesLeaveThePreviousCheckpointIntact) {
  for (int mode = 0; mode < 4; ++mode) {
    SCOPED_TRACE(mode);
    TempDir d("store");
    FaultEnv env(Env::Default());
    {
      CheckpointStore store({.dir = d.path(), .env = &env});
      store.Save(MakeSnapshot("m", 1, kGrid, 5000, 3));
    }
    const int64_t base = env.bytes_written();
    if (mode == 0) env.FailWritesAfter(base + 30000);
    if (mode == 1) env.ShortWriteAt(base + 30000);
    if (mode == 2) env.FailSyncAt(20);
    if (mode == 3) env.FailRenameAt(6);
    CheckpointStore store({.dir = d.path(), .env = &env});
    try {
      store.Save(MakeSnapshot("m", 2, kGrid, 5000, 3));
      FAIL() << "the injected failure was not reported";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("(injected)"), std::string::npos) << what;
      EXPECT_NE(what.find(d.path()), std::string::npos) << what;  // names the file
    }
    EXPECT_FALSE(Env::Default()->Exists(TagPath(d, 2) + "/done"));
    EXPECT_TRUE(VerifyTag(Env::Default(), TagPath(d, 1)).ok());
    EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr), TagPath(d, 1));
  }
}

// Power loss keeps only what was fsynced, so the commit must make every file
// durable (file fsync before its rename, then its directory's fsync) before
// `done` appears. Checked on the event log, for sync and async saves.
TEST(CheckpointStore, DoneBecomesDurableOnlyAfterEverythingItCovers) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    TempDir d("store");
    FaultEnv env(Env::Default());
    {
      CheckpointStore store({.dir = d.path(), .async = async, .env = &env});
      store.Save(MakeSnapshot("m", 1, kGrid, 1000, 20));
    }
    const auto ev = env.events();
    const std::string tag = TagPath(d, 1);
    auto parent = [](const std::string& p) { return std::filesystem::path(p).parent_path().string(); };
    // Where `done` was renamed into place.
    size_t done_at = ev.size();
    for (size_t i = 0; i < ev.size(); ++i)
      if (ev[i].kind == FaultEnv::Event::kRename && ev[i].to == tag + "/done") done_at = i;
    ASSERT_LT(done_at, ev.size());
    // A directory fsync between `after` and `before` (exclusive).
    auto dir_synced = [&](const std::string& dir, size_t after, size_t before) {
      for (size_t i = after + 1; i < before; ++i)
        if (ev[i].kind == FaultEnv::Event::kSyncDir && ev[i].path == dir) return true;
      return false;
    };
    std::vector<std::string> covered;
    for (const auto& [rel, digest] : Manifest::Load(Env::Default(), tag + "/manifest.json").files) covered.push_back(rel);
    covered.push_back("manifest.json");
    covered.push_back("checkpoint");
    for (const auto& rel : covered) {
      SCOPED_TRACE(rel);
      const std::string final_path = tag + "/" + rel;
      size_t rename_at = ev.size();
      for (size_t i = 0; i < done_at; ++i)
        if (ev[i].kind == FaultEnv::Event::kRename && ev[i].to == final_path) rename_at = i;
      ASSERT_LT(rename_at, done_at) << "not in place before done";
      bool content_synced = false;
      for (size_t i = 0; i < rename_at; ++i)
        content_synced |= ev[i].kind == FaultEnv::Event::kSyncFile && ev[i].path == ev[rename_at].path;
      EXPECT_TRUE(content_synced) << "renamed before its content was fsynced";
      EXPECT_TRUE(dir_synced(parent(final_path), rename_at, done_at)) << "its directory entry was not fsynced before done";
    }
    // Every directory the tag needs (the tag too) was recorded durably in its
    // parent after it was first created and before done.
    std::set<std::string> seen_dirs;
    for (size_t i = 0; i < done_at; ++i) {
      if (ev[i].kind != FaultEnv::Event::kCreateDirs || ev[i].path.rfind(tag, 0) != 0) continue;
      for (std::string dir = ev[i].path; dir.size() >= tag.size(); dir = parent(dir)) {
        if (!seen_dirs.insert(dir).second) continue;  // created earlier; that creation is what counts
        EXPECT_TRUE(dir_synced(parent(dir), i, done_at)) << dir;
      }
    }
    EXPECT_TRUE(seen_dirs.count(tag + "/model") && seen_dirs.count(tag + "/optim"));
    // And `done` itself is synced and its directory entry made durable.
    EXPECT_TRUE(dir_synced(tag, done_at, ev.size()));
  }
}

TEST(CheckpointStore, AsyncFailureIsReportedAtTheNextSaveWithItsCause) {
  TempDir d("store");
  FaultEnv env(Env::Default());
  CheckpointStore store({.dir = d.path(), .async = true, .env = &env});
  store.Save(MakeSnapshot("m", 1, kGrid, 5000, 4));
  store.Finalize();
  env.FailWritesAfter(env.bytes_written() + 10000);
  store.Save(MakeSnapshot("m", 2, kGrid, 5000, 4));  // fails in the background
  try {
    store.Finalize();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("an earlier background checkpoint save failed"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos);
  }
  EXPECT_NO_THROW(store.Finalize());  // reported once
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr), TagPath(d, 1));
}

TEST(CheckpointStore, FlippedByteIsNamedAndResumeFallsBack) {
  TempDir d("store");
  {
    CheckpointStore store({.dir = d.path()});
    store.Save(MakeSnapshot("m", 1, kGrid, 5000, 5));
    store.Save(MakeSnapshot("m", 2, kGrid, 5000, 5));
  }
  const std::string victim = "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt";
  FlipByte(TagPath(d, 2) + "/" + victim, 1000);
  const TagReport r = VerifyTag(Env::Default(), TagPath(d, 2));
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0].file, victim);
  EXPECT_NE(r.problems[0].what.find("checksum"), std::string::npos);
  // Sizes alone cannot see a flipped byte; checksums can.
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), false, nullptr), TagPath(d, 2));
  std::vector<std::string> log;
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, [&](const std::string& l) { log.push_back(l); }),
            TagPath(d, 1));
  ASSERT_FALSE(log.empty());
  EXPECT_NE(log[0].find("skipping m--step=2"), std::string::npos);
  EXPECT_NE(log[0].find(victim), std::string::npos);
}

TEST(CheckpointStore, TruncatedFileFailsEvenWithoutChecksums) {
  TempDir d("store");
  {
    CheckpointStore store({.dir = d.path()});
    store.Save(MakeSnapshot("m", 1, kGrid, 5000, 6));
    store.Save(MakeSnapshot("m", 2, kGrid, 5000, 6));
  }
  std::filesystem::resize_file(TagPath(d, 2) + "/model/dp_rank_00_tp_rank_01_pp_rank_00.pt", 100);
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), false, nullptr), TagPath(d, 1));
}

TEST(Resume, ExpManagerSemantics) {
  TempDir d("store");
  auto* env = Env::Default();
  ResumeOptions o;
  EXPECT_EQ(ResolveResume(env, d.path(), o, nullptr), std::nullopt);  // resume off
  o.resume_if_exists = true;
  EXPECT_THROW(ResolveResume(env, d.path(), o, nullptr), Error);
  o.resume_ignore_no_checkpoint = true;
  std::vector<std::string> log;
  EXPECT_EQ(ResolveResume(env, d.path(), o, [&](const std::string& l) { log.push_back(l); }), std::nullopt);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("warning: no complete checkpoint"), std::string::npos);
  {
    CheckpointStore store({.dir = d.path()});
    store.Save(MakeSnapshot("m", 3, kGrid, 100, 7));
    store.Save(MakeSnapshot("m", 10, kGrid, 100, 7));
  }
  // An in-progress (no done) later tag is never picked.
  BeginTag(env, TagPath(d, 20), "other-run/step=20");
  EXPECT_EQ(ResolveResume(env, d.path(), o, nullptr), TagPath(d, 10));
  // Explicit wins, by name or path; incomplete explicit tags are an error.
  o.resume_from_checkpoint = FormatTagName({"m", 3, 24, false});
  EXPECT_EQ(ResolveResume(env, d.path(), o, nullptr), TagPath(d, 3));
  o.resume_from_checkpoint = TagPath(d, 20);
  EXPECT_THROW(ResolveResume(env, d.path(), o, nullptr), Error);
}

// Damaged tags are evidence: resume skips and reports them, retention never
// counts or deletes them, a re-save of their step sets them aside, and when
// nothing intact is left resuming stops instead of starting over them.
TEST(Resume, DamagedTagsAreReportedKeptAndNeverCounted) {
  TempDir d("store");
  auto* env = Env::Default();
  {
    CheckpointStore store({.dir = d.path()});
    for (int step : {1, 2, 3}) store.Save(MakeSnapshot("m", step, kGrid, 5000, 9));
  }
  FlipByte(TagPath(d, 3) + "/model/dp_rank_00_tp_rank_00_pp_rank_00.pt", 1000);
  ResumeOptions o{.resume_if_exists = true, .verify_checksums = true};
  std::vector<DamagedTag> damaged;
  EXPECT_EQ(ResolveResume(env, d.path(), o, nullptr, &damaged), TagPath(d, 2));
  ASSERT_EQ(damaged.size(), 1u);
  EXPECT_EQ(damaged[0].path, TagPath(d, 3));
  {
    CheckpointStore store({.dir = d.path(), .save_top_k = 1, .damaged = {FormatTagName({"m", 3, 24, false})}});
    store.Save(MakeSnapshot("m", 3, kGrid, 5000, 9));  // the damaged step-3 tag is set aside, then retention runs
  }
  std::vector<std::string> names;
  for (const auto& t : ListTags(env, d.path())) names.push_back(t.dir_name);
  EXPECT_EQ(names, (std::vector<std::string>{"m--step=3-consumed_samples=24.0.ckpt"}));
  EXPECT_FALSE(VerifyTag(env, TagPath(d, 3) + ".damaged").ok());  // still there, still damaged
  // Every complete tag damaged: a clear stop naming each, or (asked) a fresh start.
  FlipByte(TagPath(d, 3) + "/model/dp_rank_00_tp_rank_00_pp_rank_00.pt", 1000);
  try {
    ResolveResume(env, d.path(), {.resume_if_exists = true, .resume_ignore_no_checkpoint = true, .verify_checksums = true}, nullptr);
    FAIL();
  } catch (const DamagedCheckpoints& e) {
    EXPECT_NE(std::string(e.what()).find(TagPath(d, 3) + ": model/dp_rank_00_tp_rank_00_pp_rank_00.pt"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(ResolveResume(env, d.path(), {.resume_if_exists = true, .verify_checksums = true, .start_over_damaged = true}, nullptr),
            std::nullopt);
}

// A run resumed from an earlier tag saves steps that exist already: the old
// tags are set aside, never deleted, and later steps are not its to count.
TEST(CheckpointStore, RetentionAfterResumingFromAnEarlierTagKeepsLaterSteps) {
  TempDir d("store");
  auto* env = Env::Default();
  {
    CheckpointStore store({.dir = d.path()});
    for (int step : {1, 2, 3}) store.Save(MakeSnapshot("m", step, kGrid, 1000, 10));
  }
  {
    CheckpointStore store({.dir = d.path(), .save_top_k = 1});
    store.Save(MakeSnapshot("m", 2, kGrid, 1000, 11));
  }
  std::vector<std::string> names;
  for (const auto& t : ListTags(env, d.path())) names.push_back(t.dir_name);
  EXPECT_EQ(names, (std::vector<std::string>{"m--step=3-consumed_samples=24.0.ckpt", "m--step=2-consumed_samples=16.0.ckpt"}));
  EXPECT_TRUE(VerifyTag(env, TagPath(d, 2) + ".superseded").ok());  // the earlier save of step 2, whole
  EXPECT_TRUE(VerifyTag(env, TagPath(d, 3)).ok());
}

// NxD's trainer names tags freely; like NxD's list_checkpoint_tags, every
// scan finds a folder by its `checkpoint` marker and a complete one by `done`.
TEST(Resume, TagsNamedFreelyAreFoundByTheirMarkers) {
  TempDir d("store");
  auto* env = Env::Default();
  {
    CheckpointStore store({.dir = d.path()});
    store.Save(MakeSnapshot("m", 1, kGrid, 100, 12));
  }
  const std::string nxd = d.path() + "/step_7";
  std::filesystem::rename(TagPath(d, 1), nxd);
  const auto tags = ListTags(env, d.path());
  ASSERT_EQ(tags.size(), 1u);
  EXPECT_EQ(tags[0].dir_name, "step_7");
  EXPECT_EQ(FindLatestCheckpoint(env, d.path(), true, nullptr), nxd);
  // A folder without a marker or a tag name is not a tag.
  std::filesystem::create_directories(d.path() + "/notes");
  EXPECT_EQ(ListTags(env, d.path()).size(), 1u);
  // Retention never counts a tag it cannot date by name.
  {
    CheckpointStore store({.dir = d.path(), .save_top_k = 1});
    store.Save(MakeSnapshot("m", 2, kGrid, 100, 12));
  }
  EXPECT_TRUE(env->Exists(nxd + "/done"));
}

TEST(Resume, StepBeatsModificationTime) {
  TempDir d("store");
  {
    CheckpointStore store({.dir = d.path()});
    store.Save(MakeSnapshot("m", 9, kGrid, 100, 8));
    store.Save(MakeSnapshot("m", 10, kGrid, 100, 8));
  }
  // Touch the older tag, as copying a directory does.
  std::filesystem::last_write_time(TagPath(d, 9), std::filesystem::file_time_type::clock::now() + std::chrono::hours(1));
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), false, nullptr), TagPath(d, 10));
}

TEST(Resume, NxdWrittenTagsWithoutManifestAndTheNewestFileLayout) {
  TempDir d("store");
  auto* env = Env::Default();
  // An NxD-style tag: markers and rank files, no manifest.
  const std::string nxd = d / "nxd--step=7-consumed_samples=56.0.ckpt";
  env->CreateDirs(nxd + "/model");
  for (int tp = 0; tp < 2; ++tp) SavePt(nxd + "/model/" + RankFileName({0, tp, 0}), Value::NewDict());
  WriteMarker(env, nxd + "/checkpoint");
  EXPECT_EQ(FindLatestCheckpoint(env, d.path(), true, nullptr), std::nullopt);  // no done yet
  WriteMarker(env, nxd + "/done");
  EXPECT_EQ(FindLatestCheckpoint(env, d.path(), true, nullptr), nxd);
  const TagReport r = VerifyTag(env, nxd);
  ASSERT_TRUE(r.grid);
  EXPECT_EQ(r.grid->tp, 2);
  // A missing tp rank is a grid problem.
  env->RemoveFile(nxd + "/model/" + RankFileName({0, 1, 0}));
  SavePt(nxd + "/model/" + RankFileName({0, 2, 0}), Value::NewDict());
  EXPECT_EQ(VerifyTag(env, nxd).problems.at(0).file, "model/" + RankFileName({0, 1, 0}));
  // NxD 2.16: a `newest` file names the tag; there is no done marker.
  TempDir old("store_old");
  env->CreateDirs(old / "step_100/model");
  SavePt(old / ("step_100/model/" + RankFileName({0, 0, 0})), Value::NewDict());
  std::ofstream(old / "newest") << "step_100\n";
  EXPECT_EQ(FindLatestCheckpoint(env, old.path(), false, nullptr), old / "step_100");
}

// Bytes alone do not vouch for a model no reader takes: an MoE (Mixtral) model file is a problem naming it.
TEST(Resume, VerifyDoesNotPassAnMoeTagOnItsBytes) {
  TempDir d("store");
  auto* env = Env::Default();
  const std::string nxd = d / "step_2";
  env->CreateDirs(nxd + "/model");
  Value model = Value::NewDict();
  model.as_dict().Set("model.layers.0.mlp.router.linear_router.weight", Value(testing::Arange({4, 2})));
  SavePt(nxd + "/model/" + RankFileName({0, 0, 0}), model);
  WriteMarker(env, nxd + "/done");
  const TagReport r = VerifyTag(env, nxd);
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0].file, "model/" + RankFileName({0, 0, 0}));
  EXPECT_NE(r.problems[0].what.find("MoE (Mixtral)"), std::string::npos) << r.problems[0].what;
}

// A folder of the user's files under a tag's name is never replaced by a save.
TEST(CheckpointStore, SaveRefusesToReplaceAFolderThatIsNotATag) {
  TempDir d("store");
  std::filesystem::create_directories(TagPath(d, 4));
  std::ofstream(TagPath(d, 4) + "/notes.txt") << "mine";
  CheckpointStore store({.dir = d.path()});
  const std::string e = testing::ErrorOf([&] { store.Save(MakeSnapshot("m", 4, kGrid, 100, 13)); });
  EXPECT_NE(e.find("is not a checkpoint tag"), std::string::npos) << e;
  EXPECT_NE(e.find("notes.txt"), std::string::npos) << e;
  EXPECT_TRUE(Env::Default()->Exists(TagPath(d, 4) + "/notes.txt"));
  EXPECT_FALSE(Env::Default()->Exists(TagPath(d, 4) + "/done"));
}

TEST(CheckpointStore, ResavingATagNeverLeavesOldDoneOverNewFiles) {
  TempDir d("store");
  {
    CheckpointStore store({.dir = d.path()});
    store.Save(MakeSnapshot("m", 1, kGrid, 5000, 11));
  }
  // A second job saves the same tag name and dies midway through.
  FaultEnv env(Env::Default());
  env.FailWritesAfter(env.bytes_written() + 20000);
  CheckpointStore store({.dir = d.path(), .env = &env});
  EXPECT_THROW(store.Save(MakeSnapshot("m", 1, kGrid, 5000, 12)), Error);
  EXPECT_FALSE(Env::Default()->Exists(TagPath(d, 1) + "/done"));
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr), std::nullopt);
}

TEST(CheckpointStore, StaleRankRecordsOfAnEarlierSaveDoNotCommit) {
  TempDir d("store");
  const RankGrid grid{2, 1, 1, false};
  auto [r0, r1] = SplitForTwoRanks(MakeSnapshot("m", 1, grid, 100, 13));
  {  // first job: both ranks complete
    CheckpointStore s0({.dir = d.path(), .async = true}, {.world_size = 2, .job_id = "jobA"});
    s0.Save(r0);
    CheckpointStore s1({.dir = d.path()}, {.rank = 1, .world_size = 2, .job_id = "jobA"});
    s1.Save(r1);
    s0.Finalize();
  }
  // Second job, same tag: rank 1 never shows up, so no done may appear.
  CheckpointStore s0({.dir = d.path(), .rank_timeout = std::chrono::milliseconds(300)}, {.world_size = 2, .job_id = "jobB"});
  EXPECT_THROW(s0.Save(r0), Error);
  EXPECT_FALSE(Env::Default()->Exists(TagPath(d, 1) + "/done"));
}

TEST(CheckpointStore, CopyForSnapshotDetachesTensors) {
  Tensor t = testing::Arange({4});
  Value v = Value::NewDict();
  v.as_dict().Set("w", Value(t));
  Value snap = CopyForSnapshot(v);
  reinterpret_cast<float*>(t.mutable_data())[0] = 99.f;
  EXPECT_EQ(reinterpret_cast<const float*>(snap.as_dict().At("w").as_tensor().data())[0], 0.f);
  EXPECT_NE(snap.as_dict().At("w").as_tensor().storage(), t.storage());
}

TEST(Snapshot, PoolRecyclesBuffersOnceASaveReleasesThem) {
  auto pool = SnapshotPool::Create();
  Value v = Value::NewDict();
  v.as_dict().Set("w", Value(testing::Arange({1000})));
  const uint8_t* first = nullptr;
  {
    Value snap = CopyForSnapshot(v, pool.get());
    first = snap.as_dict().At("w").as_tensor().data();
    EXPECT_TRUE(DeepEqual(snap, v));
    EXPECT_EQ(pool->free_bytes(), 0u);
  }
  EXPECT_EQ(pool->free_bytes(), 4000u);  // back in the pool
  Value again = CopyForSnapshot(v, pool.get());
  EXPECT_EQ(again.as_dict().At("w").as_tensor().data(), first);  // the same buffer, reused
  EXPECT_TRUE(DeepEqual(again, v));
  pool.reset();  // buffers outliving their pool are freed, not leaked (ASan checks)
  auto reserved = SnapshotPool::Create();
  reserved->Reserve(v);
  EXPECT_EQ(reserved->free_bytes(), 4000u);
}

TEST(CheckpointStore, MultiRankCommitWaitsForEveryRank) {
  TempDir d("store");
  const RankGrid grid{2, 1, 1, false};
  Snapshot all = MakeSnapshot("m", 1, grid, 100, 9);
  auto [r0, r1] = SplitForTwoRanks(all);
  CheckpointStore s0({.dir = d.path(), .async = true, .rank_timeout = std::chrono::milliseconds(20000)}, {.world_size = 2, .job_id = "job1"});
  s0.Save(r0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(Env::Default()->Exists(TagPath(d, 1) + "/done"));  // rank 1 has not voted
  {
    CheckpointStore s1({.dir = d.path()}, {.rank = 1, .world_size = 2, .job_id = "job1"});
    s1.Save(r1);
  }
  s0.Finalize();
  EXPECT_TRUE(VerifyTag(Env::Default(), TagPath(d, 1)).ok());
  EXPECT_EQ(Manifest::Load(Env::Default(), TagPath(d, 1) + "/manifest.json").files.size(), all.files.size());
}

TEST(CheckpointStore, MissingRankTimesOutWithoutDone) {
  TempDir d("store");
  EXPECT_THROW(CheckpointStore({.dir = d.path()}, {.world_size = 3, .job_id = ""}), Error);  // no shared run_id
  CheckpointStore s0({.dir = d.path(), .rank_timeout = std::chrono::milliseconds(100)}, {.world_size = 3, .job_id = "job2"});
  try {
    s0.Save(MakeSnapshot("m", 1, {1, 1, 1, false}, 10, 10));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 1, 2 did not finish writing"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(Env::Default()->Exists(TagPath(d, 1) + "/done"));
}

// One answer to "is this folder a tag?" for every command.
TEST(LooksLikeTag, MarkersModelOrNameButNotAnNnmFolder) {
  testing::TempDir d("looks");
  Env* env = Env::Default();
  auto make = [&](const std::string& rel) { env->CreateDirs(d / rel); return d / rel; };
  EXPECT_FALSE(LooksLikeTag(env, make("checkpoints")));  // a folder of tags
  EXPECT_TRUE(LooksLikeTag(env, make("a/model").substr(0, (d / "a").size())));  // NxD's converter output
  const std::string named = make("megatron_llama--step=4-consumed_samples=32.0.ckpt");
  EXPECT_TRUE(LooksLikeTag(env, named));  // named as NxDT names tags, even before its files exist
  make("megatron_llama--step=4-consumed_samples=32.0.ckpt/tp_rank_00_pp_rank_000");
  EXPECT_FALSE(LooksLikeTag(env, named));  // NNM names its folders so too; its rank folders tell
  EXPECT_TRUE(HoldsNnmRankFolders(env, named));
  const std::string partial = make("b");
  std::ofstream(partial + "/checkpoint") << "1";
  EXPECT_TRUE(LooksLikeTag(env, partial));  // a save that began
  EXPECT_FALSE(LooksLikeTag(env, d / "absent"));
}

}  // namespace
}  // namespace ckpt

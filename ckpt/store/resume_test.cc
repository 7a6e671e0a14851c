// PlanResume: what a job does with a resume tag cut for another parallel
// layout; FindLatestCheckpoint trusting what tags record over their names.
// (Choosing the tag otherwise, ResolveResume, is tested with the store in
// checkpoint_store_test.)
#include "ckpt/store/resume.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include <cmath>
#include <limits>

#include "ckpt/store/checkpoint_store.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/tag_writer.h"
#include "ckpt/store/training_state.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;
using testing::TempDir;

// A layout check that fits every folder but `src`.
std::string OnlySrcMismatches(const std::string& src, const std::string& dir) {
  return dir == src ? "it is cut for tp 2, this run for tp 1" : "";
}

TEST(PlanResume, ATagThatFitsLoadsAsItIs) {
  TempDir dir("resume");
  const ResumePlan p = PlanResume(Env::Default(), dir / "t", false, dir / "t_tp1", [](const std::string&) { return ""; }, "");
  EXPECT_EQ(p.kind, ResumePlan::Kind::kAsIs);
  EXPECT_EQ(p.load, dir / "t");
}

TEST(PlanResume, ATagThatDoesNotFitIsRefusedWithAdviceUnlessReshardingIsAsked) {
  TempDir dir("resume");
  const std::string src = dir / "t", dst = dir / "t_tp1";
  auto mismatch = [&](const std::string& d) { return OnlySrcMismatches(src, d); };
  EXPECT_EQ(ErrorOf([&] { PlanResume(Env::Default(), src, false, dst, mismatch, "Reshard it with: ckpt-reshard ..."); }),
            src + ": it is cut for tp 2, this run for tp 1. Reshard it with: ckpt-reshard ...");
  const ResumePlan p = PlanResume(Env::Default(), src, true, dst, mismatch, "");
  EXPECT_EQ(p.kind, ResumePlan::Kind::kReshard);
  EXPECT_EQ(p.load, dst);
  EXPECT_EQ(p.note, src + ": it is cut for tp 2, this run for tp 1; resharding it into " + dst);
}

TEST(PlanResume, AnEarlierStartsCopyIsReusedAndAnythingElseThereIsKept) {
  TempDir dir("resume");
  Env* env = Env::Default();
  const std::string src = dir / "t", dst = dir / "t_tp1";
  auto mismatch = [&](const std::string& d) { return OnlySrcMismatches(src, d); };
  env->CreateDirs(dst);
  WriteMarker(env, dst + "/notes.txt");  // not a complete copy: refused, and left alone
  EXPECT_EQ(ErrorOf([&] { PlanResume(env, src, true, dst, mismatch, ""); }),
            src + ": it is cut for tp 2, this run for tp 1, and " + dst +
                ", where resume_reshard would write this run's copy, already holds something else; move it away");
  EXPECT_TRUE(env->Exists(dst + "/notes.txt"));
  WriteMarker(env, dst + "/" + kDoneMarker);  // complete, and it fits
  const ResumePlan p = PlanResume(env, src, true, dst, mismatch, "");
  EXPECT_EQ(p.kind, ResumePlan::Kind::kReuse);
  EXPECT_EQ(p.load, dst);
  // A complete copy that does not fit this run either is not reused.
  EXPECT_NE(ErrorOf([&] { PlanResume(env, src, true, dst, [](const std::string&) { return "no"; }, ""); }).find("move it away"),
            std::string::npos);
}

const RankGrid kOneRankGrid{1, 1, 1, false};

// A committed tag named for `named_step` whose user_content.pt is `content`.
std::string SaveTagRecording(const std::string& dir, int64_t named_step, const Value& content) {
  CheckpointStore store({.dir = dir});
  Snapshot s = testing::MakeSnapshot("m", named_step, kOneRankGrid, 64, 1);
  s.tag.consumed_samples = 32;
  std::erase_if(s.files, [](const FileToWrite& f) { return f.relpath == kSchedulerFile; });  // its step is the name's
  for (auto& f : s.files)
    if (f.relpath == kUserContentFile) f.value = content;
  store.Save(s);
  return dir + "/" + FormatTagName(s.tag);
}

Value Recorded(int64_t step, const Value& consumed) {
  Value v = UserContent{.global_step = step, .consumed_samples = std::nullopt, .carried = {}}.ToValue();
  v.as_dict().Set("consumed_samples", consumed);
  return v;
}

TEST(FindLatestCheckpoint, OrdersByTheRecordedStepSoALyingNameDoesNotWinForever) {
  TempDir d("resume");
  const std::string lying = SaveTagRecording(d.path(), 999999999999999999, Recorded(4, Value(32.0)));
  // Alone, it is resumed from (at its recorded step 4; ReadTrainingPosition warns of the name).
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr), lying);
  // The run advances and saves step 5: that is the newest now, whatever the other's name says.
  const std::string next = SaveTagRecording(d.path(), 5, Recorded(5, Value(40.0)));
  std::vector<DamagedTag> damaged;
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr, &damaged), next);
  EXPECT_TRUE(damaged.empty()) << damaged[0].problem;
}

TEST(FindLatestCheckpoint, SkipsATagRecordingAnAbsurdPositionSayingWhichValue) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::pair<Value, std::string>> cases = {
      {Recorded(int64_t{1} << 62, Value(8.0)), "global_step is 4611686018427387904, beyond 2^40"},
      {Recorded(9, Value(inf)), "consumed_samples is inf, not a finite count"},
      {Recorded(9, Value(std::nan(""))), "consumed_samples is nan, not a finite count"},
      {Recorded(9, Value(-8.0)), "consumed_samples is -8.000000, negative"},
      {Recorded(-9, Value(8.0)), "global_step is -9, negative"},
  };
  for (const auto& [content, why] : cases) {
    TempDir d("resume");
    const std::string good = SaveTagRecording(d.path(), 5, Recorded(5, Value(40.0)));
    const std::string bad = SaveTagRecording(d.path(), 9, content);
    std::vector<DamagedTag> damaged;
    std::vector<std::string> log;
    EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, [&](const std::string& l) { log.push_back(l); }, &damaged), good) << why;
    ASSERT_EQ(damaged.size(), 1u) << why;
    EXPECT_EQ(damaged[0].path, bad);
    EXPECT_NE(damaged[0].problem.find("user_content.pt: " + why), std::string::npos) << damaged[0].problem;
    ASSERT_FALSE(log.empty());
    EXPECT_NE(log[0].find("resume: skipping " + FormatTagName({"m", 9, 32.0, false}) + ": user_content.pt: " + why), std::string::npos) << log[0];
    // Named explicitly, it is refused the same way.
    EXPECT_NE(ErrorOf([&] { ResolveResume(Env::Default(), d.path(), {.resume_from_checkpoint = bad}, nullptr); }).find(why),
              std::string::npos);
  }
}

// With a ContentCheck the contents of a candidate with a manifest are read by
// the check, not here: what it finds decides as VerifyTag's own reading would,
// and nullopt has every byte read here as before.
TEST(FindLatestCheckpoint, AContentCheckReadsTheFilesInsteadAndDecidesTheSame) {
  TempDir d("resume");
  const std::string good = SaveTagRecording(d.path(), 5, Recorded(5, Value(40.0)));
  const std::string bad = SaveTagRecording(d.path(), 9, Recorded(9, Value(72.0)));
  const std::string victim = "model/" + RankFileName({0, 0, 0});
  {
    std::fstream f(bad + "/" + victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(200);
    const char c = static_cast<char>(f.get() ^ 0x40);
    f.seekp(200);
    f.put(c);
  }
  std::vector<DamagedTag> read_here;
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr, &read_here), good);
  ASSERT_EQ(read_here.size(), 1u);
  EXPECT_NE(read_here[0].problem.find(victim + ": checksum"), std::string::npos) << read_here[0].problem;
  // Read by the check: the same choice, the same problem.
  std::vector<std::string> asked;
  const ContentCheck read_apart = [&](const std::string& tag, const Manifest& m) -> std::optional<std::vector<TagProblem>> {
    asked.push_back(tag);
    std::vector<std::string> listed;
    for (const auto& [rel, digest] : m.files) listed.push_back(rel);
    return VerifyListedContent(Env::Default(), tag, m, listed);
  };
  std::vector<DamagedTag> read_apart_damaged;
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr, &read_apart_damaged, false, read_apart), good);
  EXPECT_EQ(asked, std::vector<std::string>({bad, good}));
  ASSERT_EQ(read_apart_damaged.size(), 1u);
  EXPECT_EQ(read_apart_damaged[0].problem, read_here[0].problem);
  // A check that finds nothing is trusted (this process read no contents), and nullopt reads them here.
  const ContentCheck finds_nothing = [](const std::string&, const Manifest&) { return std::optional<std::vector<TagProblem>>(std::vector<TagProblem>{}); };
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr, nullptr, false, finds_nothing), bad);
  const ContentCheck declines = [](const std::string&, const Manifest&) { return std::optional<std::vector<TagProblem>>(); };
  EXPECT_EQ(FindLatestCheckpoint(Env::Default(), d.path(), true, nullptr, nullptr, false, declines), good);
  EXPECT_EQ(ResolveResume(Env::Default(), d.path(), {.resume_from_checkpoint = bad, .verify_checksums = true, .content_check = finds_nothing},
                          nullptr),
            bad);
}

}  // namespace
}  // namespace ckpt

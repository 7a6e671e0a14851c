// PlanResume: what a job does with a resume tag cut for another parallel
// layout. (Choosing the tag, ResolveResume, is tested with the store in
// checkpoint_store_test.)
#include "ckpt/store/resume.h"

#include <gtest/gtest.h>

#include "ckpt/store/tag_paths.h"
#include "ckpt/store/tag_writer.h"
#include "ckpt/util/test_util.h"

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

}  // namespace
}  // namespace ckpt

#include "ckpt/store/tag_verify.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "ckpt/store/checkpoint_store.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;
using testing::MakeSnapshot;
using testing::TempDir;

// Every problem reported of `file`, one a line.
std::string ProblemsOf(const TagReport& r, const std::string& file) {
  std::string out;
  for (const auto& p : r.problems)
    if (p.file == file) out += p.what + "\n";
  return out;
}

TEST(TagVerify, AFolderLinkedOutOfTheTagIsReportedAndNeverListed) {
  TempDir d("verify");
  CheckpointStore({.dir = d / "ckpts"}).Save(MakeSnapshot("m", 5, {1, 1, 1, false}, 100, 1));
  const std::string tag = d / ("ckpts/" + FormatTagName({"m", 5, 40.0, false})), away = d / "away";
  ASSERT_TRUE(VerifyTag(Env::Default(), tag).ok());
  // model/ linked out.
  fs::create_directories(away);
  fs::rename(tag + "/model", away + "/model");
  fs::create_directory_symlink(away + "/model", tag + "/model");
  FaultEnv env(Env::Default());
  TagReport r = VerifyTag(&env, tag);
  EXPECT_NE(ProblemsOf(r, "model").find(", outside the tag (a symbolic link); not read"), std::string::npos) << ProblemsOf(r, "model");
  EXPECT_NE(ProblemsOf(r, "model/dp_rank_00_tp_rank_00_pp_rank_00.pt").find("missing"), std::string::npos);
  for (const auto& read : env.reads()) EXPECT_EQ(read.find(away), std::string::npos) << read << " was read";
  // An xser tensors folder linked out.
  fs::remove(tag + "/model");
  fs::rename(away + "/model", tag + "/model");
  fs::create_directories(away + "/t.tensors");
  fs::create_directory_symlink(away + "/t.tensors", tag + "/model/dp_rank_00_tp_rank_00_pp_rank_00.tensors");
  FaultEnv env2(Env::Default());
  r = VerifyTag(&env2, tag);
  const std::string tensors = "model/dp_rank_00_tp_rank_00_pp_rank_00.tensors";
  EXPECT_NE(ProblemsOf(r, tensors).find("outside the tag"), std::string::npos) << ProblemsOf(r, tensors);
  for (const auto& read : env2.reads()) EXPECT_EQ(read.find(away), std::string::npos) << read << " was read";
}

}  // namespace
}  // namespace ckpt

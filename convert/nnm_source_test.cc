#include "convert/nnm_source.h"

#include <gtest/gtest.h>

#include <fstream>

#include "ckpt/util/error.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/testing/test_util.h"

namespace convert {
namespace {

using ckpt::testing::ErrorOf;
using ckpt::testing::TempDir;

void Touch(const std::string& path) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << "x";
}

const auto kQuiet = [](const std::string&) {};

TEST(NnmSource, SingleFileAndFolderWithOneFile) {
  TempDir d("nnm_src");
  Touch(d / "model_optim_rng.ckpt");
  NnmSource s = FindNnmCheckpoint(ckpt::Env::Default(), d / "model_optim_rng.ckpt", "", kQuiet);
  EXPECT_EQ(s.grid.tp, 1);
  EXPECT_EQ(s.grid.pp, 1);
  EXPECT_EQ(s.files, std::vector<std::string>{d / "model_optim_rng.ckpt"});
  EXPECT_FALSE(s.name.has_value());
  s = FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", kQuiet);
  EXPECT_EQ(s.file_name, "model_optim_rng.ckpt");
  EXPECT_EQ(s.folders, "single file");
}

TEST(NnmSource, TpPpFoldersPickTheHighestStepAndAnnounceIt) {
  TempDir d("nnm_src");
  for (int p = 0; p < 2; ++p)
    for (int t = 0; t < 3; ++t) {
      char dir[64];
      std::snprintf(dir, sizeof dir, "tp_rank_%02d_pp_rank_%03d", t, p);
      Touch(d / (std::string(dir) + "/megatron_llama--step=10-consumed_samples=80.0.ckpt"));
      Touch(d / (std::string(dir) + "/megatron_llama--step=20-consumed_samples=160.0-last.ckpt"));
      Touch(d / (std::string(dir) + "/megatron_llama--step=20-consumed_samples=160.0.ckpt"));
    }
  std::vector<std::string> logged;
  NnmSource s = FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", [&](const std::string& l) { logged.push_back(l); });
  EXPECT_EQ(s.grid.tp, 3);
  EXPECT_EQ(s.grid.pp, 2);
  EXPECT_EQ(s.file_name, "megatron_llama--step=20-consumed_samples=160.0-last.ckpt");
  ASSERT_TRUE(s.name.has_value());
  EXPECT_EQ(s.name->step, 20);
  EXPECT_DOUBLE_EQ(s.name->consumed_samples, 160.0);
  EXPECT_EQ(s.File(2, 1), d / "tp_rank_02_pp_rank_001/megatron_llama--step=20-consumed_samples=160.0-last.ckpt");
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_NE(logged[0].find("highest step"), std::string::npos);
  s = FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "megatron_llama--step=10-consumed_samples=80.0.ckpt", kQuiet);
  EXPECT_EQ(s.name->step, 10);
}

TEST(NnmSource, MpRankFoldersMeanPpOne) {
  TempDir d("nnm_src");
  for (int t = 0; t < 2; ++t) Touch(d / ("mp_rank_0" + std::to_string(t) + "/model_optim_rng.ckpt"));
  NnmSource s = FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", kQuiet);
  EXPECT_EQ(s.grid.tp, 2);
  EXPECT_EQ(s.grid.pp, 1);
  EXPECT_EQ(s.folders, "mp_rank_XX");
}

TEST(NnmSource, MissingRankFolderIsNamed) {
  TempDir d("nnm_src");
  Touch(d / "tp_rank_00_pp_rank_000/a.ckpt");
  Touch(d / "tp_rank_01_pp_rank_001/a.ckpt");
  const std::string e = ErrorOf([&] { FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", kQuiet); });
  EXPECT_NE(e.find("tp_rank_01_pp_rank_000"), std::string::npos) << e;
  EXPECT_NE(e.find("tp_rank_00_pp_rank_001"), std::string::npos) << e;
}

TEST(NnmSource, MixedStepsAcrossRanksAreListed) {
  TempDir d("nnm_src");
  Touch(d / "mp_rank_00/x--step=5-consumed_samples=40.0.ckpt");
  Touch(d / "mp_rank_01/x--step=6-consumed_samples=48.0.ckpt");
  const std::string e = ErrorOf([&] { FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", kQuiet); });
  EXPECT_NE(e.find("mixed steps"), std::string::npos) << e;
  EXPECT_NE(e.find("x--step=5-consumed_samples=40.0.ckpt: mp_rank_00"), std::string::npos) << e;
  EXPECT_NE(e.find("x--step=6-consumed_samples=48.0.ckpt: mp_rank_01"), std::string::npos) << e;
}

TEST(NnmSource, Zero1OptimizerFilesPerDataParallelRank) {
  TempDir d("nnm_src");
  const std::string f = "m--step=3-consumed_samples=24.0-last.ckpt";
  EXPECT_EQ(Zero1FileName(f), "m--step=3-consumed_samples=24.0-optimizer_states-last.ckpt");
  EXPECT_EQ(Zero1FileName("m--step=3-consumed_samples=24.0.ckpt"), "m--step=3-consumed_samples=24.0-optimizer_states.ckpt");
  EXPECT_EQ(CheckpointStem("model_optim_rng.pt"), "model_optim_rng");
  EXPECT_EQ(CheckpointStem("notes.txt"), "notes.txt");
  for (int t = 0; t < 2; ++t) {
    const std::string r = "mp_rank_0" + std::to_string(t);
    Touch(d / (r + "/" + f));
    for (int dp = 0; dp < 2; ++dp) Touch(d / (r + "/optim/dp_rank_00" + std::to_string(dp) + "/" + Zero1FileName(f)));
  }
  NnmSource s = FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", kQuiet);
  EXPECT_EQ(s.zero1_dp(), 2);
  EXPECT_EQ(s.Zero1File(1, 0, 1), d / ("mp_rank_01/optim/dp_rank_001/" + Zero1FileName(f)));
  std::filesystem::remove(d / ("mp_rank_01/optim/dp_rank_001/" + Zero1FileName(f)));
  const std::string e = ErrorOf([&] { FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", kQuiet); });
  EXPECT_NE(e.find("mp_rank_01/optim/dp_rank_001"), std::string::npos) << e;
}

TEST(NnmSource, SeveralUnnamedFilesNeedCheckpointName) {
  TempDir d("nnm_src");
  Touch(d / "a.ckpt");
  Touch(d / "b.ckpt");
  const std::string e = ErrorOf([&] { FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "", kQuiet); });
  EXPECT_NE(e.find("--checkpoint_name"), std::string::npos) << e;
  EXPECT_EQ(FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "b.ckpt", kQuiet).file_name, "b.ckpt");
  EXPECT_NE(ErrorOf([&] { FindNnmCheckpoint(ckpt::Env::Default(), d.path(), "c.ckpt", kQuiet); }).find("a.ckpt, b.ckpt"),
            std::string::npos);
}

// Nothing of `away` was listed or read through `env`.
void ExpectNothingReadUnder(const ckpt::FaultEnv& env, const std::string& away) {
  for (const auto& r : env.reads()) EXPECT_EQ(r.find(away), std::string::npos) << r << " was read";
}

TEST(NnmSource, FoldersAndFilesLinkedOutOfTheCheckpointAreRefusedBeforeTheyAreListedOrRead) {
  namespace fs = std::filesystem;
  TempDir d("nnm_src");
  const std::string root = d / "ckpt", away = d / "away", f = "m.ckpt", opt = Zero1FileName("m.ckpt");
  for (const char* r : {"/mp_rank_00/", "/mp_rank_01/"}) {
    Touch(root + r + f);
    Touch(root + r + "optim/dp_rank_000/" + opt);
    Touch(away + r + f);
    Touch(away + r + "optim/dp_rank_000/" + opt);
  }
  auto refused = [&](const std::string& link, const std::string& target) {
    fs::remove_all(link);
    fs::is_directory(target) ? fs::create_directory_symlink(target, link) : fs::create_symlink(target, link);
    ckpt::FaultEnv env(ckpt::Env::Default());
    const std::string e = ErrorOf([&] { FindNnmCheckpoint(&env, root, "", kQuiet); });
    EXPECT_NE(e.find(link + ": resolves to "), std::string::npos) << e;
    EXPECT_NE(e.find(", outside " + root + " "), std::string::npos) << e;
    ExpectNothingReadUnder(env, away);
    fs::remove(link);
  };
  EXPECT_EQ(FindNnmCheckpoint(ckpt::Env::Default(), root, "", kQuiet).zero1_dp(), 1);
  refused(root + "/mp_rank_01", away + "/mp_rank_01");  // a rank folder
  Touch(root + "/mp_rank_01/" + f);
  Touch(root + "/mp_rank_01/optim/dp_rank_000/" + opt);
  refused(root + "/mp_rank_01/" + f, away + "/mp_rank_01/" + f);  // a rank file
  Touch(root + "/mp_rank_01/" + f);
  refused(root + "/mp_rank_01/optim", away + "/mp_rank_01/optim");  // the ZeRO-1 folder
  Touch(root + "/mp_rank_01/optim/dp_rank_000/" + opt);
  refused(root + "/mp_rank_01/optim/dp_rank_000", away + "/mp_rank_01/optim/dp_rank_000");  // a data-parallel rank's folder
  Touch(root + "/mp_rank_01/optim/dp_rank_000/" + opt);
  refused(root + "/mp_rank_01/optim/dp_rank_000/" + opt, away + "/mp_rank_01/optim/dp_rank_000/" + opt);  // an optimizer file
  Touch(root + "/mp_rank_01/optim/dp_rank_000/" + opt);
  // Links inside the folder are followed.
  fs::rename(root + "/mp_rank_01", root + "/elsewhere");
  fs::create_directory_symlink("elsewhere", root + "/mp_rank_01");
  EXPECT_EQ(FindNnmCheckpoint(ckpt::Env::Default(), root, "", kQuiet).File(1, 0), root + "/mp_rank_01/" + f);
}

}  // namespace
}  // namespace convert

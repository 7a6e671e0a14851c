#include "ckpt/store/tag_verify.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

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

// NxDT's ep 2 save (tests/data/upstream/nxd_mixtral/nxdt_ep2_pt): optim/ named by ep rank, ep rank 0's
// alone, is reported as the optim/ folder's problem; NxD's own ep 2 tag is not.
TEST(TagVerify, NxdtsLossyExpertParallelSaveIsDamagedByDesign) {
  const std::string data = std::string(SHARDKIT_TEST_DATA) + "/upstream/nxd_mixtral/";
  const std::string lost = ProblemsOf(VerifyTag(Env::Default(), data + "nxdt_ep2_pt/hf_mixtral--step=2-consumed_samples=16.0.ckpt"), "optim/");
  EXPECT_TRUE(lost.starts_with("damaged by design: NxDT saved an expert-parallel (ep=2) dp=2 ZeRO-1 optimizer of an MoE model")) << lost;
  EXPECT_NE(lost.find("optim/ holds ep rank 0's files alone"), std::string::npos) << lost;
  EXPECT_EQ(ProblemsOf(VerifyTag(Env::Default(), data + "hf_ep2_pt/step_2"), "optim/"), "");
}

// NxD's ep 1 Mixtral tags of either style hold the parts the family reads (ckpt/shard reads them at any tp):
// their bytes vouch for them. Of NxD's ep 2 tag the model files are read too (their SPMDRank tensors
// are NxD's), and its NeuronEPZero1Optimizer files, checked over dp and expert-dp.
TEST(TagVerify, Ep1MoeTagsOfEitherStyleAreOk) {
  const std::string data = std::string(SHARDKIT_TEST_DATA) + "/upstream/nxd_mixtral/";
  for (const char* tag : {"hf_ep1_pt", "hf_ep1_xser", "megatron_ep1_pt", "megatron_ep1_xser", "megatron_freq2_ep1_pt"}) {
    const TagReport r = VerifyTag(Env::Default(), data + tag + "/step_2");
    EXPECT_TRUE(r.ok()) << tag << ": " << (r.ok() ? "" : r.problems[0].file + ": " + r.problems[0].what);
  }
  const TagReport ep2 = VerifyTag(Env::Default(), data + "hf_ep2_pt/step_2");
  EXPECT_EQ(ProblemsOf(ep2, "model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"), "");
  EXPECT_EQ(ProblemsOf(ep2, "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"), "");
}

// Reading the contents apart (each rank of a resume its files): VerifyTag
// without checksums plus VerifyListedContent over every listed file reports
// what VerifyTag with checksums reports, each problem once.
TEST(TagVerify, ContentCheckedApartAddsUpToTheWholeCheck) {
  TempDir d("verify");
  CheckpointStore({.dir = d / "ckpts"}).Save(MakeSnapshot("m", 5, {2, 1, 2, true}, 4000, 1));
  const std::string tag = d / ("ckpts/" + FormatTagName({"m", 5, 40.0, false}));
  const std::string flipped = "model/dp_rank_00_tp_rank_01_pp_rank_00.pt", cut = "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt";
  {
    std::fstream f(tag + "/" + flipped, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(2000);
    const char c = static_cast<char>(f.get() ^ 0x40);
    f.seekp(2000);
    f.put(c);
  }
  fs::resize_file(tag + "/" + cut, fs::file_size(tag + "/" + cut) - 10);
  fs::remove(tag + "/" + kSchedulerFile);
  const Manifest m = Manifest::Load(Env::Default(), tag + "/" + kManifestFile);
  std::vector<std::string> listed;
  for (const auto& [rel, digest] : m.files) listed.push_back(rel);
  // The file read apart: only the flipped byte is found; the cut and missing files are left to the structure check.
  const std::vector<TagProblem> content = VerifyListedContent(Env::Default(), tag, m, listed);
  ASSERT_EQ(content.size(), 1u);
  EXPECT_EQ(content[0].file, flipped);
  EXPECT_NE(content[0].what.find("checksum"), std::string::npos) << content[0].what;
  TagReport apart = VerifyTag(Env::Default(), tag, {.checksums = false});
  apart.problems.insert(apart.problems.end(), content.begin(), content.end());
  std::sort(apart.problems.begin(), apart.problems.end(), [](const TagProblem& a, const TagProblem& b) {
    return std::tie(a.file, a.what) < std::tie(b.file, b.what);
  });
  const TagReport whole = VerifyTag(Env::Default(), tag, {.checksums = true});
  ASSERT_EQ(whole.problems.size(), 3u);
  ASSERT_EQ(apart.problems.size(), whole.problems.size());
  for (size_t i = 0; i < whole.problems.size(); ++i) {
    EXPECT_EQ(apart.problems[i].file, whole.problems[i].file);
    EXPECT_EQ(apart.problems[i].what, whole.problems[i].what);
  }
  // A subset reads only its files.
  EXPECT_TRUE(VerifyListedContent(Env::Default(), tag, m, {"model/dp_rank_00_tp_rank_00_pp_rank_00.pt"}).empty());
}

}  // namespace
}  // namespace ckpt

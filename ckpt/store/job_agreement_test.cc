// The ranks' job check: what a difference says, how an input is described,
// and that a rank whose job differs aborts before its peers pass the check.
#include "ckpt/store/job_agreement.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/util/output_guard.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::TempDir;

void WriteBytes(const std::string& path, size_t n) {
  std::ofstream(path, std::ios::binary) << std::string(n, 'x');
}

TEST(JobAgreement, TheSameJobHasNoDifference) {
  const JobFields job{{"command", "ckpt-reshard"}, {"--tp", "2"}};
  EXPECT_EQ(JobDifference(job, job, 1), "");
}

TEST(JobAgreement, ADifferenceNamesTheFieldRank0sValueAndThisRanks) {
  const JobFields rank0{{"command", "ckpt-reshard"}, {"src", "/a (3 files, 10 bytes)"}, {"--tp", "2"}, {"--dry_run", "true"}};
  const JobFields mine{{"command", "ckpt-reshard"}, {"src", "/b (3 files, 12 bytes)"}, {"--tp", "1"}, {"--overwrite", "true"}};
  EXPECT_EQ(JobDifference(rank0, mine, 3),
            "src is '/a (3 files, 10 bytes)' on rank 0 but '/b (3 files, 12 bytes)' on rank 3; "
            "--tp is '2' on rank 0 but '1' on rank 3; "
            "--dry_run is 'true' on rank 0 but (not given) on rank 3; "
            "--overwrite is (not given) on rank 0 but 'true' on rank 3");
}

TEST(JobAgreement, AnInputIsItsResolvedPathFileCountAndBytes) {
  TempDir d("job_input");
  std::filesystem::create_directories(d / "tag/model");
  WriteBytes(d / "tag/done", 1);
  WriteBytes(d / "tag/model/a.pt", 100);
  WriteBytes(d / "tag/model/b.pt", 23);
  std::filesystem::create_directory_symlink(d / "tag", d / "link");
  const std::string real = ResolvedPath(d / "tag");
  EXPECT_EQ(DescribeInput(Env::Default(), d / "tag"), real + " (3 files, 124 bytes)");
  EXPECT_EQ(DescribeInput(Env::Default(), d / "link/"), real + " (3 files, 124 bytes)");  // the same tag by another name
  EXPECT_EQ(DescribeInput(Env::Default(), d / "tag/model/a.pt"), real + "/model/a.pt (1 file, 100 bytes)");
  EXPECT_EQ(DescribeInput(Env::Default(), d / "gone"), ResolvedPath(d / "gone") + " (absent)");
  WriteBytes(d / "tag/model/b.pt", 24);  // another copy under the same name differs
  EXPECT_EQ(DescribeInput(Env::Default(), d / "tag"), real + " (3 files, 125 bytes)");
}

TEST(JobAgreement, AFolderLinkedOutOfTheInputIsCountedNotListed) {
  TempDir d("job_link_out");
  std::filesystem::create_directories(d / "tag/model");
  std::filesystem::create_directories(d / "elsewhere");
  WriteBytes(d / "tag/model/a.pt", 10);
  WriteBytes(d / "elsewhere/big.pt", 1000);
  std::filesystem::create_directory_symlink(d / "elsewhere", d / "tag/optim");
  EXPECT_EQ(DescribeInput(Env::Default(), d / "tag"), ResolvedPath(d / "tag") + " (1 file, 10 bytes, 1 folder link(s) out of it not followed)");
}

TEST(JobAgreement, AFolderLoopIsCountedToABoundedDepth) {
  TempDir d("job_loop");
  std::filesystem::create_directories(d / "tag");
  WriteBytes(d / "tag/f", 5);
  std::filesystem::create_directory_symlink(d / "tag", d / "tag/again");  // tag/again/again/... never ends
  const std::string described = DescribeInput(Env::Default(), d / "tag");
  EXPECT_EQ(described, ResolvedPath(d / "tag") + " (" + std::to_string(kMaxInputDepth) + " files, " + std::to_string(5 * kMaxInputDepth) +
                           " bytes, counted to " + std::to_string(kMaxInputDepth) + " folders deep and " + std::to_string(kMaxInputEntries) +
                           " entries)");
}

// Rank `rank` of two, rank 0's side played by the test.
struct FakeGroup final : WriterGroup {
  struct Aborted {
    int code;
  };
  explicit FakeGroup(std::string rank0_job) : rank0_job(std::move(rank0_job)) {}
  int rank() const override { return 1; }
  int size() const override { return 2; }
  void Broadcast(std::string* s) override { *s = broadcasts++ == 0 ? rank0_job : ""; }
  std::vector<std::string> Gather(const std::string&) override {
    ++gathers;
    return {};
  }
  [[noreturn]] void Abort(int code) override { throw Aborted{code}; }
  std::string rank0_job;
  int broadcasts = 0, gathers = 0;
};

TEST(JobAgreement, ARankRunningRank0sJobWaitsForEveryRanksCheckThenGoesOn) {
  const JobFields job{{"command", "ckpt-reshard"}, {"--tp", "2"}};
  FakeGroup g(nlohmann::json(job).dump());
  AgreeOnJob(g, job);
  EXPECT_EQ(g.gathers, 1);     // every rank reports having compared
  EXPECT_EQ(g.broadcasts, 2);  // rank 0's job, then its go-ahead
}

TEST(JobAgreement, ARankWhoseJobDiffersAbortsTheGroupWithExit2BeforeItsPeersGoOn) {
  const JobFields rank0{{"command", "ckpt-reshard"}, {"--tp", "2"}};
  FakeGroup g(nlohmann::json(rank0).dump());
  try {
    AgreeOnJob(g, {{"command", "ckpt-reshard"}, {"--tp", "1"}});
    FAIL() << "a rank whose --tp differs went on";
  } catch (const FakeGroup::Aborted& a) {
    EXPECT_EQ(a.code, 2);
  }
  EXPECT_EQ(g.gathers, 0);  // aborted before the point its peers wait at
}

TEST(JobAgreement, AloneThereIsNothingToCompare) {
  AgreeOnJob(SoloGroup(), {{"command", "ckpt-reshard"}});  // no collective: it would wait for nobody
}

}  // namespace
}  // namespace ckpt

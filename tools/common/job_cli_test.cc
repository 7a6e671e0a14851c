// The job a command line asks for: every option given, inputs by resolved
// path and size, outputs by resolved path, and none of the options that
// cannot change the output.
#include "tools/common/job_cli.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "ckpt/util/output_guard.h"
#include "ckpt/testing/test_util.h"

namespace tools {
namespace {

ckpt::JobFields Parse(std::vector<std::string> args) {
  CLI::App app{"test"};
  std::string src, dst, config;
  int tp = 0, threads = 1;
  bool dry_run = false;
  app.add_option("src", src);
  app.add_option("dst", dst);
  app.add_option("--tp", tp);
  app.add_option("--threads", threads);
  app.add_option("--config", config);
  app.add_flag("--dry_run", dry_run);
  std::vector<std::string> argv{"ckpt-test"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> ptrs;
  for (auto& a : argv) ptrs.push_back(a.data());
  app.parse(static_cast<int>(ptrs.size()), ptrs.data());
  return JobOf(app, {.command = "ckpt-test", .inputs = {"src", "--config"}, .outputs = {"dst"}, .not_in_output = {"--threads"}},
               ckpt::Env::Default());
}

TEST(JobCli, EveryOptionGivenButThoseThatCannotChangeTheOutputInDeclaredOrder) {
  ckpt::testing::TempDir d("job_cli");
  std::filesystem::create_directories(d / "src");
  std::ofstream(d / "src/a.pt") << "12345";
  std::ofstream(d / "job.yaml") << "model: {}\n";
  const std::string src = ckpt::ResolvedPath(d / "src"), out = ckpt::ResolvedPath(d / "out");
  const ckpt::JobFields job = Parse({d / "src/", d / "sub/../out", "--threads", "8", "--config", d / "job.yaml", "--tp=2"});
  const ckpt::JobFields want{{"command", "ckpt-test"},
                             {"src", src + " (1 file, 5 bytes)"},
                             {"dst", out},
                             {"--tp", "2"},
                             {"--config", ckpt::ResolvedPath(d / "job.yaml") + " (1 file, 10 bytes)"}};
  EXPECT_EQ(job, want);
  // The same job spelled otherwise is the same job; another --threads too.
  EXPECT_EQ(Parse({d / "src", d / "out", "--tp", "2", "--config", d / "job.yaml", "--threads", "1"}), want);
  EXPECT_EQ(ckpt::JobDifference(want, Parse({d / "src", d / "out", "--config", d / "job.yaml", "--tp", "2", "--threads", "1"}), 1), "");
  // A flag is part of the job.
  EXPECT_EQ(ckpt::JobDifference(want, Parse({d / "src", d / "out", "--config", d / "job.yaml", "--tp", "2", "--dry_run"}), 1),
            "--dry_run is (not given) on rank 0 but 'true' on rank 1");
}

}  // namespace
}  // namespace tools

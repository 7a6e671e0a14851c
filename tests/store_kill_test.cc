// Fault test for the checkpoint store: a child writes checkpoints in a loop
// (async and sync, save_top_k=3) and is SIGKILLed at a seeded random moment.
// After each kill: resume picks a tag that verifies with checksums, never a
// partial one, and the newest tag the child reported complete is still there
// and intact (nothing complete was lost).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>
#include <sstream>

#include "ckpt/store/resume.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

struct Outcome {
  std::vector<std::string> saved;  // tags the child reported committed
  bool exited = false;             // finished before the kill
};

Outcome RunAndKill(const std::string& dir, bool async, int kill_after_ms) {
  int out[2];
  if (::pipe(out) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::close(out[0]);
    ::close(out[1]);
    ::execl(STRESS_BIN, STRESS_BIN, dir.c_str(), async ? "1" : "0", "1000", "7", nullptr);
    ::_exit(127);
  }
  ::close(out[1]);
  ::usleep(kill_after_ms * 1000);
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  Outcome o;
  o.exited = WIFEXITED(status);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) text.append(buf, n);
  ::close(out[0]);
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("saved ", 0) == 0) o.saved.push_back(line.substr(6));
  return o;
}

class StoreKill : public ::testing::TestWithParam<int> {};

TEST_P(StoreKill, ResumePicksACompleteCheckpointAfterSigkill) {
  const int trial = GetParam();
  std::mt19937 rng(trial);
  const bool async = trial % 2 == 0;
  testing::TempDir dir("kill");
  // Two kills in a row into the same directory: the second run starts over
  // the debris of the first, as a restarted job would.
  std::vector<std::string> all_saved;
  for (int round = 0; round < 2; ++round) {
    const int ms = std::uniform_int_distribution<int>(30, 600)(rng);
    const Outcome o = RunAndKill(dir.path(), async, ms);
    ASSERT_FALSE(o.exited) << "the child finished before the kill; raise its step count";
    all_saved.insert(all_saved.end(), o.saved.begin(), o.saved.end());
    std::vector<std::string> log;
    const auto latest = FindLatestCheckpoint(Env::Default(), dir.path(), true, [&](const std::string& l) { log.push_back(l); });
    // Every tag that has `done` verifies fully: nothing complete-looking is torn.
    for (const auto& t : ListTags(Env::Default(), dir.path()))
      if (t.has_done) {
        const TagReport r = VerifyTag(Env::Default(), t.path);
        EXPECT_TRUE(r.ok()) << t.path << ": " << (r.problems.empty() ? "" : r.problems[0].file + ": " + r.problems[0].what);
      }
    if (all_saved.empty()) {
      // No save was reported, yet one may have committed after the child's last report and
      // before the kill. Whatever is picked must then verify; nothing torn may be.
      if (latest) {
        const TagReport r = VerifyTag(Env::Default(), *latest);
        EXPECT_TRUE(r.ok() && r.has_manifest) << "picked " << *latest << ", which does not verify against its manifest";
      }
      continue;
    }
    ASSERT_TRUE(latest.has_value()) << "nothing to resume from after " << all_saved.size() << " commits";
    EXPECT_TRUE(Env::Default()->Exists(*latest + "/done"));
    // The newest reported commit survives; a newer one may have completed
    // after the child's last report but before the kill.
    const auto newest_reported = ParseTagName(std::filesystem::path(all_saved.back()).filename());
    const auto picked = ParseTagName(std::filesystem::path(*latest).filename());
    ASSERT_TRUE(newest_reported && picked);
    EXPECT_GE(picked->step, newest_reported->step) << "a committed checkpoint was lost";
    EXPECT_TRUE(VerifyTag(Env::Default(), all_saved.back()).ok() || picked->step > newest_reported->step);
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, StoreKill, ::testing::Range(0, 32));

}  // namespace
}  // namespace ckpt

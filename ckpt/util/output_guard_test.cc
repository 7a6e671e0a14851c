#include "ckpt/util/output_guard.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "ckpt/util/env.h"
#include "ckpt/util/error.h"
#include "ckpt/testing/fault_env.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

using testing::ErrorOf;
using testing::TempDir;
using testing::Touch;

TEST(OutputGuard, OutputThatIsContainsOrLiesInsideAnInputIsRefused) {
  TempDir d("guard");
  const std::string in = d.path() + "/nnm";
  std::filesystem::create_directories(in + "/tp_rank_00");
  const std::vector<InputPath> inputs = {{in, "--nnm_ckpt_path"}};
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{in, "--nxdt_ckpt_path", true}}, inputs); }).find("is the input --nnm_ckpt_path"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{in + "/../nnm/", "--nxdt_ckpt_path", true}}, inputs); }).find("is the input"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{in + "/tp_rank_00/out", "--nxdt_ckpt_path", true}}, inputs); }).find("lies inside"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{d.path(), "--nxdt_ckpt_path", true}}, inputs); }).find("contains the input"),
            std::string::npos);
  // A symlink to the input is the input.
  ASSERT_EQ(::symlink(in.c_str(), (d.path() + "/alias").c_str()), 0);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{d.path() + "/alias", "-o", true}}, inputs); }).find("is the input"), std::string::npos);
  // A sibling whose name starts like the input is not inside it.
  EXPECT_EQ(ErrorOf([&] { CheckOutputs({{in + "2", "--nxdt_ckpt_path", true}}, inputs); }), "");
  // Trailing separators name the same folder.
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{in + "/", "--nxdt_ckpt_path", true}}, {{in + "//", "--nnm_ckpt_path"}}); })
                .find("is the input"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{d.path() + "/", "--nxdt_ckpt_path", true}}, inputs); }).find("contains the input"),
            std::string::npos);
  // "alias/" must not follow the link past the check.
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{d.path() + "/alias/", "-o", true}}, {}); }).find("symbolic link"), std::string::npos);
}

TEST(OutputGuard, TwoOutputsAtOnePathAndLinksAndNodesAreRefused) {
  TempDir d("guard");
  const std::string a = d.path() + "/a.yaml";
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{a, "-o"}, {d.path() + "/./a.yaml", "--report"}}, {}); }).find("--report"),
            std::string::npos);
  Touch(d.path() + "/target");
  ASSERT_EQ(::symlink((d.path() + "/target").c_str(), a.c_str()), 0);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{a, "-o"}}, {}); }).find("symbolic link"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{"/dev/null", "-o"}}, {}); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{d.path(), "-o"}}, {}); }).find("(a folder)"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { CheckOutputs({{d.path() + "/missing/r.json", "--report"}}, {}); }).find("does not exist"),
            std::string::npos);
  EXPECT_EQ(ErrorOf([&] { CheckOutputs({{d.path() + "/target", "-o"}, {d.path() + "/new.json", "--report"}}, {}); }), "");
}

TEST(OutputGuard, SeveralFilesAreWrittenAllOrNone) {
  TempDir d("guard");
  FaultEnv env(Env::Default());
  const std::string a = d.path() + "/a", b = d.path() + "/b";
  Touch(a);
  auto text = [](const std::string& s) {
    return [s](WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>(s.data()), s.size()}); };
  };
  // The second file cannot be written: neither is replaced, no temporaries stay.
  EXPECT_THROW(WriteFilesAtomically(&env, {{a, text("new")}, {d.path() + "/no/such/b", text("b")}}), Error);
  std::ifstream fa(a);
  std::string got((std::istreambuf_iterator<char>(fa)), {});
  EXPECT_EQ(got, "x");
  EXPECT_EQ(Env::Default()->ListDir(d.path()), std::vector<std::string>{"a"});
  // The second rename fails: the first file is in place, no temporary is left behind.
  env.FailRenameAt(2);
  EXPECT_THROW(WriteFilesAtomically(&env, {{a, text("newer")}, {b, text("b")}}), Error);
  EXPECT_EQ(Env::Default()->FileSize(a), 5u);
  EXPECT_EQ(Env::Default()->ListDir(d.path()), std::vector<std::string>{"a"});
  WriteFilesAtomically(&env, {{a, text("new")}, {b, text("b")}});
  EXPECT_EQ(Env::Default()->FileSize(a), 3u);
  EXPECT_EQ(Env::Default()->FileSize(b), 1u);
}

}  // namespace
}  // namespace ckpt

#include "ckpt/util/input_guard.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;
using testing::ErrorOf;
using testing::TempDir;
using testing::Touch;

TEST(InputGuard, LinksInsideTheFolderAreFollowedAndLinksOutAreRefused) {
  TempDir d("inguard");
  const std::string root = d.path() + "/model", out = d.path() + "/secret";
  fs::create_directories(root + "/sub");
  Touch(root + "/sub/a.bin");
  Touch(out);
  fs::create_symlink("sub/a.bin", root + "/in.bin");
  fs::create_symlink(out, root + "/out.bin");
  fs::create_directory_symlink(d.path(), root + "/up");
  EXPECT_TRUE(ResolvesInside(root, root + "/sub/a.bin"));
  EXPECT_TRUE(ResolvesInside(root, root + "/in.bin"));
  EXPECT_FALSE(ResolvesInside(root, root + "/out.bin"));
  EXPECT_FALSE(ResolvesInside(root, root + "/up/secret"));
  EXPECT_FALSE(ResolvesInside(root, root + "/../secret"));
  // A sibling whose name starts with the folder's is not inside it.
  fs::create_directories(d.path() + "/model2");
  Touch(d.path() + "/model2/x");
  EXPECT_FALSE(ResolvesInside(root, d.path() + "/model2/x"));
  const std::string e = ErrorOf([&] { RequireInside(root, root + "/out.bin"); });
  EXPECT_NE(e.find("out.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("outside " + root), std::string::npos) << e;
  // The folder itself named through a link: its files resolve inside its real path.
  fs::create_directory_symlink(root, d.path() + "/alias");
  EXPECT_TRUE(ResolvesInside(d.path() + "/alias", d.path() + "/alias/in.bin"));
}

TEST(InputGuard, AHuggingFaceCacheSnapshotMayLinkIntoItsBlobsOnly) {
  TempDir d("inguard");
  const std::string cache = d.path() + "/models--org--m", snap = cache + "/snapshots/abc";
  fs::create_directories(snap);
  fs::create_directories(cache + "/blobs");
  fs::create_directories(cache + "/refs");
  Touch(cache + "/blobs/0123");
  Touch(cache + "/refs/main");
  fs::create_symlink("../../blobs/0123", snap + "/model.safetensors");
  fs::create_symlink("../../refs/main", snap + "/config.json");
  EXPECT_TRUE(ResolvesInside(snap, snap + "/model.safetensors"));
  EXPECT_FALSE(ResolvesInside(snap, snap + "/config.json"));
  // Outside a snapshots/ folder, blobs/ gets no exception.
  const std::string plain = d.path() + "/plain";
  fs::create_directories(plain);
  fs::create_symlink(cache + "/blobs/0123", plain + "/w");
  EXPECT_FALSE(ResolvesInside(plain, plain + "/w"));
}

// ConfinedTree answers as ResolvesInside does for every kind of path: plain
// files, links in and out, a linked folder, a missing file, the folder itself
// named through a link, and a snapshot's blobs (each asked twice: the second
// answer comes from the folder cache).
TEST(InputGuard, AConfinedTreeAnswersAsResolvesInside) {
  TempDir d("inguard");
  const std::string root = d.path() + "/tag", out = d.path() + "/elsewhere";
  fs::create_directories(root + "/model/r0.pt.tensors");
  fs::create_directories(out + "/sub");
  Touch(root + "/model/r0.pt.tensors/tensor_0.pt");
  Touch(root + "/model/r0.pt");
  Touch(out + "/secret");
  Touch(out + "/sub/tensor_1.pt");
  fs::create_symlink("../r0.pt", root + "/model/r0.pt.tensors/in.pt");
  fs::create_symlink(out + "/secret", root + "/model/r0.pt.tensors/out.pt");
  fs::create_directory_symlink(out + "/sub", root + "/model/r1.pt.tensors");
  fs::create_directory_symlink(root + "/model", d.path() + "/model_alias");
  const std::vector<std::pair<std::string, bool>> cases = {
      {root + "/model/r0.pt.tensors/tensor_0.pt", true}, {root + "/model/r0.pt", true},
      {root + "/model/r0.pt.tensors/in.pt", true},       {root + "/model/r0.pt.tensors/out.pt", false},
      {root + "/model/r1.pt.tensors/tensor_1.pt", false}, {root + "/model/r1.pt.tensors", false},
      {root + "/model/missing.pt", true},                {root + "/model/..", true},
      {root + "/../elsewhere/secret", false},            {d.path() + "/model_alias/r0.pt", true}};
  const ConfinedTree tree(root);
  for (int pass = 0; pass < 2; ++pass)
    for (const auto& [path, inside] : cases) {
      EXPECT_EQ(ResolvesInside(root, path), inside) << path;
      EXPECT_EQ(tree.Inside(path), inside) << path << " (pass " << pass << ")";
    }
  const std::string cache = d.path() + "/models--org--m", snap = cache + "/snapshots/abc";
  fs::create_directories(snap);
  fs::create_directories(cache + "/blobs");
  const ConfinedTree snapshot(snap);
  EXPECT_TRUE(snapshot.Inside(cache + "/blobs"));  // its folder lies outside the snapshot; the path itself is allowed
  EXPECT_FALSE(snapshot.Inside(cache + "/refs"));
}

TEST(InputGuard, AFifoIsRefusedByMapFileWithoutBlocking) {
  TempDir d("inguard");
  const std::string fifo = d.path() + "/f.pt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string e = ErrorOf([&] { Env::Default()->MapFile(fifo); });
  EXPECT_NE(e.find("not a regular file"), std::string::npos) << e;
}

}  // namespace
}  // namespace ckpt

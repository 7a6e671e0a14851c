#include "ckpt/util/open_file_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/testing/fault_env.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

std::string CacheTestDir() {
  auto d = std::filesystem::temp_directory_path() / ("open_file_cache_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

// Writes `n` files f0..f{n-1}, file i holding bytes (i * 7 + k) % 251 for k < 1000.
std::vector<std::string> WriteFiles(const std::string& dir, int n) {
  std::vector<std::string> paths;
  for (int i = 0; i < n; ++i) {
    paths.push_back(dir + "/f" + std::to_string(i));
    std::ofstream f(paths.back(), std::ios::binary);
    for (int k = 0; k < 1000; ++k) f.put(static_cast<char>((i * 7 + k) % 251));
  }
  return paths;
}

size_t OpenDescriptors() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST(OpenFileCache, ReadsRangesOfManyFilesKeepingAtMostCapacityOpen) {
  const std::string dir = CacheTestDir();
  const auto paths = WriteFiles(dir, 10);
  const size_t before = OpenDescriptors();
  OpenFileCache cache(Env::Default(), 3);
  for (int round = 0; round < 2; ++round)
    for (int i = 0; i < 10; ++i) {
      std::vector<uint8_t> got(5);
      cache.ReadAt(paths[i], 100 + i, got);
      for (int k = 0; k < 5; ++k) EXPECT_EQ(got[k], (i * 7 + 100 + i + k) % 251) << paths[i] << " byte " << 100 + i + k;
      EXPECT_LE(cache.open_files(), 3u);
      EXPECT_LE(OpenDescriptors(), before + 3);  // evicted files' descriptors are closed
    }
  EXPECT_EQ(cache.open_files(), 3u);
  std::filesystem::remove_all(dir);
}

TEST(OpenFileCache, ClosesTheLeastRecentlyUsedFileFirst) {
  const std::string dir = CacheTestDir();
  const auto p = WriteFiles(dir, 3);
  FaultEnv env(Env::Default());
  OpenFileCache cache(&env, 2);
  std::vector<uint8_t> b(1);
  for (int i : {0, 1, 0, 2, 0, 1}) cache.ReadAt(p[i], 0, b);
  // f0 stays open (used last before f2 came); f1 is closed for f2 and opened again.
  EXPECT_EQ(env.reads(), (std::vector<std::string>{p[0], p[1], p[2], p[1]}));
  std::filesystem::remove_all(dir);
}

TEST(OpenFileCache, AReadPastTheEndOrAFailedReadNamesTheFile) {
  const std::string dir = CacheTestDir();
  const auto p = WriteFiles(dir, 1);
  FaultEnv env(Env::Default());
  OpenFileCache cache(&env);
  std::vector<uint8_t> b(10);
  try {
    cache.ReadAt(p[0], 995, b);
    FAIL() << "read past the end accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p[0] + ": ends before byte 1005"), std::string::npos) << e.what();
  }
  env.FailReadAt(2);
  cache.ReadAt(p[0], 0, b);
  EXPECT_EQ(b[9], 9);
  try {
    cache.ReadAt(p[0], 0, b);
    FAIL() << "injected read failure not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p[0] + ": read failed"), std::string::npos) << e.what();
  }
  try {
    cache.ReadAt(dir + "/absent", 0, b);
    FAIL() << "absent file read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/absent: cannot open"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ckpt

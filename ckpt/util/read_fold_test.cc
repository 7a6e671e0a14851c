#include "ckpt/util/read_fold.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ckpt/testing/fault_env.h"
#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

// A file of `n` pseudo-random bytes in a fresh folder; returns its path and fills `bytes`.
std::string WriteRandomFile(size_t n, std::vector<uint8_t>* bytes) {
  auto d = std::filesystem::temp_directory_path() / ("read_fold_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  std::mt19937 gen(7);
  bytes->resize(n);
  for (auto& b : *bytes) b = static_cast<uint8_t>(gen());
  const std::string path = (d / "f").string();
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes->data()), static_cast<std::streamsize>(n));
  return path;
}

void ReadThrough(Env* env, const std::string& path, uint64_t offset, uint64_t n) {
  std::vector<uint8_t> out(n);
  env->NewRandomAccessFile(path)->ReadAt(offset, out);
}

TEST(ReadFold, RecordedRangesMergeAndTheCheckReadsNothingMore) {
  std::vector<uint8_t> bytes;
  const std::string path = WriteRandomFile(1 << 20, &bytes);
  ReadFold fold;
  FoldingEnv env(Env::Default(), &fold);
  // Out of order and overlapping, as a column split's windows are read.
  ReadThrough(&env, path, 300000, 500000);
  ReadThrough(&env, path, 0, 100000);
  ReadThrough(&env, path, 50000, 300000);  // overlaps both neighbours: only [100000, 300000) is new
  ReadThrough(&env, path, 800000, (1 << 20) - 800000);
  EXPECT_EQ(fold.runs(), 1u);
  EXPECT_EQ(fold.bytes(), uint64_t{1} << 20);
  FaultEnv failing(Env::Default());
  failing.FailReadAt(1);  // any read the check made would fail
  EXPECT_EQ(fold.Crc(&failing, path, bytes.size()), Crc32(bytes));
}

TEST(ReadFold, GapsAreReadAndCombinedInFileOrder) {
  std::vector<uint8_t> bytes;
  const std::string path = WriteRandomFile(10 << 20, &bytes);
  ReadFold fold;
  FoldingEnv env(Env::Default(), &fold);
  ReadThrough(&env, std::filesystem::path(path).parent_path().string() + "/./f", 4096, 1000);  // another spelling of the same file
  ReadThrough(&env, path, 6 << 20, 100);
  EXPECT_EQ(fold.runs(), 2u);
  EXPECT_EQ(fold.Crc(Env::Default(), path, bytes.size()), Crc32(bytes));
  // A gap read that fails is the check's error.
  FaultEnv failing(Env::Default());
  failing.FailReadAt(1);
  EXPECT_THROW(fold.Crc(&failing, path, bytes.size()), Error);
  // A byte changed in a gap, or in a recorded run, changes the CRC the check computes.
  bytes[5000] ^= 1;
  EXPECT_NE(fold.Crc(Env::Default(), path, bytes.size()), Crc32(bytes));
}

TEST(ReadFold, MergesWhatAnotherProcessRecorded) {
  std::vector<uint8_t> bytes;
  const std::string path = WriteRandomFile(1 << 20, &bytes);
  ReadFold mine, theirs;
  FoldingEnv my_env(Env::Default(), &mine), their_env(Env::Default(), &theirs);
  ReadThrough(&my_env, path, 0, 400000);
  ReadThrough(&their_env, path, 400000, (1 << 20) - 400000);
  mine.Merge(theirs.Encode());
  EXPECT_EQ(mine.runs(), 1u);
  FaultEnv failing(Env::Default());
  failing.FailReadAt(1);
  EXPECT_EQ(mine.Crc(&failing, path, bytes.size()), Crc32(bytes));
  EXPECT_THROW(mine.Merge("12 x\n"), Error);
}

TEST(ReadFold, SmallFilesReadWholeAreRecordedWhole) {
  std::vector<uint8_t> bytes;
  const std::string path = WriteRandomFile(1000, &bytes);
  ReadFold fold;
  FoldingEnv env(Env::Default(), &fold);
  auto f = env.MapFile(path);
  ASSERT_FALSE(f->mapped());
  EXPECT_EQ(fold.bytes(), 1000u);
  FaultEnv failing(Env::Default());
  failing.FailReadAt(1);
  EXPECT_EQ(fold.Crc(&failing, path, bytes.size()), Crc32(bytes));
}

}  // namespace
}  // namespace ckpt

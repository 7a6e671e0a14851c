#include "ckpt/util/env.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>
#include <fstream>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

std::string EnvTestDir() {
  auto d = std::filesystem::temp_directory_path() / ("env_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

std::string ReadAll(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(Env, AtomicWriteReplacesWholeFile) {
  const std::string dir = EnvTestDir(), path = dir + "/f.bin";
  auto* env = Env::Default();
  WriteFileAtomically(env, path, [](WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>("old"), 3}); });
  WriteFileAtomically(env, path, [](WritableFile& f) {
    std::string big(3 << 20, 'x');  // larger than the write buffer
    f.Append({reinterpret_cast<const uint8_t*>(big.data()), big.size()});
    EXPECT_EQ(f.Size(), big.size());
  });
  EXPECT_EQ(ReadAll(path), std::string(3 << 20, 'x'));
  EXPECT_FALSE(env->Exists(TempPathFor(path)));
  std::filesystem::remove_all(dir);
}

TEST(Env, AppendableFileKeepsWhatTheFileHeld) {
  const std::string dir = EnvTestDir(), path = dir + "/metrics.jsonl";
  auto* env = Env::Default();
  for (const std::string line : {"{\"step\": 1}\n", "{\"step\": 2}\n"}) {
    auto f = env->NewAppendableFile(path);
    const uint64_t before = f->Size();
    f->Append({reinterpret_cast<const uint8_t*>(line.data()), line.size()});
    EXPECT_EQ(f->Size(), before + line.size());
    f->Close();
  }
  EXPECT_EQ(ReadAll(path), "{\"step\": 1}\n{\"step\": 2}\n");
  std::filesystem::remove_all(dir);
}

TEST(Env, FailedAtomicWriteKeepsOldFileAndRemovesTemp) {
  const std::string dir = EnvTestDir(), path = dir + "/f.bin";
  auto* env = Env::Default();
  WriteFileAtomically(env, path, [](WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>("old"), 3}); });
  EXPECT_THROW(WriteFileAtomically(env, path,
                                   [](WritableFile& f) {
                                     f.Append({reinterpret_cast<const uint8_t*>("new"), 3});
                                     throw Error("injected failure");
                                   }),
               Error);
  EXPECT_EQ(ReadAll(path), "old");
  EXPECT_FALSE(env->Exists(TempPathFor(path)));
  std::filesystem::remove_all(dir);
}

TEST(Env, ErrorsNameThePath) {
  try {
    Env::Default()->MapFile("/nonexistent/x.pt");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.pt: cannot open"), std::string::npos);
  }
}

// Whether `path` is mapped into this process (/proc/self/maps names it).
bool IsMapped(const std::string& path) { return ReadAll("/proc/self/maps").find(path + "\n") != std::string::npos; }

// A small file is read whole into memory (no mapping, no TLB-flushing munmap),
// up to 16 MiB of them held at once; a larger one, or one past the cap, is mapped.
TEST(Env, SmallFilesAreReadWholeUpToTheCapLargerOnesMapped) {
  const std::string dir = EnvTestDir();
  auto* env = Env::Default();
  auto write = [&](const std::string& name, size_t n) {
    std::string bytes(n, 'a');
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>('a' + i % 26);
    WriteFileAtomically(env, dir + "/" + name, [&](WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>(bytes.data()), n}); });
    return bytes;
  };
  const std::string small = write("small.bin", 64 << 10), large = write("large.bin", (64 << 10) + 1);
  auto s = env->MapFile(dir + "/small.bin");
  auto l = env->MapFile(dir + "/large.bin");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(s->data()), s->size()), small);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(l->data()), l->size()), large);
  EXPECT_FALSE(IsMapped(dir + "/small.bin"));
  EXPECT_TRUE(IsMapped(dir + "/large.bin"));
  // 255 more 64 KiB files fill the 16 MiB cap; the next is mapped, and is read whole once one is released.
  std::vector<std::shared_ptr<const MappedFile>> held{s};
  for (int i = 1; i < 256; ++i) held.push_back(env->MapFile(dir + "/small.bin"));
  auto past = env->MapFile(dir + "/small.bin");
  EXPECT_TRUE(IsMapped(dir + "/small.bin"));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(past->data()), past->size()), small);
  past.reset();
  held.pop_back();
  auto again = env->MapFile(dir + "/small.bin");
  EXPECT_FALSE(IsMapped(dir + "/small.bin"));
  std::filesystem::remove_all(dir);
}

// One pass over a file without mapping it: every byte, in order, a buffer at a time.
TEST(Env, ReadInPiecesReadsTheFileInBufferSizedPiecesWithoutMappingIt) {
  const std::string dir = EnvTestDir(), path = dir + "/f.bin";
  auto* env = Env::Default();
  std::string bytes(10 << 10, 0);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 % 251);
  WriteFileAtomically(env, path, [&](WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}); });
  std::vector<uint8_t> buf(4096);
  std::vector<size_t> sizes;
  std::string got;
  const uint64_t n = env->ReadInPieces(path, buf, [&](std::span<const uint8_t> p) {
    sizes.push_back(p.size());
    got.append(reinterpret_cast<const char*>(p.data()), p.size());
    EXPECT_FALSE(IsMapped(path));
  });
  EXPECT_EQ(n, bytes.size());
  EXPECT_EQ(got, bytes);
  EXPECT_EQ(sizes, (std::vector<size_t>{4096, 4096, 2048}));
  try {
    env->ReadInPieces(dir, buf, [](std::span<const uint8_t>) {});
    FAIL() << "a folder was read";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), dir + ": is a directory, not a file");
  }
  std::filesystem::remove_all(dir);
}

TEST(Env, WriteToFullDiskReportsEnospc) {
  if (!std::filesystem::exists("/dev/full")) GTEST_FAIL() << "/dev/full missing";
  auto f = Env::Default()->NewWritableFile("/dev/full");
  std::string big(2 << 20, 'x');
  try {
    f->Append({reinterpret_cast<const uint8_t*>(big.data()), big.size()});
    f->Sync();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
}

TEST(Env, AnExclusiveLockTurnsAwayASecondTakerAndHoldsWhatItWrote) {
  const std::string dir = EnvTestDir(), path = dir + "/out.writer-lock";
  auto* env = Env::Default();
  auto first = env->LockFile(path, /*exclusive=*/true, /*wait=*/false);
  ASSERT_TRUE(first);
  first->SetContents("pid 1234 on somewhere");
  EXPECT_EQ(env->LockFile(path, true, false), nullptr);  // flock excludes another open file, in this process too
  EXPECT_EQ(ReadAll(path), "pid 1234 on somewhere");
  first->SetContents("pid 7");  // replaces, not appends
  EXPECT_EQ(ReadAll(path), "pid 7");
  first.reset();
  EXPECT_TRUE(env->LockFile(path, true, false));
  std::filesystem::remove_all(dir);
}

// A holder removes the file, then releases it; a taker that was waiting on
// the removed file must not count that as holding the lock, or a third
// taker, creating the file anew, would hold it at the same time.
TEST(Env, ALockOnAFileRemovedWhileWaitingIsTakenAnew) {
  const std::string dir = EnvTestDir(), path = dir + "/out.writer-lock";
  auto* env = Env::Default();
  auto first = env->LockFile(path, true, false);
  ASSERT_TRUE(first);
  std::unique_ptr<FileLock> second;
  std::thread waiter([&] { second = env->LockFile(path, true, /*wait=*/true); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the waiter has opened the file and waits in flock
  env->RemoveFile(path);
  first.reset();
  waiter.join();
  ASSERT_TRUE(second);
  EXPECT_TRUE(env->Exists(path));                         // it holds the file the path names
  EXPECT_EQ(env->LockFile(path, true, false), nullptr);   // so a third taker is turned away
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ckpt

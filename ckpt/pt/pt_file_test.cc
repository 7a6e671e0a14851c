#include "ckpt/pt/pt_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"
#include "ckpt/testing/test_util.h"
#include "ckpt/pt/zip_reader.h"
#include "ckpt/pt/zip_writer.h"

namespace ckpt {
namespace {

using namespace std::string_literals;

using testing::Arange;
using testing::TempDir;

TEST(PtFile, SaveThenLoadIsEqualAndZeroCopy) {
  TempDir dir("pt_file");
  Value root = Value::NewDict();
  Tensor w = Arange({3, 5});
  root.as_dict().Set("w", Value(w));
  root.as_dict().Set("wt", Value(Tensor(DType::kFloat32, {5, 3}, {1, 5}, 0, w.storage())));
  root.as_dict().Set("step", Value(7));
  const std::string path = dir / "model.pt";
  SavePt(path, root);
  Value back = LoadPt(path, {.verify_crc = true, .confine_to = {}});
  EXPECT_TRUE(DeepEqual(back, root));
  const Tensor& bw = back.as_dict().At("w").as_tensor();
  EXPECT_TRUE(bw.storage()->is_borrowed());
  EXPECT_EQ(bw.storage(), back.as_dict().At("wt").as_tensor().storage());
  // Saving what was loaded (mapped storages) under the same name gives identical bytes.
  Env::Default()->CreateDirs(dir / "again");
  SavePt(dir / "again/model.pt", back);
  auto a = Env::Default()->MapFile(path), b = Env::Default()->MapFile(dir / "again/model.pt");
  ASSERT_EQ(a->size(), b->size());
  EXPECT_EQ(std::memcmp(a->data(), b->data(), a->size()), 0);
}

TEST(PtFile, LargeRecordsArePageAlignedAndReadBackExactly) {
  // Big records go out through O_DIRECT (page-aligned memory and offsets)
  // with an unaligned tail written buffered; small ones stay 64-aligned.
  TempDir dir("pt_file");
  Value root = Value::NewDict();
  Tensor odd = Tensor::Empty(DType::kUInt8, {(4 << 20) + 7});
  for (int64_t i = 0; i < odd.numel(); ++i) odd.mutable_data()[i] = static_cast<uint8_t>(i * 13 + 5);
  root.as_dict().Set("odd", Value(odd));
  root.as_dict().Set("small", Value(Arange({3})));
  root.as_dict().Set("big", Value(Arange({1 << 19})));
  const std::string path = dir / "big.pt";
  SavePt(path, root);
  Value back = LoadPt(path, {.verify_crc = true, .confine_to = {}});
  EXPECT_TRUE(DeepEqual(back, root));
  ZipReader z(Env::Default()->MapFile(path));
  for (const auto& r : z.records())
    EXPECT_EQ(r.data_offset % (r.size >= (64 << 10) ? 4096 : 64), 0u) << r.name;
}

TEST(PtFile, ArchiveLayoutFollowsTorch) {
  TempDir dir("pt_file");
  Value root = Value::NewDict();
  root.as_dict().Set("a", Value(Arange({4})));
  root.as_dict().Set("b", Value(Arange({2})));
  const std::string path = dir / "megatron--step=5-consumed_samples=5120.0.ckpt";
  SavePt(path, root);
  EXPECT_EQ(ArchivePrefixFor(path), "megatron--step=5-consumed_samples=5120.0");
  ZipReader z(Env::Default()->MapFile(path));
  EXPECT_EQ(z.prefix(), "megatron--step=5-consumed_samples=5120.0");
  std::vector<std::string> names;
  for (const auto& r : z.records()) {
    names.push_back(r.name);
    EXPECT_EQ(r.data_offset % 64, 0u);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"data.pkl", "byteorder", "data/0", "data/1", "version"}));
}

std::string ZipOf(const std::vector<std::pair<std::string, std::string>>& recs) {
  testing::StringFile f;
  ZipWriter w(f, "x");
  for (const auto& [n, d] : recs) w.AddRecord(n, {reinterpret_cast<const uint8_t*>(d.data()), d.size()});
  w.Finish();
  return f.s;
}

std::string ErrorOf(const std::string& name, const std::string& bytes) {
  try {
    LoadPtFromFile(MappedFile::FromBuffer(name, bytes));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// _rebuild_tensor_v2(('storage', FloatStorage, '0', 'cpu', 4), 0, (4,), (1,), False, {})
const std::string kTensorPickle =
    "\x80\x02" "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x00"
    "0X\x03\x00\x00\x00" "cpuK\x04tQK\x00K\x04\x85K\x01\x85\x89}tR."s;

TEST(PtFile, MissingAndShortDataRecordsAreNamed) {
  EXPECT_NE(ErrorOf("m.pt"s, ZipOf({{"data.pkl"s, kTensorPickle}})).find("m.pt: missing record 'x/data/0'"s), std::string::npos);
  const std::string e = ErrorOf("s.pt"s, ZipOf({{"data.pkl"s, kTensorPickle}, {"data/0"s, "12345678"}}));
  EXPECT_NE(e.find("record 'x/data/0' holds 8 bytes but its storage needs 16"), std::string::npos) << e;
  EXPECT_TRUE(ErrorOf("ok.pt"s, ZipOf({{"data.pkl"s, kTensorPickle}, {"data/0"s, std::string(16, '\0')}})).empty());
}

TEST(PtFile, NonTorchInputsAreRejectedClearly) {
  EXPECT_EQ(ErrorOf("e.pt", ""), "e.pt: file is empty");
  EXPECT_EQ(ErrorOf("t.pt", "hello world"), "t.pt: not a PyTorch file (neither a zip archive nor a legacy pickle)");
  EXPECT_NE(ErrorOf("z.pt", ZipOf({{"other", "x"}})).find("z.pt: missing record 'x/data.pkl'"), std::string::npos);
  EXPECT_NE(ErrorOf("p.pt", "\x80\x02K\x05.").find("legacy"), std::string::npos);
}

TEST(PtFile, FailedSaveLeavesPreviousFile) {
  TempDir dir("pt_file");
  const std::string path = dir / "m.pt";
  Value good = Value::NewDict();
  good.as_dict().Set("x", Value(1));
  SavePt(path, good);
  Value bad = Value::NewDict();
  bad.as_dict().Set("lr", Value(0.5));
  EXPECT_THROW(SavePt(path, bad, {.weights_only = true}), Error);
  EXPECT_TRUE(DeepEqual(LoadPt(path), good));
  EXPECT_EQ(Env::Default()->ListDir(dir.path()), std::vector<std::string>{"m.pt"});
}

// A storage produced in chunks writes the bytes a whole one does: the CRC-32
// patched into its header, the manifest's file CRC, alignment and all.
TEST(PtFile, GeneratedStoragesWriteTheBytesOfWholeOnes) {
  TempDir dir("pt_file");
  for (size_t n : {size_t{0}, size_t{40}, size_t{70000}, size_t{3u << 20}}) {
    SCOPED_TRACE(n);
    auto whole = Storage::Allocate(n);
    for (size_t i = 0; i < n; ++i) whole->mutable_data()[i] = static_cast<uint8_t>(i * 7 + i / 251);
    size_t calls = 0;
    auto gen = Storage::Generated(n, [&](uint64_t off, std::span<uint8_t> out) {
      ++calls;
      std::memcpy(out.data(), whole->data() + off, out.size());
    });
    auto tree = [&](std::shared_ptr<Storage> st) {
      Value d = Value::NewDict();
      d.as_dict().Set("a", Value(Tensor(DType::kUInt8, {static_cast<int64_t>(n)}, {1}, 0, st)));
      d.as_dict().Set("b", Value(Tensor::Zeros(DType::kFloat32, {3})));
      return d;
    };
    testing::StringFile a, b;
    const uint32_t crc_a = WritePt(a, "x", tree(whole));
    const uint32_t crc_b = WritePt(b, "x", tree(gen), {.stream_chunk = 4096});
    EXPECT_EQ(a.s, b.s);
    EXPECT_EQ(crc_a, crc_b);
    EXPECT_EQ(crc_b, Crc32({reinterpret_cast<const uint8_t*>(b.s.data()), b.s.size()}));
    EXPECT_EQ(calls, (n + 4095) / 4096);
    // Through the POSIX Env: the header is patched whether still buffered or already on disk.
    SavePt(dir / "g.pt", tree(gen), {.stream_chunk = 8192});
    const auto f = Env::Default()->MapFile(dir / "g.pt");
    testing::StringFile g;
    WritePt(g, "g", tree(whole));
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(f->data()), f->size()), g.s);
    EXPECT_TRUE(DeepEqual(LoadPt(dir / "g.pt", {.verify_crc = true, .confine_to = {}}), tree(whole)));
  }
}

// Files written with one StoragePool stream through the same chunk: the
// first file allocates it, the rest reuse it (already faulted in), and it
// goes back to the pool after each file. The bytes are those of a fresh chunk.
TEST(PtFile, GeneratedStoragesReuseThePoolsChunk) {
  auto pool = StoragePool::Create();
  std::set<const uint8_t*> chunks;
  auto gen = [&](size_t n, int seed) {
    Value d = Value::NewDict();
    auto st = Storage::Generated(n, [&chunks, seed](uint64_t off, std::span<uint8_t> out) {
      if (off == 0) chunks.insert(out.data());  // the chunk's first half
      for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(off + i + seed);
    });
    d.as_dict().Set("t", Value(Tensor(DType::kUInt8, {static_cast<int64_t>(n)}, {1}, 0, st)));
    return d;
  };
  for (int file = 0; file < 3; ++file) {
    testing::StringFile pooled, fresh;
    WritePt(pooled, "x", gen(20000, file), {.stream_chunk = 8192, .stream_buffers = pool});
    WritePt(fresh, "x", gen(20000, file), {.stream_chunk = 8192});
    EXPECT_EQ(pooled.s, fresh.s);
    EXPECT_EQ(pool->free_bytes(), size_t{8192});  // returned, not freed
  }
  chunks.clear();
  for (int file = 0; file < 3; ++file) {
    testing::StringFile out;
    WritePt(out, "x", gen(20000, file), {.stream_chunk = 8192, .stream_buffers = pool});
  }
  EXPECT_EQ(chunks.size(), size_t{1});
}

}  // namespace
}  // namespace ckpt

#include <gtest/gtest.h>

#include <string>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"
#include "ckpt/pt/zip_reader.h"
#include "ckpt/testing/test_util.h"
#include "ckpt/pt/zip_writer.h"

namespace ckpt {
namespace {

using testing::StringFile;

std::span<const uint8_t> B(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

std::string Archive(const std::vector<std::pair<std::string, std::string>>& records, const std::string& prefix = "arc") {
  StringFile f;
  ZipWriter w(f, prefix);
  for (const auto& [n, d] : records) w.AddRecord(n, B(d));
  w.Finish();
  return f.s;
}

// Independent table-driven CRC-32 (reflected 0xedb88320), the reference.
uint32_t ReferenceCrc(const std::string& s) {
  static uint32_t table[256];
  static bool init = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
      table[i] = c;
    }
    return true;
  }();
  (void)init;
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) c = table[(c ^ b) & 0xff] ^ (c >> 8);
  return ~c;
}

TEST(Crc32, MatchesReferenceAcrossParallelChunks) {
  EXPECT_EQ(Crc32(B("123456789")), 0xcbf43926u);  // the CRC-32 check value
  std::string big((130u << 20) + 7, '\0');       // crosses the 64 MiB parallel chunk size twice
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 2654435761u >> 13);
  EXPECT_EQ(Crc32(B(big)), ReferenceCrc(big));
  EXPECT_EQ(Crc32(B(big.substr(0, 1000))), ReferenceCrc(big.substr(0, 1000)));
}

TEST(Zip, RoundTripWithAlignedStoredRecords) {
  const std::string data1(1000, 'a'), data2 = "hello";
  auto file = MappedFile::FromBuffer("t.zip", Archive({{"data.pkl", data2}, {"data/0", data1}, {"data/1", ""}}));
  ZipReader z(file);
  EXPECT_EQ(z.prefix(), "arc");
  ASSERT_EQ(z.records().size(), 3u);
  for (const auto& r : z.records()) {
    EXPECT_TRUE(r.stored);
    EXPECT_EQ(r.data_offset % ZipWriter::kAlignment, 0u) << r.name;
    EXPECT_NO_THROW(z.VerifyCrc(r));
  }
  auto s = z.Read(z.Get("data/0"));
  EXPECT_TRUE(s->is_borrowed());  // zero copy
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(s->data()), s->nbytes()), data1);
  EXPECT_EQ(z.Find("nope"), nullptr);
}

TEST(Zip, PrefixComesFromFirstEntry) {
  auto file = MappedFile::FromBuffer("t.zip", Archive({{"data.pkl", "x"}}, "some-other.name"));
  EXPECT_EQ(ZipReader(file).prefix(), "some-other.name");
}

TEST(Zip, MissingRecordNamesFileAndRecord) {
  auto file = MappedFile::FromBuffer("ckpt.pt", Archive({{"data.pkl", "x"}}));
  ZipReader z(file);
  try {
    z.Get("data/7");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "ckpt.pt: missing record 'arc/data/7'");
  }
}

TEST(Zip, TruncationIsReportedAtEveryLength) {
  const std::string full = Archive({{"data.pkl", std::string(300, 'p')}, {"data/0", std::string(5000, 'd')}});
  for (size_t len = 0; len < full.size(); len += 97) {
    auto file = MappedFile::FromBuffer("trunc.pt", full.substr(0, len));
    try {
      ZipReader z(file);
      for (const auto& r : z.records()) z.VerifyCrc(r);
      FAIL() << "truncated to " << len << " bytes was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("trunc.pt: ", 0), 0u) << e.what();
    }
  }
}

TEST(Zip, CorruptCentralDirectoryIsReported) {
  std::string z = Archive({{"data.pkl", "abc"}});
  const size_t cd = z.find("PK\x01\x02");
  ASSERT_NE(cd, std::string::npos);
  z[cd + 1] = 'X';
  EXPECT_THROW(ZipReader(MappedFile::FromBuffer("bad.pt", z)), Error);
}

TEST(Zip, FlippedDataByteFailsCrc) {
  std::string z = Archive({{"data/0", std::string(256, 'q')}});
  auto pos = z.find(std::string(256, 'q'));
  z[pos + 10] = 'r';
  ZipReader r(MappedFile::FromBuffer("flip.pt", z));
  try {
    r.VerifyCrc(r.Get("data/0"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("flip.pt: record 'data/0' fails its CRC-32 check"), std::string::npos);
  }
}

TEST(Zip, FileCrcCombinesRecordCrcsIntoTheWholeFileCrc) {
  StringFile f;
  ZipWriter w(f, "arc");
  w.AddRecord("a", B(std::string(100000, 'x')));
  w.AddRecord("b", B("tail"));
  w.Finish();
  EXPECT_EQ(w.file_crc(), ReferenceCrc(f.s));
  EXPECT_EQ(Crc32Combine(Crc32(B("1234")), Crc32(B("56789")), 5), Crc32(B("123456789")));
}

TEST(Zip, DeterministicBytes) {
  EXPECT_EQ(Archive({{"a", "1"}, {"b", "22"}}), Archive({{"a", "1"}, {"b", "22"}}));
}

}  // namespace
}  // namespace ckpt

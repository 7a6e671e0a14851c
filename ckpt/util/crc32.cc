#include "ckpt/util/crc32.h"

#include <libdeflate.h>
#include <zlib.h>
#include <tbb/parallel_for.h>

#include <vector>

#include "ckpt/util/env.h"

namespace ckpt {
uint32_t Crc32Combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  // zlib's (since 1.2.12: x^(8·len2) mod P from a table of squares, a few
  // hundred operations), which fingerprints call once per piece.
  return static_cast<uint32_t>(::crc32_combine(crc1, crc2, static_cast<z_off_t>(len2)));
}

namespace {
constexpr size_t kChunk = size_t{64} << 20;
}  // namespace

uint32_t Crc32(std::span<const uint8_t> data) {
  if (data.size() <= kChunk) return libdeflate_crc32(0, data.data(), data.size());
  const size_t chunks = (data.size() + kChunk - 1) / kChunk;
  std::vector<uint32_t> crcs(chunks);
  tbb::parallel_for(size_t{0}, chunks, [&](size_t i) {
    const size_t begin = i * kChunk, len = std::min(kChunk, data.size() - begin);
    crcs[i] = libdeflate_crc32(0, data.data() + begin, len);
  });
  uint32_t crc = crcs[0];
  for (size_t i = 1; i < chunks; ++i)
    crc = Crc32Combine(crc, crcs[i], std::min(kChunk, data.size() - i * kChunk));
  return crc;
}

uint32_t Crc32Mapped(const MappedFile& file, std::span<const uint8_t> range) {
  constexpr size_t kWindow = kCrcWindow;
  uint32_t crc = 0;
  for (size_t at = 0; at < range.size(); at += kWindow) {
    const auto piece = range.subspan(at, std::min(kWindow, range.size() - at));
    if (at + kWindow < range.size()) file.Prefetch(piece.data() + piece.size(), std::min(kWindow, range.size() - at - kWindow));
    crc = Crc32Combine(crc, Crc32(piece), piece.size());
    file.DropPages(piece.data(), piece.size());
  }
  return crc;
}

}  // namespace ckpt

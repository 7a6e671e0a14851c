#include "ckpt/crc32.h"

#include <libdeflate.h>
#include <tbb/parallel_for.h>

#include <vector>

namespace ckpt {
namespace {

// GF(2) helpers for crc32_combine (the zlib construction): advance a CRC over
// `len2` zero bytes by squaring the shift operator.
uint32_t Gf2Times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  for (int i = 0; vec; vec >>= 1, ++i)
    if (vec & 1) sum ^= mat[i];
  return sum;
}

void Gf2Square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = Gf2Times(mat, mat[n]);
}

}  // namespace

uint32_t Crc32Combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  if (len2 == 0) return crc1;
  uint32_t even[32], odd[32];
  odd[0] = 0xedb88320u;
  for (int n = 1, row = 1; n < 32; ++n, row <<= 1) odd[n] = static_cast<uint32_t>(row);
  Gf2Square(even, odd);
  Gf2Square(odd, even);
  do {
    Gf2Square(even, odd);
    if (len2 & 1) crc1 = Gf2Times(even, crc1);
    len2 >>= 1;
    if (!len2) break;
    Gf2Square(odd, even);
    if (len2 & 1) crc1 = Gf2Times(odd, crc1);
    len2 >>= 1;
  } while (len2);
  return crc1 ^ crc2;
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

}  // namespace ckpt

// CRC-32 (the zip polynomial) via libdeflate's hardware-accelerated routine,
// split across TBB workers for large buffers and merged with zlib's CRC
// combination.
#pragma once

#include <cstdint>
#include <span>

namespace ckpt {

uint32_t Crc32(std::span<const uint8_t> data);
// The CRC-32 of A followed by B, from crc(A), crc(B) and len(B).
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

class MappedFile;
// Crc32Mapped's window.
inline constexpr uint64_t kCrcWindow = uint64_t{4} << 20;
// The CRC-32 of `range`, a part of mapped `file`, summed a window at a time:
// each window is read ahead and released once summed, so checking a file
// costs its page cache, and this process at most a window (kCrcWindow, plus
// the large folios at its ends: MappedFile::DropPages) per calling thread.
uint32_t Crc32Mapped(const MappedFile& file, std::span<const uint8_t> range);

}  // namespace ckpt

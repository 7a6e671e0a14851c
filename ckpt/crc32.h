// CRC-32 (the zip polynomial) via libdeflate's hardware-accelerated routine,
// split across TBB workers for large buffers and merged with the standard
// CRC combination.
#pragma once

#include <cstdint>
#include <span>

namespace ckpt {

uint32_t Crc32(std::span<const uint8_t> data);

}  // namespace ckpt

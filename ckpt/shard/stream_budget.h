// How a streaming job shares --memory_budget out among its threads: the one
// rule ckpt-reshard (ckpt/shard/reshard.cc, for ckpt-import and nnm2nxdt-ckpt
// too) and ckpt-export --format hf (tools/hf_export.h) size their chunks by.
//
// Each stream (a thread producing or writing chunks) holds one chunk of
// output and the source pages it was copied from (at most a chunk's worth,
// ckpt::Touched releasing them after every chunk, plus up to a large folio
// mapped past each end of what it read: the slack). So `streams` streams
// hold at most streams * (2 * chunk + slack) beside what the process held
// before (`base`), and the chunk is the largest that keeps that within the
// budget, between 256 KiB and 64 MiB, a whole number of pages.
#pragma once

#include <cstdint>

namespace ckpt {

inline constexpr uint64_t kMinStreamChunk = uint64_t{256} << 10;
inline constexpr uint64_t kMaxStreamChunk = uint64_t{64} << 20;
inline constexpr uint64_t kStreamSlack = uint64_t{4} << 20;

// The chunk size for `streams` (>= 1) streams within `budget` when the
// process already holds `base` bytes. Throws ckpt::Error "--memory_budget B
// is smaller than one slice: ..." (naming what is held, the streams and the
// least budget that works) when a stream's minimum does not fit.
uint64_t StreamChunk(uint64_t budget, uint64_t base, int streams);

}  // namespace ckpt

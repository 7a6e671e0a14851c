#include "ckpt/shard/stream_budget.h"

#include <algorithm>
#include <string>

#include "ckpt/util/error.h"
#include "ckpt/util/progress.h"

namespace ckpt {

uint64_t StreamChunk(uint64_t budget, uint64_t base, int streams) {
  const uint64_t n = static_cast<uint64_t>(std::max(streams, 1)), min_stream = 2 * kMinStreamChunk + kStreamSlack;
  const uint64_t usable = budget > base ? budget - base : 0;
  if (usable < n * min_stream)
    throw Error("--memory_budget " + HumanBytes(budget) + " is smaller than one slice: the process already holds " + HumanBytes(base) +
                " (the source's index and read caches) and each of " + std::to_string(n) + " writing thread(s) needs " +
                HumanBytes(min_stream) + " at least; give at least " + HumanBytes(base + n * min_stream));
  return std::clamp<uint64_t>((usable / n - kStreamSlack) / 2 / 4096 * 4096, kMinStreamChunk, kMaxStreamChunk);
}

}  // namespace ckpt

// --threads as the writing commands take it: the number of files written at
// once, on any machine. TBB's implicit arena has one slot per core, so before
// this --threads 16 on 2 cores wrote 2 files at once while the memory budget
// was split 16 ways (ckpt/shard/reshard.cc): the chunks in flight are what
// --threads says, so the budget's arithmetic holds on every machine.
#pragma once

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <cstddef>
#include <utility>

namespace tools {

// Runs `work` (and every TBB loop inside it) on `threads` threads, the caller's included.
template <class Work>
auto WithThreads(int threads, Work&& work) {
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(threads));
  tbb::task_arena arena(threads);
  return arena.execute(std::forward<Work>(work));
}

}  // namespace tools

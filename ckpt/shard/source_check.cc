#include "ckpt/shard/source_check.h"

#include <tbb/task_arena.h>

#include "ckpt/store/tag_verify.h"
#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"

namespace ckpt {

void VerifySourceTag(Env* env, const std::string& tag, bool weights_only, const LogFn& log, const ReadFold* fold) {
  // Read for its weights alone, an MoE tag's model files are the reader's to take or refuse.
  VerifyOptions opts{.checksums = true, .moe_left_to_reader = weights_only};
  if (fold) opts.file_crc = [&](const std::string& path, uint64_t size) { return fold->Crc(env, path, size); };
  TagReport rep = VerifyTag(env, tag, opts);
  if (weights_only) DropOptimizerProblems(rep, [&](const TagProblem& p) { log("note: " + p.file + ": " + p.what + " (not read: --weights_only)"); });
  std::string what;
  for (const auto& p : rep.problems) what += "\n  " + (p.file.empty() ? "" : p.file + ": ") + p.what;
  if (!what.empty()) throw Error(tag + ": fails verification, so it is not read (--no_verify skips this):" + what);
}

SourceCheck::SourceCheck(Env* env, std::string tag, bool enabled, bool weights_only)
    : env_(env), tag_(std::move(tag)), enabled_(enabled), weights_only_(weights_only) {}

SourceCheck::SourceCheck(Env* env, std::string tag, bool enabled, bool weights_only, ReadFold* fold, WriterGroup* group)
    : env_(env), tag_(std::move(tag)), enabled_(enabled), weights_only_(weights_only), fold_(fold), group_(group) {}

void SourceCheck::RunFolded() {
  if (!enabled_ || started_) return;
  started_ = true;
  try {
    // In an arena of kThreads, as beside the copy: memory() counts a 4 MiB gap window per thread.
    tbb::task_arena arena(kThreads);
    arena.execute([&] { VerifySourceTag(env_, tag_, weights_only_, [this](const std::string& s) { notes_.push_back(s); }, fold_); });
  } catch (...) {
    error_ = std::current_exception();
  }
}

uint64_t SourceCheck::memory() const {
  // DigestFile's buffer, and 4 MiB more: what a mapped window's end folios took before the pass
  // read with pread (Env::ReadInPieces), kept as a reserve.
  return enabled_ ? kThreads * (kCrcWindow + (uint64_t{4} << 20)) : 0;
}

void SourceCheck::Start() {
  if (!enabled_ || started_ || fold_) return;
  started_ = true;
  thread_ = std::thread([this] {
    try {
      tbb::task_arena arena(kThreads);
      // Notes are kept for Wait: a line written from here would cut into the caller's.
      arena.execute([&] { VerifySourceTag(env_, tag_, weights_only_, [this](const std::string& s) { notes_.push_back(s); }); });
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

SourceCheck::~SourceCheck() {
  if (thread_.joinable()) thread_.join();
}

void SourceCheck::Wait(const LogFn& log) {
  if (fold_ && !gathered_ && group_ && group_->size() > 1) {
    gathered_ = true;
    const std::vector<std::string> records = group_->Gather(fold_->Encode());
    for (size_t r = 1; r < records.size(); ++r) fold_->Merge(records[r]);
  }
  if (fold_) RunFolded();
  Start();
  if (thread_.joinable()) thread_.join();
  if (!waited_)
    for (const auto& n : notes_) log(n);
  waited_ = true;
  if (error_) std::rethrow_exception(error_);
}

void SourceCheck::ThrowIfFailed(const LogFn& log) {
  gathered_ = true;  // an error path: peers may never call Wait
  if (fold_) RunFolded();
  Start();
  if (thread_.joinable()) thread_.join();
  if (error_) Wait(log);
}

}  // namespace ckpt

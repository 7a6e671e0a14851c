#include "ckpt/shard/source_check.h"

#include "ckpt/store/tag_verify.h"
#include "ckpt/util/error.h"

namespace ckpt {

void VerifySourceTag(Env* env, const std::string& tag, bool weights_only, const LogFn& log) {
  TagReport rep = VerifyTag(env, tag, {.checksums = true});
  if (weights_only) DropOptimizerProblems(rep, [&](const TagProblem& p) { log("note: " + p.file + ": " + p.what + " (not read: --weights_only)"); });
  std::string what;
  for (const auto& p : rep.problems) what += "\n  " + (p.file.empty() ? "" : p.file + ": ") + p.what;
  if (!what.empty()) throw Error(tag + ": fails verification, so it is not read (--no_verify skips this):" + what);
}

SourceCheck::SourceCheck(Env* env, std::string tag, bool enabled, bool weights_only) {
  if (!enabled) return;
  thread_ = std::thread([this, env, tag = std::move(tag), weights_only] {
    try {
      // Notes are kept for Wait: a line written from here would cut into the caller's.
      VerifySourceTag(env, tag, weights_only, [this](const std::string& s) { notes_.push_back(s); });
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

SourceCheck::~SourceCheck() {
  if (thread_.joinable()) thread_.join();
}

void SourceCheck::Wait(const LogFn& log) {
  if (thread_.joinable()) thread_.join();
  if (!waited_)
    for (const auto& n : notes_) log(n);
  waited_ = true;
  if (error_) std::rethrow_exception(error_);
}

void SourceCheck::ThrowIfFailed(const LogFn& log) {
  if (thread_.joinable()) thread_.join();
  if (error_) Wait(log);
}

}  // namespace ckpt

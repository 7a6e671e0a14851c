// Choosing where a restarted job resumes, with NxDT exp_manager semantics but
// without its weaknesses: only tags with `done` (or listed in NxD 2.16's
// `newest` file) are candidates; they are ordered by the step in their name,
// mtime only as a tie-break; each is checked against its manifest (sizes
// always, checksums when asked) and a failing one is skipped, with the reason
// logged, in favour of the next.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "ckpt/env.h"

namespace ckpt {

using LogFn = std::function<void(const std::string&)>;

// The newest tag under `checkpoint_dir` that verifies, or nullopt.
std::optional<std::string> FindLatestCheckpoint(Env* env, const std::string& checkpoint_dir, bool verify_checksums,
                                                const LogFn& log);

struct ResumeOptions {
  bool resume_if_exists = false;
  // With resume_if_exists and nothing to resume: start fresh with a warning.
  bool resume_ignore_no_checkpoint = false;
  // An explicit tag path (or a tag name inside checkpoint_dir); always wins.
  std::string resume_from_checkpoint = "";
  bool verify_checksums = false;
};

// The tag to resume from, or nullopt to start fresh. Throws ckpt::Error when
// resume_if_exists finds nothing and resume_ignore_no_checkpoint is off, or
// when an explicit resume_from_checkpoint is missing or incomplete.
std::optional<std::string> ResolveResume(Env* env, const std::string& checkpoint_dir, const ResumeOptions& opts,
                                         const LogFn& log);

}  // namespace ckpt

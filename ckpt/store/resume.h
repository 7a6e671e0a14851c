// Choosing where a restarted job resumes, with NxDT exp_manager semantics but
// without its weaknesses: only tags with `done` (or listed in NxD 2.16's
// `newest` file) are candidates; they are ordered by the step their content
// records (ReadTrainingPosition; the name's only where the content records
// none), then the name's step and mtime; each is checked against its
// manifest (sizes always, every byte's CRC-32 when asked, as the trainer
// asks) and for where training stands (a step, sample count or LR that is
// negative, non-finite, fractional or absurd makes it damaged), and a
// failing one is skipped, with the reason logged, in favour of the next. Tags that
// fail are reported, so the caller keeps them as evidence; when complete
// tags exist and every one fails, resuming stops (DamagedCheckpoints) unless
// starting over them was asked for explicitly.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/util/error.h"

#include "ckpt/util/env.h"
#include "ckpt/store/manifest.h"
#include "ckpt/store/tag_verify.h"

namespace ckpt {

using LogFn = std::function<void(const std::string&)>;

struct DamagedTag {
  std::string path;
  std::string problem;
};

// Every complete tag failed verification and starting over them was not asked for.
class DamagedCheckpoints : public Error {
 public:
  using Error::Error;
};

// The newest tag under `checkpoint_dir` that verifies, or nullopt. Complete
// tags that fail verification on the way are appended to `damaged`.
// Reads the contents of a candidate tag's files on the caller's behalf: a job
// whose ranks each check the files they load (the trainer). Called for a tag
// with a readable manifest `m`, once the files' presence and sizes were
// checked (VerifyTag without checksums); returns what VerifyListedContent
// finds over every file `m` lists, or nullopt to have every byte checked here
// instead (VerifyTag with checksums). Either way the tag's report is the same.
using ContentCheck = std::function<std::optional<std::vector<TagProblem>>(const std::string& tag, const Manifest& m)>;

std::optional<std::string> FindLatestCheckpoint(Env* env, const std::string& checkpoint_dir, bool verify_checksums,
                                                const LogFn& log, std::vector<DamagedTag>* damaged = nullptr, bool weights_only = false,
                                                const ContentCheck& content_check = nullptr);

struct ResumeOptions {
  bool resume_if_exists = false;
  // With resume_if_exists and nothing to resume: start fresh with a warning.
  bool resume_ignore_no_checkpoint = false;
  // An explicit tag path (or a tag name inside checkpoint_dir); always wins.
  std::string resume_from_checkpoint = "";
  bool verify_checksums = false;
  // With resume_if_exists, when complete tags exist but none verifies: start
  // from scratch (the damaged tags stay) instead of stopping.
  bool start_over_damaged = false;
  // Only the model is read (NxDT's model.weight_init_only): problems of
  // optim/ files do not make a tag damaged.
  bool weights_only = false;
  // With verify_checksums: who reads the files' contents (ContentCheck); unset, this process.
  ContentCheck content_check = nullptr;
};

// The tag to resume from, or nullopt to start fresh. Throws ckpt::Error when
// resume_if_exists finds nothing and resume_ignore_no_checkpoint is off, or
// when an explicit resume_from_checkpoint is missing, incomplete or damaged;
// DamagedCheckpoints (naming each tag and its problem) when complete tags
// exist and all fail verification, unless start_over_damaged. Damaged tags
// found are appended to `damaged`.
std::optional<std::string> ResolveResume(Env* env, const std::string& checkpoint_dir, const ResumeOptions& opts,
                                         const LogFn& log, std::vector<DamagedTag>* damaged = nullptr);

// What a job does with the tag it resumes from, when the tag may be cut for
// another parallel layout than the job's (the trainer's
// exp_manager.resume_reshard, shardkit's own key):
//  - kAsIs: the tag fits; load it;
//  - kReuse: it does not, but `reshard_dst` holds a complete copy resharded
//    for this job by an earlier start; load that;
//  - kReshard: it does not; reshard it into `reshard_dst` (which does not
//    exist), then load that.
// Throws ckpt::Error (the tag, why it does not fit, and `advice`) when it
// does not fit and resharding was not asked for, and when `reshard_dst`
// holds anything but such a copy (which is not ours to replace).
// `mismatch(dir)`: why the tag in `dir` does not fit the job ("" when it does).
struct ResumePlan {
  enum class Kind { kAsIs, kReuse, kReshard } kind = Kind::kAsIs;
  std::string load;  // the tag to load: `tag` or `reshard_dst`
  std::string note;  // what was decided, for the log ("" for kAsIs)
};
ResumePlan PlanResume(Env* env, const std::string& tag, bool resume_reshard, const std::string& reshard_dst,
                      const std::function<std::string(const std::string&)>& mismatch, const std::string& advice);

}  // namespace ckpt

#include "ckpt/store/resume.h"

#include <algorithm>

#include "ckpt/store/tag_verify.h"
#include "ckpt/store/training_state.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

std::string Describe(const TagReport& r) {
  std::string s;
  for (size_t i = 0; i < r.problems.size() && i < 3; ++i)
    s += (i ? "; " : "") + (r.problems[i].file.empty() ? "" : r.problems[i].file + ": ") + r.problems[i].what;
  if (r.problems.size() > 3) s += "; and " + std::to_string(r.problems.size() - 3) + " more";
  return s;
}

// The optimizer files are not read: their problems are told, not counted.
void DropOptimizerProblems(TagReport& r, const std::string& tag, const LogFn& log) {
  DropOptimizerProblems(r, [&](const TagProblem& p) {
    if (log) log("resume: " + tag + ": " + p.file + ": " + p.what + " (not read: weights only)");
  });
}

// Why what `tag` records of where training stands cannot be resumed from ("" when it can).
std::string PositionProblem(Env* env, const std::string& tag) {
  try {
    ReadTrainingPosition(env, tag);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// The step a candidate is ordered by: the one its content records, else (weights only, or content
// that does not read, which verification then reports) the one its name gives.
int64_t OrderingStep(Env* env, const TagEntry& t) {
  try {
    if (const TrainingPosition at = ReadTrainingPosition(env, t.path); at.step_recorded) return at.step;
  } catch (const Error&) {
  }
  if (t.parsed) return t.parsed->step;
  return ParseNxdStepTagName(t.dir_name).value_or(-1);
}

// VerifyTag of a candidate, with its contents read by `content_check` when it
// takes them (a tag with a readable manifest), else here.
TagReport CheckCandidate(Env* env, const std::string& tag, bool verify_checksums, const ContentCheck& content_check) {
  if (!verify_checksums || !content_check || !env->Exists(tag + "/" + kManifestFile)) return VerifyTag(env, tag, {.checksums = verify_checksums});
  TagReport r = VerifyTag(env, tag, {.checksums = false});
  if (!r.has_manifest) return VerifyTag(env, tag, {.checksums = true});
  Manifest m;
  try {
    m = Manifest::Load(env, tag + "/" + kManifestFile);
  } catch (const Error&) {
    return r;  // VerifyTag stops at a manifest that does not load, checksums or not
  }
  std::optional<std::vector<TagProblem>> found = content_check(tag, m);
  if (!found) return VerifyTag(env, tag, {.checksums = true});
  r.problems.insert(r.problems.end(), found->begin(), found->end());
  std::sort(r.problems.begin(), r.problems.end(), [](const TagProblem& a, const TagProblem& b) {
    return std::tie(a.file, a.what) < std::tie(b.file, b.what);
  });
  return r;
}

}  // namespace

std::optional<std::string> FindLatestCheckpoint(Env* env, const std::string& checkpoint_dir, bool verify_checksums,
                                                const LogFn& log, std::vector<DamagedTag>* damaged, bool weights_only,
                                                const ContentCheck& content_check) {
  if (!env->IsDirectory(checkpoint_dir)) return std::nullopt;
  // Complete tags, newest first by the step each records, not the one its name gives: a name is a
  // label (a rename or copy changes it) and one naming a step past every real one would otherwise
  // be resumed from on every restart, its true step each time, so the run would never advance.
  // A name that disagrees with its content is a warning when the tag is read (ReadTrainingPosition).
  // Ties keep ListTags' order (name, then mtime).
  std::vector<std::pair<int64_t, TagEntry>> candidates;
  for (TagEntry& t : ListTags(env, checkpoint_dir)) {
    if (!t.has_done && !t.listed_in_newest) {
      if (log) log("resume: skipping " + t.dir_name + ": no done marker (incomplete save)");
      continue;
    }
    const int64_t step = OrderingStep(env, t);
    candidates.emplace_back(step, std::move(t));
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [step, t] : candidates) {
    TagReport r = CheckCandidate(env, t.path, verify_checksums, content_check);
    if (!r.has_done && t.listed_in_newest)  // NxD 2.16 marked completion with `newest`, not `done`
      std::erase_if(r.problems, [](const TagProblem& p) { return p.file == "done"; });
    if (weights_only) DropOptimizerProblems(r, t.dir_name, log);
    if (r.ok())  // what it records of the step, samples and schedule must be resumable too
      if (std::string why = PositionProblem(env, t.path); !why.empty()) r.problems.push_back({"", std::move(why)});
    if (!r.ok()) {
      if (log) log("resume: skipping " + t.dir_name + ": " + Describe(r) + " (kept as evidence)");
      if (damaged) damaged->push_back({t.path, Describe(r)});
      continue;
    }
    if (r.checked_without_manifest && log)
      log("resume: " + t.dir_name + " has no manifest.json; checked without one (every zip record's CRC-32, every pickle "
          "and tensor: " + std::to_string(r.files_checked) + " files), so damage a manifest would catch inside a record's "
          "bounds cannot be ruled out");
    return t.path;
  }
  return std::nullopt;
}

std::optional<std::string> ResolveResume(Env* env, const std::string& checkpoint_dir, const ResumeOptions& opts,
                                         const LogFn& log, std::vector<DamagedTag>* damaged) {
  if (!opts.resume_from_checkpoint.empty()) {
    std::string path = opts.resume_from_checkpoint;
    if (!env->IsDirectory(path) && env->IsDirectory(checkpoint_dir + "/" + path)) path = checkpoint_dir + "/" + path;
    if (!env->IsDirectory(path)) throw Error("resume_from_checkpoint: " + opts.resume_from_checkpoint + ": no such checkpoint");
    TagReport r = CheckCandidate(env, path, opts.verify_checksums, opts.content_check);
    if (opts.weights_only) DropOptimizerProblems(r, path, log);
    if (r.ok())
      if (std::string why = PositionProblem(env, path); !why.empty()) r.problems.push_back({"", std::move(why)});
    if (!r.ok()) throw Error("resume_from_checkpoint: " + path + " is not a complete, intact checkpoint: " + Describe(r));
    return path;
  }
  if (!opts.resume_if_exists) return std::nullopt;
  std::vector<DamagedTag> found;
  auto latest = FindLatestCheckpoint(env, checkpoint_dir, opts.verify_checksums, log, &found, opts.weights_only, opts.content_check);
  if (damaged) damaged->insert(damaged->end(), found.begin(), found.end());
  if (latest) {
    if (log) log("resume: from " + *latest);
    return latest;
  }
  if (!found.empty()) {
    std::string list;
    for (const auto& d : found) list += "\n  " + d.path + ": " + d.problem;
    if (!opts.start_over_damaged)
      throw DamagedCheckpoints("resume: every complete checkpoint in " + checkpoint_dir + " is damaged:" + list +
                               "\nnothing was changed; to start from scratch beside them, set "
                               "exp_manager.resume_past_damaged_checkpoints: True");
    if (log) log("resume: warning: every complete checkpoint is damaged (kept):" + list + "\nstarting from scratch as asked");
    return std::nullopt;
  }
  if (opts.resume_ignore_no_checkpoint) {
    if (log) log("resume: warning: no complete checkpoint in " + checkpoint_dir + "; starting from scratch");
    return std::nullopt;
  }
  throw Error("resume_if_exists: no complete checkpoint in " + checkpoint_dir +
              " (set resume_ignore_no_checkpoint to start from scratch)");
}

ResumePlan PlanResume(Env* env, const std::string& tag, bool resume_reshard, const std::string& reshard_dst,
                      const std::function<std::string(const std::string&)>& mismatch, const std::string& advice) {
  const std::string why = mismatch(tag);
  if (why.empty()) return {ResumePlan::Kind::kAsIs, tag, ""};
  if (!resume_reshard) throw Error(tag + ": " + why + ". " + advice);
  if (!env->Exists(reshard_dst)) return {ResumePlan::Kind::kReshard, reshard_dst, tag + ": " + why + "; resharding it into " + reshard_dst};
  // Resharded by an earlier start; anything else there is not ours to replace.
  if (env->Exists(reshard_dst + "/" + kDoneMarker) && mismatch(reshard_dst).empty())
    return {ResumePlan::Kind::kReuse, reshard_dst, tag + ": " + why + "; resuming from " + reshard_dst + ", resharded for it by an earlier start"};
  throw Error(tag + ": " + why + ", and " + reshard_dst + ", where resume_reshard would write this run's copy, already holds something "
              "else; move it away");
}

}  // namespace ckpt

#include "ckpt/store/job_agreement.h"

#include <map>

#include <nlohmann/json.hpp>

#include "ckpt/util/input_guard.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

struct TreeSize {
  int64_t files = 0, entries = 0, links_out = 0;
  uint64_t bytes = 0;
  bool cut = false;  // a bound was reached: the counts are partial
};

void AddTree(Env* env, const std::string& root, const std::string& dir, int depth, TreeSize* size) {
  for (const std::string& name : env->ListDir(dir)) {
    if (++size->entries > kMaxInputEntries) {
      size->cut = true;
      return;
    }
    const std::string path = dir + "/" + name;
    if (!env->IsDirectory(path)) {
      ++size->files, size->bytes += env->FileSize(path);
    } else if (!ResolvesInside(root, path)) {  // listed by nobody: nothing outside the named folder is opened
      ++size->links_out;
    } else if (depth + 1 >= kMaxInputDepth) {
      size->cut = true;
    } else {
      AddTree(env, root, path, depth + 1, size);
      if (size->entries > kMaxInputEntries) return;
    }
  }
}

std::string Quoted(const std::string* value) { return value ? "'" + *value + "'" : "(not given)"; }

}  // namespace

std::string DescribeInput(Env* env, const std::string& path) {
  const std::string resolved = ResolvedPath(path);
  TreeSize size;
  try {
    if (!env->Exists(path)) return resolved + " (absent)";
    if (!env->IsDirectory(path)) return resolved + " (1 file, " + std::to_string(env->FileSize(path)) + " bytes)";
    AddTree(env, path, path, 0, &size);
  } catch (const Error& e) {  // unreadable here: that differs from a rank that can read it
    return resolved + " (unreadable: " + e.what() + ")";
  }
  return resolved + " (" + std::to_string(size.files) + (size.files == 1 ? " file, " : " files, ") + std::to_string(size.bytes) + " bytes" +
         (size.links_out ? ", " + std::to_string(size.links_out) + " folder link(s) out of it not followed" : "") +
         (size.cut ? ", counted to " + std::to_string(kMaxInputDepth) + " folders deep and " + std::to_string(kMaxInputEntries) + " entries" : "") + ")";
}

std::string DescribeOutput(const std::string& path) { return ResolvedPath(path); }

std::string JobDifference(const JobFields& rank0, const JobFields& mine, int rank) {
  std::map<std::string, const std::string*> theirs, ours;
  for (const auto& [name, value] : rank0) theirs[name] = &value;
  for (const auto& [name, value] : mine) ours[name] = &value;
  std::string out;
  auto differ = [&](const std::string& name, const std::string* zero, const std::string* here) {
    out += (out.empty() ? "" : "; ") + name + " is " + Quoted(zero) + " on rank 0 but " + Quoted(here) + " on rank " + std::to_string(rank);
  };
  for (const auto& [name, value] : rank0) {
    const auto it = ours.find(name);
    if (it == ours.end() || *it->second != value) differ(name, &value, it == ours.end() ? nullptr : it->second);
  }
  for (const auto& [name, value] : mine)
    if (!theirs.count(name)) differ(name, nullptr, &value);
  return out;
}

void AgreeOnJob(WriterGroup& group, const JobFields& mine) {
  if (group.size() == 1) return;
  std::string job;
  if (group.rank() == 0) job = nlohmann::json(mine).dump();
  group.Broadcast(&job);
  JobFields rank0;
  try {
    rank0 = nlohmann::json::parse(job).get<JobFields>();
  } catch (const nlohmann::json::exception&) {
    FailGroup(group, 2, "rank 0's job did not arrive intact (" + std::to_string(job.size()) + " bytes); nothing was written");
  }
  if (const std::string diff = JobDifference(rank0, mine, group.rank()); !diff.empty())
    FailGroup(group, 2, "the ranks of this mpirun were not given the same job, so none of them writes anything: " + diff);
  // Nobody writes before every rank has compared: a rank that differs aborts
  // the group while its peers wait here.
  group.Gather("");
  std::string go;
  group.Broadcast(&go);
}

}  // namespace ckpt

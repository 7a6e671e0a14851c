#include "ckpt/store/tag_writer.h"

#include <tbb/parallel_for.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "ckpt/util/error.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/pt/value_json.h"
#include "ckpt/util/progress.h"
#include "ckpt/pt/xser.h"

namespace ckpt {
namespace {

std::string Parent(const std::string& p) { return std::filesystem::path(p).parent_path().string(); }

}  // namespace

std::string RankRecordPath(const std::string& tag_dir, int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank_%05d.json", rank);
  return tag_dir + "/" + kRankRecordDir + "/" + buf;
}

void WriteMarker(Env* env, const std::string& path) {
  WriteFileAtomically(env, path, [](WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>("1"), 1}); });
}

namespace {

std::string ReadSmallFile(Env* env, const std::string& path) {
  auto m = env->MapFile(path);
  return std::string(reinterpret_cast<const char*>(m->data()), m->size());
}

void WriteText(Env* env, const std::string& path, const std::string& text) {
  WriteFileAtomically(env, path, [&](WritableFile& f) {
    f.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  });
}

std::string BeginPath(const std::string& tag_dir) { return tag_dir + "/" + kRankRecordDir + "/begin"; }

// Polls `ready` until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& ready, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace

void DeleteTag(Env* env, const std::string& tag_dir) {
  const std::string done = tag_dir + "/" + kDoneMarker;
  if (env->Exists(done)) {
    env->RemoveFile(done);
    env->SyncDir(tag_dir);
  }
  env->RemoveAll(tag_dir);
}

std::string NotATag(Env* env, const std::string& dir) {
  if (!env->IsDirectory(dir)) return "not a folder";
  const std::vector<std::string> names = env->ListDir(dir);
  bool marked = false;
  std::vector<std::string> foreign;
  for (const auto& n : names) {
    if (n == kRankRecordDir || n == kCheckpointMarker || n == kDoneMarker || n == kManifestFile) marked = true;
    else if (!(n == "model" || n == "optim" || n.ends_with(".pt") || IsTempPath(n))) foreign.push_back(n);
  }
  std::string why;
  if (!marked && !names.empty()) why = "it has no checkpoint marker (.shardkit, checkpoint, done or manifest.json)";
  if (!foreign.empty()) {
    std::string list;
    for (size_t i = 0; i < foreign.size() && i < 8; ++i) list += (i ? ", " : "") + foreign[i];
    if (foreign.size() > 8) list += ", and " + std::to_string(foreign.size() - 8) + " more";
    why += std::string(why.empty() ? "" : "; ") + "it holds what a checkpoint tag does not: " + list;
  }
  return why;
}

void BeginTag(Env* env, const std::string& tag_dir, const std::string& save_id) {
  if (env->Exists(tag_dir)) {  // re-saving a tag: never leave old `done` over new files
    if (const std::string why = NotATag(env, tag_dir); !why.empty())
      throw Error(tag_dir + ": exists and is not a checkpoint tag (" + why + "); not replacing it");
    DeleteTag(env, tag_dir);
  }
  env->CreateDirs(tag_dir + "/" + kRankRecordDir);
  env->SyncDir(Parent(tag_dir));
  WriteText(env, BeginPath(tag_dir), save_id);
  WriteMarker(env, tag_dir + "/" + kCheckpointMarker);
}

void WaitForBegin(Env* env, const std::string& tag_dir, const std::string& save_id, std::chrono::milliseconds timeout) {
  const std::string path = BeginPath(tag_dir);
  const bool ok = WaitFor([&] {
    try {
      return env->Exists(path) && ReadSmallFile(env, path) == save_id;
    } catch (const Error&) {
      return false;  // replaced while we looked
    }
  }, timeout);
  if (!ok) throw Error(tag_dir + ": rank 0 did not begin save " + save_id + " within " + std::to_string(timeout.count()) + " ms");
}

namespace {
// Each part of `file`'s xser form (SplitForXser), with `file`'s options but
// weights_only for its tensor files alone: X.pt holds TensorReference objects,
// info.pt torch dtypes. `keep` picks the parts by index.
std::vector<FileToWrite> XserParts(const FileToWrite& file, const std::function<bool(const std::string&)>& expert,
                                   const std::function<bool(size_t, const XserPart&)>& keep) {
  std::vector<XserPart> parts = SplitForXser(file.relpath, file.value, expert);
  std::vector<FileToWrite> out;
  for (size_t i = 0; i < parts.size(); ++i) {
    XserPart& part = parts[i];
    if (!keep(i, part)) continue;
    SaveOptions opts = file.options;
    opts.weights_only &= part.value.is_tensor();
    out.push_back({std::move(part.path), std::move(part.value), opts});
  }
  return out;
}
}  // namespace

std::vector<FileToWrite> XserFiles(const FileToWrite& file, const std::function<bool(const std::string&)>& expert, bool experts_only) {
  return XserParts(file, expert, [&](size_t, const XserPart& part) { return !(experts_only && part.value.is_tensor() && !part.expert); });
}

std::vector<FileToWrite> XserFilesOfBin(const FileToWrite& file, int bins, int bin, const std::function<bool(const std::string&)>& expert,
                                        bool experts_only) {
  std::vector<uint64_t> bytes;  // the tensor files come first, in tid order, then X.pt and its info.pt
  for (const XserPart& part : SplitForXser(file.relpath, file.value, expert))
    if (part.value.is_tensor()) bytes.push_back(part.value.as_tensor().nbytes());
  const std::vector<int> of = XserBins(bytes, bins);
  return XserParts(file, expert, [&](size_t i, const XserPart& part) {
    if (i >= bytes.size()) return bin == 0;
    return of[i] == bin && !(experts_only && !part.expert);
  });
}

std::map<std::string, FileDigest> WriteRankFiles(Env* env, const std::string& tag_dir, int rank,
                                                 const std::string& save_id, const std::vector<FileToWrite>& files,
                                                 const WriteRankOptions& opts) {
  std::set<std::string> dirs;
  for (const auto& f : files) {
    const std::string dir = Parent(tag_dir + "/" + f.relpath);
    if (dirs.insert(dir).second) env->CreateDirs(dir);
  }
  std::vector<FileDigest> written(files.size());
  auto write = [&](size_t i) {
    const FileToWrite& f = files[i];
    const std::string path = tag_dir + "/" + f.relpath;
    auto fill = [&](WritableFile& out) {
      const uint32_t crc = WritePt(out, ArchivePrefixFor(path), f.value, f.options);
      written[i] = FileDigest{out.Size(), crc};
    };
    if (opts.staging) {  // made durable all at once below
      auto out = env->NewWritableFile(path);
      fill(*out);
      out->Close();
    } else {
      // Each folder is synced once, after all of its files (below), before the record that votes for them.
      WriteFilesAtomically(env, {{path, fill}}, /*sync_dirs=*/false);
    }
    if (opts.on_file_written) opts.on_file_written(f, written[i]);
  };
  if (opts.parallel) {
    tbb::parallel_for(size_t{0}, files.size(), write, tbb::simple_partitioner());
  } else {
    for (size_t i = 0; i < files.size(); ++i) write(i);
  }
  std::map<std::string, FileDigest> digests;
  for (size_t i = 0; i < files.size(); ++i) digests[files[i].relpath] = written[i];
  if (opts.staging) {
    if (!files.empty()) env->SyncFileSystem(tag_dir);  // files and folders alike
  } else {
    // Every file's folder, then the folders' own entries in their parents.
    for (const auto& dir : dirs) env->SyncDir(dir);
    for (const auto& dir : dirs)
      if (dir != tag_dir) env->SyncDir(Parent(dir));
  }

  nlohmann::ordered_json rec = {{"rank", rank}, {"save_id", save_id}, {"files", nlohmann::ordered_json::object()}};
  for (const auto& [p, d] : digests) rec["files"][p] = {{"size", d.size}, {"crc32", CrcHex(d.crc32)}};
  if (opts.record_extra) rec["extra"] = opts.record_extra();
  const std::string text = rec.dump() + "\n";
  const std::string rec_path = RankRecordPath(tag_dir, rank);
  env->CreateDirs(Parent(rec_path));
  WriteFileAtomically(env, rec_path, [&](WritableFile& out) {
    out.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  });
  env->SyncDir(tag_dir);
  return digests;
}

RankRecord ParseRankRecord(const std::string& text, const std::string& where) {
  const nlohmann::json j = ParseJsonBounded(text, where);
  if (j.is_discarded() || !j.is_object() || !j.contains("files") || !j["files"].is_object() || !j.contains("save_id") ||
      !j["save_id"].is_string())
    throw Error(where + ": malformed rank completion record");
  RankRecord rec;
  rec.save_id = j["save_id"].get<std::string>();
  for (const auto& [p, d] : j["files"].items()) rec.files[p] = DigestFromJson(d, where + ": file '" + p + "'");
  if (j.contains("extra")) rec.extra = j["extra"];
  return rec;
}

StagedTag StageFor(const std::string& target, const std::string& tool) {
  const std::filesystem::path p(target);
  const std::string parent = p.has_parent_path() ? p.parent_path().string() : ".";
  const std::string name = p.filename().string();
  StagedTag t{target, parent + "/." + name + "." + tool + "-partial", parent + "/." + name + "." + tool + "-old", ""};
  t.lock = WriterLockOf(t.staging);
  return t;
}

namespace {

// The writer lock of a StagedTag: removes its file while still holding it
// (LockFile's contract makes that safe), so a finished write leaves nothing.
class TargetLock final : public FileLock {
 public:
  TargetLock(Env* env, std::string path, std::unique_ptr<FileLock> held) : env_(env), path_(std::move(path)), held_(std::move(held)) {}
  ~TargetLock() override {
    try {
      env_->RemoveFile(path_);
    } catch (const Error&) {  // left behind, it blocks nobody: the lock goes with held_
    }
  }
  void SetContents(const std::string& text) override { held_->SetContents(text); }

 private:
  Env* env_;
  std::string path_;
  std::unique_ptr<FileLock> held_;
};

}  // namespace

std::string WriterLockOf(const std::string& dir) {
  const std::filesystem::path p(WithoutTrailingSeparators(dir));
  const std::string name = p.filename().string();
  for (const std::string suffix : {"-partial", "-old"}) {
    if (name.size() < 2 || name[0] != '.' || !name.ends_with(suffix)) continue;
    const std::string stem = name.substr(1, name.size() - 1 - suffix.size());  // <name>.<tool>
    const size_t dot = stem.rfind('.');
    if (dot == std::string::npos || dot == 0) continue;
    return (p.has_parent_path() ? p.parent_path().string() : std::string(".")) + "/." + stem.substr(0, dot) + ".writer-lock";
  }
  return "";
}

std::unique_ptr<FileLock> TryLockWriter(Env* env, const std::string& lock_path, std::string* holder) {
  const std::string parent = std::filesystem::path(lock_path).parent_path().string();
  if (!parent.empty() && !env->IsDirectory(parent)) env->CreateDirs(parent);
  std::unique_ptr<FileLock> held = env->LockFile(lock_path, /*exclusive=*/true, /*wait=*/false);
  if (!held) {
    holder->clear();
    for (int tries = 0; tries < 50 && holder->empty(); ++tries) {  // it writes its pid just after taking the lock
      try {
        *holder = ReadSmallFile(env, lock_path);
      } catch (const Error&) {  // removed as it finished
      }
      if (holder->empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (holder->empty()) *holder = "its pid is not recorded yet";
    return nullptr;
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  held->SetContents("pid " + std::to_string(::getpid()) + " on " + host);
  return std::make_unique<TargetLock>(env, lock_path, std::move(held));
}

std::unique_ptr<FileLock> PrepareTarget(Env* env, const StagedTag& t, bool overwrite, const std::function<void(const std::string&)>& log) {
  std::string holder;
  std::unique_ptr<FileLock> lock = TryLockWriter(env, t.lock, &holder);
  if (!lock)
    throw Error(t.target + ": another writer is writing this tag (" + holder + ", holding " + t.lock +
                "); nothing was written. Wait for it to end, or stop it; a writer that was killed holds nothing");
  const std::string parent = std::filesystem::path(t.staging).parent_path().string();
  if (env->Exists(t.old) && !env->Exists(t.target)) {  // an earlier run died while swapping: put the old tag back
    if (env->Exists(t.old + "/" + kDoneMarker)) {
      env->RenameFile(t.old, t.target);
      env->SyncDir(parent);
      log("restored " + t.target + " that an interrupted run had set aside");
    } else {
      DeleteTag(env, t.old);
    }
  }
  if (!env->Exists(t.target)) return lock;
  if (!env->IsDirectory(t.target)) throw Error(t.target + ": exists and is not a folder");
  if (!env->ListDir(t.target).empty() && !overwrite)
    throw Error(t.target + ": exists and is not empty; pass --overwrite to replace it (it is kept until the new tag is complete)");
  if (const std::string why = NotATag(env, t.target); !why.empty() && overwrite)
    throw Error(t.target + ": --overwrite replaces only a checkpoint tag, and this folder is not a checkpoint tag: " + why);
  return lock;
}

std::string BeginStaged(Env* env, const StagedTag& t, WriterGroup& group, const std::string& tool) {
  // Rank 0 names the save and begins it before any rank writes; the others
  // learn the name from the broadcast, which they can only pass once it is begun.
  std::string save_id;
  if (group.rank() == 0) {
    std::random_device rd;
    save_id = tool + "-" + std::to_string(::getpid()) + "-" + CrcHex(rd()) + CrcHex(rd());
    env->CreateDirs(std::filesystem::path(t.staging).parent_path().string());
    BeginTag(env, t.staging, save_id);
  }
  group.Broadcast(&save_id);
  return save_id;
}

void CommitStaged(Env* env, const StagedTag& t, WriterGroup& group, CommitInfo info, std::unique_ptr<FileLock>* writing) {
  info.world_size = group.size();
  const std::vector<std::string> texts = group.Gather(ReadSmallFile(env, RankRecordPath(t.staging, group.rank())));
  std::string why_not;  // rank 0's decision: empty to commit
  if (group.rank() == 0) {
    try {
      std::vector<RankRecord> records;
      for (int r = 0; r < group.size(); ++r) {
        const std::string where = RankRecordPath(t.staging, r);
        records.push_back(ParseRankRecord(texts[r], where));
        if (records.back().save_id != info.save_id) throw Error(where + ": belongs to save " + records.back().save_id + ", not " + info.save_id);
      }
      CommitRecords(env, t.staging, info, std::move(records));
      PublishStaged(env, t);
    } catch (const Error& e) {
      why_not = *e.what() ? e.what() : "the commit failed";
      try {  // every rank has stopped writing: nothing of this save is kept
        if (env->Exists(t.staging)) DeleteTag(env, t.staging);
      } catch (const Error&) {  // it stays without `done`
      }
    }
  }
  writing->reset();  // nothing of this save is left to guard
  group.Broadcast(&why_not);  // the decision: empty commits
  if (why_not.empty()) return;
  if (group.rank() == 0) throw Error(why_not);
  throw Error(t.target + ": rank 0 did not commit the tag (" + why_not + ")");
}

bool WritesUnit(int unit, int rank, int world_size) { return unit < 0 ? rank == 0 : unit % world_size == rank; }

uint64_t WriteRankFilesReporting(Env* env, const std::string& tag_dir, int rank, const std::string& save_id,
                                 const std::vector<FileToWrite>& files, const std::vector<uint64_t>& weights, bool progress_bar,
                                 const std::function<void(const std::string&)>& log, std::chrono::steady_clock::time_point start,
                                 std::function<nlohmann::json()> record_extra) {
  uint64_t total = 0;
  for (uint64_t w : weights) total += w;
  std::mutex mu;
  uint64_t done_bytes = 0, done_weight = 0;
  int done_files = 0;
  WriteRankOptions wo;
  wo.parallel = true;
  wo.staging = true;  // every caller writes a StagedTag
  wo.record_extra = std::move(record_extra);
  wo.on_file_written = [&](const FileToWrite& f, const FileDigest& d) {
    std::lock_guard<std::mutex> lock(mu);
    done_bytes += d.size, done_weight += weights[&f - files.data()], ++done_files;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    char line[256];
    std::snprintf(line, sizeof line, "%d/%zu files, %s, %.1f s", done_files, files.size(), HumanBytes(done_bytes).c_str(), secs);
    if (progress_bar) std::fprintf(stderr, "\r%s %s", ProgressBar(done_weight, total).c_str(), line), std::fflush(stderr);
    else log("wrote " + f.relpath + " (" + HumanBytes(d.size) + ") [" + line + "]");
  };
  WriteRankFiles(env, tag_dir, rank, save_id, files, wo);
  if (progress_bar) std::fprintf(stderr, "\n");
  return done_bytes;
}

void PublishStaged(Env* env, const StagedTag& t) {
  const std::string parent = std::filesystem::path(t.staging).parent_path().string();
  if (env->Exists(t.old)) DeleteTag(env, t.old);  // not the only copy: the target exists (PrepareTarget restored it)
  const bool replacing = env->Exists(t.target);
  if (replacing) env->RenameFile(t.target, t.old);
  env->RenameFile(t.staging, t.target);
  env->SyncDir(parent);
  if (replacing) DeleteTag(env, t.old);  // `done` first: a kill mid-delete leaves nothing that looks whole
}

void CommitRecords(Env* env, const std::string& tag_dir, const CommitInfo& info, std::vector<RankRecord> records) {
  Manifest m;
  m.step = info.step;
  m.consumed_samples = info.consumed_samples;
  m.grid = info.grid;
  m.world_size = info.world_size;
  m.model = info.model;
  m.optimizer_grouping = info.optimizer_grouping;
  for (size_t r = 0; r < records.size(); ++r)
    for (const auto& [p, d] : records[r].files) {
      if (m.files.count(p)) throw Error(RankRecordPath(tag_dir, static_cast<int>(r)) + ": file '" + p + "' was also written by another rank");
      m.files[p] = d;
    }
  if (info.stages) m.layout = RecordedLayout{*info.stages, info.master_weights, ContainerOfFiles(m.files)};
  if (info.complete_manifest) info.complete_manifest(records, m);
  m.Save(env, tag_dir + "/" + kManifestFile);
  WriteMarker(env, tag_dir + "/" + kDoneMarker);
}

void CommitTag(Env* env, const std::string& tag_dir, const CommitInfo& info) {
  // A record counts once it exists and belongs to this save.
  auto record = [&](int r) -> std::optional<RankRecord> {
    const std::string path = RankRecordPath(tag_dir, r);
    if (!env->Exists(path)) return std::nullopt;
    RankRecord rec = ParseRankRecord(ReadSmallFile(env, path), path);
    if (rec.save_id != info.save_id) return std::nullopt;
    return rec;
  };
  const auto deadline = std::chrono::steady_clock::now() + info.rank_timeout;
  std::vector<RankRecord> records;
  for (int r = 0; r < info.world_size; ++r) {
    std::optional<RankRecord> rec;
    const bool ok = WaitFor([&] { return (rec = record(r)).has_value(); },
                            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
    if (!ok) {
      std::string missing;
      for (int q = r; q < info.world_size; ++q)
        if (!record(q)) missing += (missing.empty() ? "" : ", ") + std::to_string(q);
      throw Error(tag_dir + ": ranks " + missing + " did not finish writing within " +
                  std::to_string(info.rank_timeout.count()) + " ms; the tag stays incomplete (no done)");
    }
    records.push_back(std::move(*rec));
  }
  CommitRecords(env, tag_dir, info, std::move(records));
}

}  // namespace ckpt

// Writing one checkpoint tag, possibly from many ranks, so that it never
// looks complete before it is. Every save has a `save_id` all ranks share
// (the store's run id and the step), so records of an earlier save of the
// same tag are never mistaken for this one's.
//   1. BeginTag (rank 0): deletes an existing tag of that name (`done`
//      first), creates the folder, .shardkit/begin (the save_id) and the
//      `checkpoint` marker. Other ranks WaitForBegin before writing.
//   2. WriteRankFiles (every rank): writes that rank's files, each atomically
//      (temporary name, fsync, rename), fsyncs their folders, then records
//      what it wrote (sizes, CRC-32s, save_id) in
//      .shardkit/rank_RRRRR.json, itself written atomically. That record is
//      the rank's completion vote.
//   3. CommitTag (rank 0): waits until every rank's record for this save_id
//      exists, merges them into manifest.json, and only then writes `done`.
// In the store, completion travels through the file system, so it works from
// a background writer thread; a rank that dies leaves its record missing and
// the tag stays without `done`. The tools, which write in the foreground,
// agree through their WriterGroup instead (BeginStaged, CommitStaged).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/manifest.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/value.h"
#include "ckpt/util/writer_group.h"

namespace ckpt {

struct FileToWrite {
  std::string relpath;  // relative to the tag, e.g. "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
  Value value;
  SaveOptions options;
};

// `file` as NxD's xser writes it (SplitForXser: X.pt, X.pt.tensors/tensor_<tid>.pt,
// X.pt.info.pt), each part with `file`'s options, except that only the tensor
// files keep weights_only: X.pt holds TensorReference objects, info.pt torch dtypes.
// Under expert parallelism, `expert` marks the top-level keys that are expert
// weights (SplitForXser), and with `experts_only` (an ep rank above 0's file)
// only their tensor files are written, as NxD's _xser_save_data does.
std::vector<FileToWrite> XserFiles(const FileToWrite& file, const std::function<bool(const std::string& key)>& expert = {},
                                   bool experts_only = false);
// The part of XserFiles(file, expert, experts_only) that data-parallel rank
// `bin` of `bins` ranks holding the same `file` writes, as NxD's
// _xser_save_data deals them: the tensor files of its bin (XserBins over all
// of the file's tensors, experts_only or not), and on bin 0 X.pt and
// X.pt.info.pt too. Under expert parallelism the ranks holding the same file
// are an expert-data-parallel group (NxD's save_checkpoint passes
// get_expert_data_parallel_replica_groups()). `file`'s tensors outside the
// bin may be snapshot placeholders (CopyForSnapshot's).
std::vector<FileToWrite> XserFilesOfBin(const FileToWrite& file, int bins, int bin,
                                        const std::function<bool(const std::string& key)>& expert = {}, bool experts_only = false);

inline constexpr const char* kRankRecordDir = ".shardkit";
std::string RankRecordPath(const std::string& tag_dir, int rank);

void BeginTag(Env* env, const std::string& tag_dir, const std::string& save_id);
// Ranks other than 0: waits until rank 0 has begun this save.
void WaitForBegin(Env* env, const std::string& tag_dir, const std::string& save_id, std::chrono::milliseconds timeout);

struct WriteRankOptions {
  // Write the files concurrently (TBB); the Env must then be thread-safe.
  bool parallel = false;
  // The folder is a staging folder (StagedTag), which nothing reads before it
  // is committed and renamed: files take their names at once, unsynced, and
  // one SyncFileSystem makes them all durable before the record. The store's
  // tags, written in place, keep temporary name, fsync and rename per file.
  bool staging = false;
  // Called after each file is durable (from the writing thread).
  std::function<void(const FileToWrite&, const FileDigest&)> on_file_written;
  // Called once every file is durable: what the writer adds to this rank's
  // record for the commit to merge (ckpt-reshard's fingerprint pieces).
  std::function<nlohmann::json()> record_extra;
};

// Writes the files and this rank's completion record. Returns the digests.
std::map<std::string, FileDigest> WriteRankFiles(Env* env, const std::string& tag_dir, int rank,
                                                 const std::string& save_id, const std::vector<FileToWrite>& files,
                                                 const WriteRankOptions& opts = {});

// A rank's completion record (.shardkit/rank_NNNNN.json): the save it belongs
// to and the size and CRC-32 of every file it wrote. Throws ckpt::Error
// naming `where` when malformed.
struct RankRecord {
  std::string save_id;
  std::map<std::string, FileDigest> files;
  nlohmann::json extra;  // WriteRankOptions::record_extra's, or null
};
RankRecord ParseRankRecord(const std::string& text, const std::string& where);

struct CommitInfo {
  std::string save_id;
  int64_t step = 0;
  double consumed_samples = 0;
  RankGrid grid;
  int world_size = 1;
  std::chrono::milliseconds rank_timeout{30 * 60 * 1000};
  std::optional<ModelFormat> model;  // recorded in the manifest when known
  std::optional<GroupingRule> optimizer_grouping;  // likewise, when optimizer files are written
  // Called with every rank's record before the manifest is written, to add
  // what the records' `extra` carries; throwing leaves the tag without `done`.
  std::function<void(const std::vector<RankRecord>&, Manifest&)> complete_manifest;
  // The stage map and master weights of what was written: with `stages`, the
  // manifest records the parallel layout (Manifest::layout; the container
  // follows from the files written).
  std::optional<StageMap> stages;
  bool master_weights = false;
};

// Merges every rank's record (in rank order) into manifest.json, then writes `done`.
void CommitRecords(Env* env, const std::string& tag_dir, const CommitInfo& info, std::vector<RankRecord> records);
// Rank 0 of the store, whose ranks save from background threads and so
// cannot meet in a collective: waits for every rank's record file, then
// CommitRecords. Throws ckpt::Error naming the missing ranks on timeout (no `done` written).
void CommitTag(Env* env, const std::string& tag_dir, const CommitInfo& info);

// Deletes a tag so that no interruption leaves it looking complete: `done`
// goes first (and is made durable), then everything else.
void DeleteTag(Env* env, const std::string& tag_dir);

// Why `dir` is not a checkpoint tag that a tool may delete or replace; empty
// when it is one. A tag carries a marker (our .shardkit record, NxD's
// `checkpoint` file, `done` or a manifest) and holds nothing but what tags
// hold (model/, optim/, markers, the manifest, *.pt files, temporaries).
// Anything else is named, so the user's files are never removed with it.
std::string NotATag(Env* env, const std::string& dir);

// A tag a tool writes whole (nnm2nxdt-ckpt, ckpt-reshard): it is written in a
// staging folder beside the target, committed there, and only then takes the
// target's name, so the target is never an incomplete tag and an existing
// target survives any failure. One writer at a time: rank 0 holds the
// target's writer lock from before PrepareTarget until the tag is published
// or abandoned, so a second writer of the same target (any tool) never
// shares, deletes or publishes the first one's staging folder.
struct StagedTag {
  std::string target;   // the tag folder the user named
  std::string staging;  // .<name>.<tool>-partial beside it: never a resume candidate
  std::string old;      // .<name>.<tool>-old: an existing target while it is being replaced
  std::string lock;     // .<name>.writer-lock beside it: flock()ed by the writer, holding its pid
};
StagedTag StageFor(const std::string& target, const std::string& tool);
// Rank 0, before writing: takes the target's writer lock (without waiting;
// a target another live writer holds is refused with ckpt::Error naming its
// pid, and nothing is touched), puts back a target an interrupted publish set
// aside; refuses an existing non-empty target without `overwrite`, and any
// folder that is not a checkpoint tag (NotATag) even with it. Throws
// ckpt::Error naming the folder. Returns the lock: keep it until the tag is
// published or its staging folder deleted; destroying it removes the lock
// file, then releases it. A writer that dies leaves the file, but the kernel
// releases its lock, so the next writer takes it.
// The writer lock path of a StagedTag's staging or set-aside folder
// (.<name>.<tool>-partial or -old, `dir` as a path); "" for any other folder.
std::string WriterLockOf(const std::string& dir);
// Takes the writer lock at `lock_path` without waiting, writing this
// process's pid and host into it; null when a live writer holds it, with
// what that writer recorded (its pid) in *holder. The lock's destruction
// removes the file, then releases it. Throws ckpt::Error when the lock file
// cannot be made.
std::unique_ptr<FileLock> TryLockWriter(Env* env, const std::string& lock_path, std::string* holder);
[[nodiscard]] std::unique_ptr<FileLock> PrepareTarget(Env* env, const StagedTag& t, bool overwrite,
                                                      const std::function<void(const std::string&)>& log);
// Every rank of `group`, after PrepareTarget: rank 0 begins the save in the
// staging folder under a fresh save id and broadcasts it. Returns the save id.
std::string BeginStaged(Env* env, const StagedTag& t, WriterGroup& group, const std::string& tool);
// Whether this process writes unit `unit` of a tool's output: rank files
// (unit >= 0) are dealt round-robin over the processes; the tag's own files
// (unit < 0: scheduler, user content) come from rank 0.
bool WritesUnit(int unit, int rank, int world_size);

// WriteRankFiles of a StagedTag's staging folder (in parallel, `staging`) that reports as it goes: a progress bar over
// `weights` (what each file counts toward it, e.g. its tensor bytes) when
// `progress_bar`, else one log line per file written; times are from `start`.
// Returns the bytes written.
uint64_t WriteRankFilesReporting(Env* env, const std::string& tag_dir, int rank, const std::string& save_id,
                                 const std::vector<FileToWrite>& files, const std::vector<uint64_t>& weights, bool progress_bar,
                                 const std::function<void(const std::string&)>& log, std::chrono::steady_clock::time_point start,
                                 std::function<nlohmann::json()> record_extra = {});

// Every rank of `group`, once its files and record are written: the records
// are gathered on rank 0, which commits the staging folder (CommitRecords;
// info.world_size is the group's) and publishes it, or, when the commit
// fails (info.complete_manifest throwing, a record of another save), deletes
// it. Rank 0 broadcasts the outcome; every rank throws ckpt::Error when the
// tag was not committed. A rank that failed before this call must Abort the
// group instead of returning, or its peers wait here. *writing is rank 0's
// writer lock (PrepareTarget; null on the other ranks): released once the
// tag is published or deleted, before the outcome is broadcast, so no peer's
// abort can end rank 0 while its lock file is still there. Left held when
// this throws before that point (the caller still has a staging folder).
void CommitStaged(Env* env, const StagedTag& t, WriterGroup& group, CommitInfo info, std::unique_ptr<FileLock>* writing);

// Rank 0, once the tag is committed: the complete tag takes the target's
// name; a replaced target is deleted last (`done` first).
void PublishStaged(Env* env, const StagedTag& t);

// Writes a small marker file ("1") atomically.
void WriteMarker(Env* env, const std::string& path);

}  // namespace ckpt

// CheckpointStore is the one way training and the tools write checkpoints.
//
// Contract:
//  - Save(snapshot) writes one NxDT tag through the tag writer
//    (atomic files, rank completion records, manifest, then `done`).
//  - async: the caller hands over a snapshot (a host copy it will not touch
//    again; CopyForSnapshot makes one, see snapshot.h) and continues at once; one background
//    thread persists it. At most `max_in_flight` snapshots are held; past
//    that, Save blocks until one is durable. `done` is written as soon as a
//    save is durable (NxD waits for the next save).
//  - A failed background save is reported by the next Save or Finalize,
//    with its cause; the tag it was writing never gets `done`, and earlier
//    complete tags are untouched.
//  - Retention keeps the newest `save_top_k` complete tags by step (-1 keeps
//    all) among those named as ours with steps up to the one just saved: a
//    later step (left by a run this one resumed before) or a tag named
//    otherwise is never deleted. Deletes remove `done` first, so an
//    interrupted delete never looks complete; the tag just saved and
//    in-progress tags are never deleted.
//    Tags named in `damaged` (found damaged at resume) are evidence: never
//    deleted nor counted. A save whose name a complete tag already holds sets
//    that tag aside as <name>.damaged[-N] (or .superseded[-N]), never deletes it.
//  - While a store exists it holds a shared lock on <dir>/.shardkit.lock, so
//    `ckpt-verify --gc` never removes an in-progress save of a live job.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/spec/partition.h"
#include "ckpt/store/resume.h"
#include "ckpt/store/snapshot.h"
#include "ckpt/store/tag_writer.h"

namespace ckpt {

struct StoreOptions {
  std::string dir;  // the checkpoint directory holding the tags
  int save_top_k = -1;
  bool async = false;
  int max_in_flight = 1;
  std::chrono::milliseconds rank_timeout{30 * 60 * 1000};
  Env* env = Env::Default();
  LogFn log = nullptr;
  std::vector<std::string> damaged = {};  // tag folder names (not paths) that failed verification
  std::optional<ModelFormat> model = {};   // recorded in every manifest
  std::optional<GroupingRule> optimizer_grouping = {};  // likewise
  // The parallel layout recorded in every manifest (CommitInfo::stages, master_weights).
  std::optional<StageMap> stages = {};
  bool master_weights = false;
};

inline constexpr const char* kStoreLockFile = ".shardkit.lock";

class CheckpointStore {
 public:
  // `launch`: this process's rank and the world size; its job id identifies
  // this job's saves and every rank must pass the same one. With one rank it
  // may be empty and a random one is made.
  explicit CheckpointStore(StoreOptions opts, MpiLaunch launch = {});
  // Finalizes; an unreported failure is logged, not thrown.
  ~CheckpointStore();
  CheckpointStore(const CheckpointStore&) = delete;
  CheckpointStore& operator=(const CheckpointStore&) = delete;

  void Save(Snapshot snap);
  // Waits for every pending save; throws the first unreported failure.
  void Finalize();
  // Tags committed by this store, oldest first.
  std::vector<std::string> committed() const;

 private:
  void WriterLoop();
  void Persist(const Snapshot& snap);
  void ApplyRetention(int64_t saved_step);
  bool IsDamaged(const std::string& tag_name) const;
  void ThrowPendingError();

  StoreOptions opts_;
  MpiLaunch launch_;
  std::unique_ptr<FileLock> lock_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Snapshot> queue_;
  int in_flight_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::string> committed_;
  std::thread writer_;
};

}  // namespace ckpt

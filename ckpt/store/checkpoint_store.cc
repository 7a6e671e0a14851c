#include "ckpt/store/checkpoint_store.h"

#include <sys/resource.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <algorithm>
#include <random>

#include "ckpt/util/error.h"
#include "ckpt/store/manifest.h"
#include "ckpt/store/tag_verify.h"

namespace ckpt {

namespace {
constexpr int kWriterNice = 10;
}  // namespace

CheckpointStore::CheckpointStore(StoreOptions opts, MpiLaunch launch) : opts_(std::move(opts)), launch_(std::move(launch)) {
  if (opts_.dir.empty()) throw Error("checkpoint store: no checkpoint directory given");
  if (opts_.max_in_flight < 1) throw Error("checkpoint store: max_in_flight must be at least 1");
  if (launch_.job_id.empty()) {
    if (launch_.world_size > 1) throw Error("checkpoint store: a multi-rank store needs a job id shared by all ranks");
    std::random_device rd;
    launch_.job_id = CrcHex(rd()) + CrcHex(rd());
  }
  opts_.env->CreateDirs(opts_.dir);
  lock_ = opts_.env->LockFile(opts_.dir + "/" + kStoreLockFile, /*exclusive=*/false, /*wait=*/true);
  if (opts_.async) writer_ = std::thread([this] { WriterLoop(); });
}

CheckpointStore::~CheckpointStore() {
  try {
    Finalize();
  } catch (const std::exception& e) {
    if (opts_.log) opts_.log(std::string("checkpoint: unreported failure at shutdown: ") + e.what());
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

void CheckpointStore::ThrowPendingError() {
  if (!error_) return;
  std::exception_ptr e = error_;
  error_ = nullptr;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    throw Error(std::string("an earlier background checkpoint save failed: ") + x.what());
  }
}

void CheckpointStore::Save(Snapshot snap) {
  if (!opts_.async) {
    Persist(snap);
    return;
  }
  std::unique_lock<std::mutex> l(mu_);
  ThrowPendingError();
  cv_.wait(l, [&] { return in_flight_ < opts_.max_in_flight || error_; });
  ThrowPendingError();
  ++in_flight_;
  queue_.push_back(std::move(snap));
  cv_.notify_all();
}

void CheckpointStore::Finalize() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return in_flight_ == 0; });
  ThrowPendingError();
}

std::vector<std::string> CheckpointStore::committed() const {
  std::lock_guard<std::mutex> l(mu_);
  return committed_;
}

void CheckpointStore::WriterLoop() {
  // Background saves yield the CPU to training: lower priority, and a
  // one-thread TBB arena so the writer's parallel loops (CRCs) stay on this
  // thread instead of spilling onto the training's worker threads.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kWriterNice);
  tbb::task_arena arena(1);
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    Snapshot snap = std::move(queue_.front());
    queue_.pop_front();
    l.unlock();
    std::exception_ptr failure;
    arena.execute([&] {
      try {
        Persist(snap);
      } catch (...) {
        failure = std::current_exception();
      }
    });
    snap = Snapshot{};  // release the snapshot's memory before admitting the next
    l.lock();
    if (failure && !error_) error_ = failure;
    --in_flight_;
    cv_.notify_all();
  }
}

void CheckpointStore::Persist(const Snapshot& snap) {
  Env* env = opts_.env;
  const std::string name = FormatTagName(snap.tag), tag_dir = opts_.dir + "/" + name;
  const std::string save_id = launch_.job_id + "/step=" + std::to_string(snap.tag.step);
  // A complete tag under this name is another save's (a damaged one resume
  // skipped, or a later step of a run resumed from an earlier tag): set it
  // aside, never delete it. An incomplete one is an interrupted save of ours.
  if (launch_.rank == 0 && env->Exists(tag_dir) && (env->Exists(tag_dir + "/" + kDoneMarker) || IsDamaged(name))) {
    const std::string suffix = IsDamaged(name) ? kDamagedSuffix : kSupersededSuffix;
    std::string aside = tag_dir + suffix;
    for (int n = 1; env->Exists(aside); ++n) aside = tag_dir + suffix + "-" + std::to_string(n);
    env->RenameFile(tag_dir, aside);
    env->SyncDir(opts_.dir);
    std::erase(opts_.damaged, name);  // the name now holds this save
    if (opts_.log) opts_.log("checkpoint: set the " + suffix.substr(1) + " " + tag_dir + " aside as " + aside + " (kept)");
  }
  if (launch_.rank == 0) BeginTag(env, tag_dir, save_id);
  else WaitForBegin(env, tag_dir, save_id, opts_.rank_timeout);
  WriteRankFiles(env, tag_dir, launch_.rank, save_id, snap.files);
  if (launch_.rank != 0) return;
  CommitTag(env, tag_dir,
            {save_id, snap.tag.step, snap.tag.consumed_samples, snap.grid, launch_.world_size, opts_.rank_timeout, opts_.model,
             opts_.optimizer_grouping, {}, opts_.stages, opts_.master_weights});
  {
    std::lock_guard<std::mutex> l(mu_);
    committed_.push_back(tag_dir);
  }
  if (opts_.log) opts_.log("checkpoint: saved " + tag_dir);
  ApplyRetention(snap.tag.step);
}

bool CheckpointStore::IsDamaged(const std::string& tag_name) const {
  return std::find(opts_.damaged.begin(), opts_.damaged.end(), tag_name) != opts_.damaged.end();
}

void CheckpointStore::ApplyRetention(int64_t saved_step) {
  if (opts_.save_top_k < 0) return;
  // Only this run's line of saves is counted: tags named as ours up to the step
  // just saved. Later steps (a run resumed from an earlier tag) and tags named
  // otherwise are not this run's to delete; damaged ones are evidence.
  std::vector<TagEntry> complete;
  for (TagEntry& t : ListTags(opts_.env, opts_.dir))
    if (t.has_done && t.parsed && t.parsed->step <= saved_step && !IsDamaged(t.dir_name))
      complete.push_back(std::move(t));  // newest first
  // A tag without a manifest (ours that lost it, or one NxD wrote under our name) was checked
  // at resume only by what its files say of themselves, and this run may descend from it. It is
  // neither counted nor deleted, and the newest tag older than it that verifies against its
  // manifest, the last state known good, stays whatever save_top_k says.
  std::string anchor;
  bool unmanifested_after = false;
  std::vector<TagEntry> counted;
  for (TagEntry& t : complete) {
    if (!opts_.env->Exists(t.path + "/" + kManifestFile)) {
      unmanifested_after = true;
      continue;
    }
    if (unmanifested_after && anchor.empty() && VerifyTag(opts_.env, t.path, {.checksums = false}).ok()) anchor = t.path;
    counted.push_back(std::move(t));
  }
  complete = std::move(counted);
  const size_t keep = std::max(1, opts_.save_top_k);   // the newest complete tag always stays
  for (size_t i = keep; i < complete.size(); ++i) {
    if (complete[i].path == anchor) {
      if (opts_.log)
        opts_.log("checkpoint: kept " + anchor + " beyond save_top_k: it is the newest tag verified against its manifest "
                  "before one that has no manifest");
      continue;
    }
    DeleteTag(opts_.env, complete[i].path);
    if (opts_.log) opts_.log("checkpoint: removed " + complete[i].path + " (save_top_k=" + std::to_string(opts_.save_top_k) + ")");
  }
  opts_.env->SyncDir(opts_.dir);
}

}  // namespace ckpt

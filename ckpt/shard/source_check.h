// A source tag's checksum pass, run beside the work it guards.
//
// ckpt-reshard and ckpt-export check every file of their source against its
// manifest (VerifyTag with checksums) before trusting it. Done first, that
// pass reads the whole source and computes its CRCs while the disk writes
// nothing; the copy then reads again. SourceCheck runs it on a thread of its
// own while the caller opens, reads and writes, so the two reads share the
// disk's queue and the page cache, and the CRCs use a core the copy leaves
// idle. What the user gets is unchanged: the caller calls Wait() before its
// output becomes visible (before the commit or the rename), so a source that
// fails verification still leaves no output, and the error names the
// problem as the up-front pass did.
//
// Folded (a source with a manifest, whose files carry CRC-32s): the caller
// reads the source through a FoldingEnv (ckpt/util/read_fold.h), which records
// the CRC-32 of every range it reads; Wait then checks the same way, reading
// only the ranges the job did not (pickles, padding, skipped replicas), so
// the source is read once, not twice. Under mpirun every rank records and
// Wait gathers the records to rank 0, which checks.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/store/resume.h"
#include "ckpt/util/env.h"
#include "ckpt/util/read_fold.h"
#include "ckpt/util/writer_group.h"

namespace ckpt {

// What the up-front check does and throws: `tag`'s files against its
// manifest, checksums included; with `weights_only`, problems of optim/
// files are said through `log` as notes (the reader does not open them).
// Throws ckpt::Error "TAG: fails verification, so it is not read (--no_verify
// skips this):" and every problem, a line each. With `fold`, a listed file's
// CRC-32 is what `fold` recorded of it and its gaps (ReadFold::Crc).
void VerifySourceTag(Env* env, const std::string& tag, bool weights_only, const LogFn& log, const ReadFold* fold = nullptr);

class SourceCheck {
 public:
  // A check of `tag` when `enabled` (rank 0 of a group checks for all); else
  // one that does nothing and passes.
  SourceCheck(Env* env, std::string tag, bool enabled, bool weights_only);
  // A folded check: `fold` records what this process reads of the source
  // (its FoldingEnv's); Start does nothing and Wait checks. With a `group` of
  // several, Wait is a collective (every rank calls it): each rank's record
  // goes to rank 0, which checks when `enabled`. Both outlive the check.
  // A null `fold` is the check beside the copy (the constructor above).
  SourceCheck(Env* env, std::string tag, bool enabled, bool weights_only, ReadFold* fold, WriterGroup* group);
  SourceCheck(const SourceCheck&) = delete;
  SourceCheck& operator=(const SourceCheck&) = delete;
  // Waits for the thread; never throws.
  ~SourceCheck();

  // What the check holds in memory at most while it runs, for the caller's
  // budget: kThreads of DigestFile's 4 MiB buffers, and as much again (a mapped
  // window's large folios before the pass read with pread; kept as the reserve). 0 when not enabled.
  uint64_t memory() const;

  // Starts VerifySourceTag(env, tag, weights_only) on a thread of its own, in
  // a TBB arena of kThreads (the caller's arena, sized by --threads, is not
  // shared). Once; a later call does nothing. Not enabled: does nothing.
  void Start();

  // Waits for the check (starting it first if it was not; folded, runs it
  // here, in the caller's arena); says its notes through `log`; throws its error.
  // Idempotent: a second call returns or throws as the first did.
  void Wait(const LogFn& log);

  // For a caller's catch block: the check is run to its end (started if it
  // was not), and when it failed, its error (it names
  // the damaged file and how; a parse error it caused says less) is thrown
  // instead of the one being handled; otherwise returns, and the caller
  // rethrows its own. Folded, no record is gathered (a peer may have failed
  // before its Wait): rank 0 reads what it did not read itself.
  void ThrowIfFailed(const LogFn& log);

 private:
  // Folded: checks now, once (later calls do nothing), with what `fold_` recorded.
  void RunFolded();

  static constexpr int kThreads = 1;
  Env* env_;
  std::string tag_;
  bool enabled_, weights_only_, started_ = false;
  std::thread thread_;
  std::vector<std::string> notes_;
  std::exception_ptr error_;
  bool waited_ = false, gathered_ = false;
  ReadFold* fold_ = nullptr;
  WriterGroup* group_ = nullptr;
};

}  // namespace ckpt

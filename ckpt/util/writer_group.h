// The processes that write one output tag together: ckpt-reshard,
// ckpt-import and nnm2nxdt-ckpt under mpirun, and the trainer's resume
// reshard. They agree through collectives, never through the file system:
// rank 0 hands every rank the save id (Broadcast), every rank hands rank 0
// its completion record (Gather), and rank 0 hands back the decision to
// commit or abort (Broadcast). A rank that fails calls Abort, which ends
// every rank of the group at once; a rank that dies is ended with its peers
// by MPI's runtime. Either way no rank waits on a peer that will never come,
// and the tag never gets `done`.
//
// Every rank makes the same calls in the same order (MPI's rule). Calls come
// from one thread per process.
#pragma once

#include <string>
#include <vector>

namespace ckpt {

class WriterGroup {
 public:
  virtual ~WriterGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank 0's *s on every rank.
  virtual void Broadcast(std::string* s) = 0;
  // Every rank's `s` on rank 0, in rank order; empty on the other ranks.
  virtual std::vector<std::string> Gather(const std::string& s) = 0;
  // Ends every process of the group with exit code `code`, now. The caller
  // has already said why.
  [[noreturn]] virtual void Abort(int code) = 0;
};

// The group of this process alone (no mpirun, or mpirun -np 1).
WriterGroup& SoloGroup();

// How a tool ends after an error: says `what` on stderr as one line
// ("error: ...", or "rank N: error: ..." in a group of several, written at
// once so ranks' lines do not interleave); alone, it returns `code` (to be
// main's exit code); in a group of several it aborts the group with `code`
// (MPI_Abort), so no peer waits for this rank and the launcher sees `code`
// whatever its policy for processes that exit non-zero.
int FailGroup(WriterGroup& group, int code, const std::string& what);

}  // namespace ckpt

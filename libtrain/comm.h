// Collectives among the ranks of a training job, over Open MPI when mpirun
// started the job and trivially (one rank) otherwise. The world communicator
// and the tensor-, data- and pipeline-parallel groups are all made here from
// the one ckpt::RankGrid; nothing else talks to MPI.
//
// Every rank must make the same calls in the same order (MPI's rule). A rank
// that fails calls Comm::Abort, which ends the whole job, so no rank waits
// forever in a collective its peer never reaches.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/spec/rank_grid.h"

namespace train {

// What this process's communicators have done, for the step-time split and
// the traffic count: seconds inside collectives, seconds blocked in Recv
// (waiting for a pipeline neighbour and the transfer), and the floats handed
// over: a collective's input (all-reduce n, reduce-scatter size*block,
// all-gather block, all-to-all size*block) and each sent message; and the
// floats all-to-alls sent to other ranks ((size - 1) * block each).
struct CommStats {
  double collective_seconds = 0, recv_wait_seconds = 0;
  uint64_t collective_floats = 0, sent_floats = 0, alltoall_floats = 0;
};

class Comm {
 public:
  // This process's totals so far (only calls between ranks count).
  static const CommStats& Stats();
  // Initializes MPI when ckpt::ReadMpiLaunch() says mpirun started more than
  // one process (once per process, finalized at exit), and returns the world
  // communicator; a one-rank communicator otherwise.
  static Comm& World();
  // Whether World() runs over MPI.
  static bool UsingMpi();
  // Ends every rank of the job with `code` (MPI_Abort), after the caller has
  // reported its error; without MPI running, std::exit(code).
  [[noreturn]] static void Abort(int code);

  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // The communicator of the group `ranks` (world ranks, in group order), or
  // nullptr when this rank is not in it. Every rank of this communicator must
  // call it, each with the group it is in (or, if in none, any group).
  std::unique_ptr<Comm> Group(const std::vector<int>& ranks);

  // Elementwise sums over the ranks, in place.
  void AllReduceSum(float* x, size_t n);
  void AllReduceSum(double* x, size_t n);
  // Elementwise maxima over the ranks, in place.
  void AllReduceMax(float* x, size_t n);
  // `in` holds size() blocks of `block` floats; rank r receives the sum of
  // every rank's block r in `out` (MPI_Reduce_scatter_block).
  void ReduceScatterSum(const float* in, float* out, size_t block);
  // Every rank's `block` floats from `in`, in rank order, into `out`.
  void AllGather(const float* in, float* out, size_t block);
  // `in` holds size() blocks of `block` floats; block r goes to rank r, and
  // out's block q is what rank q sent this rank (MPI_Alltoall).
  void AllToAll(const float* in, float* out, size_t block);
  // Point to point (pipeline stages): Send copies `x` and returns at once
  // (MPI_Isend; so two neighbours sending to each other never deadlock);
  // Recv blocks until the message from `peer` with `tag` has arrived in x[n].
  // Messages between two ranks with one tag arrive in the order sent.
  // WaitSends waits until every send has been delivered.
  void Send(const float* x, size_t n, int peer, int tag);
  void Recv(float* x, size_t n, int peer, int tag);
  void WaitSends();
  // Rank `root`'s string to every rank.
  void Broadcast(std::string* s, int root);
  void Barrier();

 private:
  Comm(void* mpi_comm, int rank, int size);
  struct PendingSend;
  void* comm_;  // MPI_Comm, or nullptr for one rank
  int rank_, size_;
  std::vector<std::unique_ptr<PendingSend>> sends_;
};

// The grid's communicators for one rank: the world and its groups.
struct ParallelComms {
  ckpt::RankGrid grid;
  ckpt::RankCoord coord;
  Comm* world = nullptr;
  std::unique_ptr<Comm> tp, dp, pp;
  // Expert parallelism (grid.ep > 1): the ep group, which exchanges tokens,
  // and the expert-data-parallel group, which sums expert gradients
  // (ckpt::RankGrid::ExpertGroup); at ep 1 the ep group is this rank alone
  // and the expert-dp group the dp group.
  std::unique_ptr<Comm> ep, expert_dp;
};
// Checks that the world communicator has exactly grid.world_size() ranks
// (throws ckpt::Error naming both, and `where`) and makes the groups.
ParallelComms MakeParallelComms(const ckpt::RankGrid& grid, const std::string& where);

}  // namespace train

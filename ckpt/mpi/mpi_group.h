// Open MPI under the tools and the trainer: the one place that initializes
// MPI, and the WriterGroup over MPI_COMM_WORLD. Kept out of the `ckpt`
// library (its own target, ckpt_mpi) so that readers, fuzzers and tests of
// the format need no MPI.
#pragma once

#include <string>

#include "ckpt/util/writer_group.h"

namespace ckpt {

// Whether mpirun started this process as one of several (ReadMpiLaunch).
bool LaunchedAsManyRanks();

// Initializes MPI once per process when LaunchedAsManyRanks() (finalized at
// exit; errors are returned, not fatal, so callers can name them), and says
// whether MPI is running.
bool InitMpiOnce();

// The WriterGroup of every rank mpirun started (MPI_COMM_WORLD), or
// SoloGroup() when mpirun did not start several. Initializes MPI.
WriterGroup& WorldGroup();

// For libtrain's Comm, which holds its communicators as `void*` (an MPI_Comm)
// to keep MPI out of its header too:
// Throws ckpt::Error naming `what` and MPI's message unless rc is MPI_SUCCESS.
void CheckMpi(int rc, const char* what);
// Rank `root`'s *s on every rank of the communicator `mpi_comm`.
void BroadcastString(void* mpi_comm, std::string* s, int root);

}  // namespace ckpt

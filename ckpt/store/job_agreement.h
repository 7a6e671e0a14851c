// The ranks of one mpirun run one job. mpirun starts the same command on
// every rank, but nothing makes what a rank reads or writes the same: a
// different working folder, a node without the shared file system, or an
// MPMD launch (`mpirun -np 1 A : -np 1 B`) gives one rank another source,
// degree or output. Each rank would then write its share of a different
// job, and rank 0 would commit the mix. So before anything is written every
// rank checks its job against rank 0's (AgreeOnJob) and the group ends, exit
// 2, naming what differs, when any rank's differs.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/util/writer_group.h"

namespace ckpt {

// What a rank was asked to do, field by field in a fixed order ("command",
// then each option that changes the output, by its name on the command line).
using JobFields = std::vector<std::pair<std::string, std::string>>;

// An input as a job field: its path with symlinks and ".." resolved, and how
// many files and bytes it holds (a folder's whole tree, at most
// kMaxInputDepth folders deep and kMaxInputEntries entries, past which the
// field says so; a folder linked from outside the tree is counted, not
// listed), so that two ranks reading different copies under one name differ
// too. Cheap: stat calls only, no data read.
inline constexpr int kMaxInputDepth = 16;
inline constexpr int64_t kMaxInputEntries = 1000000;
std::string DescribeInput(Env* env, const std::string& path);

// An output as a job field: its resolved path. Not its contents: another
// writer may change them while the ranks look.
std::string DescribeOutput(const std::string& path);

// What `mine` (rank `rank`'s job) has that rank 0's does not: every field
// whose value differs, is missing, or is extra, with rank 0's value and this
// rank's. Empty when the jobs are the same.
std::string JobDifference(const JobFields& rank0, const JobFields& mine, int rank);

// Every rank of `group`, before any of them writes: rank 0 broadcasts its
// job; a rank whose job differs ends the group with exit 2 (FailGroup),
// saying what differs; the others wait until every rank has compared, so
// none goes on to write while a peer is about to abort. Returns when every
// rank runs rank 0's job. Alone (no mpirun), returns at once.
void AgreeOnJob(WriterGroup& group, const JobFields& mine);

}  // namespace ckpt

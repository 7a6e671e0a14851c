// A staged tag written by every rank of an MPI job through ckpt's WriterGroup
// (BeginStaged, WriteRankFiles, CommitStaged), with one rank made to fail on
// purpose, so that tests/interop/group_commit.py can time how fast its peers
// end and check that nothing looks complete. Run under mpirun:
//   group_commit_check OUT SCENARIO
// SCENARIO:
//   ok                 every rank writes one file; rank 0 commits.
//   fail_while_writing the last rank fails at once while the others write
//                      for 60 s (a long save): they must end long before.
//   fail_before_commit the last rank fails just before the commit; the
//                      others already wait in the collective.
//   commit_refused     rank 0's commit check throws after every rank wrote:
//                      every rank exits 2 and the staging folder goes.
#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include "ckpt/util/error.h"
#include "ckpt/mpi/mpi_group.h"
#include "ckpt/store/tag_writer.h"
#include "ckpt/pt/tensor.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: group_commit_check OUT SCENARIO\n";
    return 2;
  }
  const std::string out = argv[1], scenario = argv[2];
  ckpt::WriterGroup& group = ckpt::WorldGroup();
  const bool last = group.rank() == group.size() - 1;
  try {
    ckpt::Env* env = ckpt::Env::Default();
    const ckpt::StagedTag staged = ckpt::StageFor(out, "check");
    std::unique_ptr<ckpt::FileLock> writing;
    if (group.rank() == 0) writing = ckpt::PrepareTarget(env, staged, false, [](const std::string&) {});
    const std::string save_id = ckpt::BeginStaged(env, staged, group, "check");
    if (scenario == "fail_while_writing") {
      if (last) throw ckpt::Error("rank " + std::to_string(group.rank()) + " failed on purpose while its peers write");
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    ckpt::Tensor t = ckpt::Tensor::Empty(ckpt::DType::kFloat32, {4});
    for (int i = 0; i < 4; ++i) reinterpret_cast<float*>(t.mutable_data())[i] = static_cast<float>(group.rank() * 10 + i);
    char name[64];
    std::snprintf(name, sizeof name, "model/rank_%02d.pt", group.rank());
    ckpt::WriteRankFiles(env, staged.staging, group.rank(), save_id, {{name, ckpt::Value(t), {}}});
    if (scenario == "fail_before_commit" && last) {
      std::this_thread::sleep_for(std::chrono::seconds(1));  // the others are in CommitStaged's gather by now
      throw ckpt::Error("rank " + std::to_string(group.rank()) + " failed on purpose before the commit");
    }
    ckpt::CommitInfo ci;
    ci.save_id = save_id;
    ci.grid = {1, 1, group.size(), false};
    if (scenario == "commit_refused")
      ci.complete_manifest = [](const std::vector<ckpt::RankRecord>&, ckpt::Manifest&) { throw ckpt::Error("the commit check refused on purpose"); };
    ckpt::CommitStaged(env, staged, group, ci, &writing);
    return 0;
  } catch (const ckpt::Error& e) {
    return ckpt::FailGroup(group, 2, e.what());
  }
}

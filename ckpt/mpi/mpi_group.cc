#include "ckpt/mpi/mpi_group.h"

// The C API only: Open MPI otherwise pulls in its deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <climits>
#include <cstdlib>

#include "ckpt/util/error.h"
#include "ckpt/spec/rank_grid.h"

namespace ckpt {
namespace {

void FinalizeMpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

class World final : public WriterGroup {
 public:
  World() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void Broadcast(std::string* s) override { BroadcastString(MPI_COMM_WORLD, s, 0); }

  std::vector<std::string> Gather(const std::string& s) override {
    if (s.size() > INT_MAX) throw Error("MPI gather: " + std::to_string(s.size()) + " bytes is more than one message holds");
    const int n = static_cast<int>(s.size());
    std::vector<int> sizes(rank_ == 0 ? size_ : 0), offsets(sizes.size());
    CheckMpi(MPI_Gather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD), "gather");
    long long total = 0;
    for (size_t r = 0; r < sizes.size(); ++r) offsets[r] = static_cast<int>(total), total += sizes[r];
    if (total > INT_MAX) throw Error("MPI gather: " + std::to_string(total) + " bytes is more than one message holds");
    std::string all(static_cast<size_t>(total), '\0');
    CheckMpi(MPI_Gatherv(s.data(), n, MPI_CHAR, all.data(), sizes.data(), offsets.data(), MPI_CHAR, 0, MPI_COMM_WORLD), "gather");
    std::vector<std::string> out;
    for (size_t r = 0; r < sizes.size(); ++r) out.push_back(all.substr(offsets[r], sizes[r]));
    return out;
  }

  [[noreturn]] void Abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::exit(code);
  }

 private:
  int rank_ = 0, size_ = 1;
};

}  // namespace

void CheckMpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(std::string("MPI ") + what + " failed: " + std::string(text, len));
}

void BroadcastString(void* mpi_comm, std::string* s, int root) {
  const MPI_Comm comm = static_cast<MPI_Comm>(mpi_comm);
  unsigned long long n = s->size();
  CheckMpi(MPI_Bcast(&n, 1, MPI_UNSIGNED_LONG_LONG, root, comm), "broadcast");
  if (n > INT_MAX) throw Error("MPI broadcast: " + std::to_string(n) + " bytes is more than one message holds");
  s->resize(n);
  if (n) CheckMpi(MPI_Bcast(s->data(), static_cast<int>(n), MPI_CHAR, root, comm), "broadcast");
}

bool LaunchedAsManyRanks() { return ReadMpiLaunch().world_size > 1; }

bool InitMpiOnce() {
  static const bool running = [] {
    if (!LaunchedAsManyRanks()) return false;
    int provided = 0;
    // Collectives come from one thread (the tools' and the trainer's main thread); TBB workers never call MPI.
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) throw Error("MPI_Init failed");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    std::atexit(FinalizeMpi);
    return true;
  }();
  return running;
}

WriterGroup& WorldGroup() {
  if (!InitMpiOnce()) return SoloGroup();
  static World world;
  return world;
}

}  // namespace ckpt

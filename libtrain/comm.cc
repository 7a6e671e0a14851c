#include "libtrain/comm.h"

// The C API only: Open MPI otherwise pulls in its deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>

#include "ckpt/util/error.h"
#include "ckpt/mpi/mpi_group.h"

namespace train {
namespace {

MPI_Comm Handle(void* c) { return static_cast<MPI_Comm>(c); }

// MPI counts are int; larger buffers go in pieces.
constexpr size_t kMaxCount = size_t{1} << 30;

CommStats& MutableStats() {
  static CommStats stats;
  return stats;
}

// Times a collective of `floats` input floats into the stats.
class Timed {
 public:
  explicit Timed(uint64_t floats, bool recv = false) : recv_(recv), t0_(std::chrono::steady_clock::now()) {
    if (!recv) MutableStats().collective_floats += floats;
  }
  ~Timed() {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    (recv_ ? MutableStats().recv_wait_seconds : MutableStats().collective_seconds) += s;
  }

 private:
  bool recv_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

struct Comm::PendingSend {
  std::vector<float> data;
  MPI_Request request;
};

Comm::Comm(void* mpi_comm, int rank, int size) : comm_(mpi_comm), rank_(rank), size_(size) {}

Comm::~Comm() {
  // Unwinding from an error: the job is about to be aborted, and waiting on a peer (for a send,
  // or in the collective MPI_Comm_free) could block before main gets to abort it.
  if (std::uncaught_exceptions() > 0) return;
  try {
    WaitSends();
  } catch (const ckpt::Error&) {  // the job is ending anyway
  }
  if (comm_ && Handle(comm_) != MPI_COMM_WORLD) {
    MPI_Comm c = Handle(comm_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&c);
  }
}

const CommStats& Comm::Stats() { return MutableStats(); }

bool Comm::UsingMpi() { return ckpt::LaunchedAsManyRanks(); }

Comm& Comm::World() {
  static Comm* world = [] {
    if (!ckpt::InitMpiOnce()) return new Comm(nullptr, 0, 1);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    return new Comm(MPI_COMM_WORLD, rank, size);
  }();
  return *world;
}

void Comm::Abort(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

std::unique_ptr<Comm> Comm::Group(const std::vector<int>& ranks) {
  const auto me = std::find(ranks.begin(), ranks.end(), World().rank());
  const bool member = me != ranks.end();
  const int rank_in_group = static_cast<int>(me - ranks.begin());
  if (!comm_) return member ? std::unique_ptr<Comm>(new Comm(nullptr, rank_in_group, static_cast<int>(ranks.size()))) : nullptr;
  // MPI_Comm_split: the color is the group's first world rank, which names it uniquely.
  MPI_Comm out;
  ckpt::CheckMpi(MPI_Comm_split(Handle(comm_), member ? ranks.front() : MPI_UNDEFINED, member ? rank_in_group : 0, &out), "comm_split");
  if (!member) return nullptr;
  int r = 0, n = 0;
  MPI_Comm_rank(out, &r);
  MPI_Comm_size(out, &n);
  return std::unique_ptr<Comm>(new Comm(out, r, n));
}

namespace {
// An in-place all-reduce of n elements of `size` bytes, in pieces MPI's int count can hold.
void AllReduce(void* x, size_t n, size_t size, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  Timed timed(n * size / sizeof(float));  // in floats' worth
  for (size_t i = 0; i < n; i += kMaxCount)
    ckpt::CheckMpi(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(x) + i * size, static_cast<int>(std::min(kMaxCount, n - i)), type, op, comm),
          "allreduce");
}
}  // namespace

void Comm::AllReduceSum(float* x, size_t n) {
  if (size_ > 1) AllReduce(x, n, sizeof(float), MPI_FLOAT, MPI_SUM, Handle(comm_));
}

void Comm::AllReduceSum(double* x, size_t n) {
  if (size_ > 1) AllReduce(x, n, sizeof(double), MPI_DOUBLE, MPI_SUM, Handle(comm_));
}

void Comm::AllReduceMax(float* x, size_t n) {
  if (size_ > 1) AllReduce(x, n, sizeof(float), MPI_FLOAT, MPI_MAX, Handle(comm_));
}

void Comm::ReduceScatterSum(const float* in, float* out, size_t block) {
  if (size_ == 1) {
    std::copy(in, in + block, out);
    return;
  }
  if (block > kMaxCount) throw ckpt::Error("reduce-scatter block of " + std::to_string(block) + " floats is larger than MPI's count");
  Timed timed(block * size_);
  ckpt::CheckMpi(MPI_Reduce_scatter_block(in, out, static_cast<int>(block), MPI_FLOAT, MPI_SUM, Handle(comm_)), "reduce_scatter");
}

void Comm::AllGather(const float* in, float* out, size_t block) {
  if (size_ == 1) {
    std::copy(in, in + block, out);
    return;
  }
  if (block > kMaxCount) throw ckpt::Error("all-gather block of " + std::to_string(block) + " floats is larger than MPI's count");
  Timed timed(block);
  ckpt::CheckMpi(MPI_Allgather(in, static_cast<int>(block), MPI_FLOAT, out, static_cast<int>(block), MPI_FLOAT, Handle(comm_)), "allgather");
}

void Comm::AllToAll(const float* in, float* out, size_t block) {
  if (size_ == 1) {
    std::copy(in, in + block, out);
    return;
  }
  if (block > kMaxCount) throw ckpt::Error("all-to-all block of " + std::to_string(block) + " floats is larger than MPI's count");
  MutableStats().alltoall_floats += block * (size_ - 1);
  Timed timed(block * size_);
  ckpt::CheckMpi(MPI_Alltoall(in, static_cast<int>(block), MPI_FLOAT, out, static_cast<int>(block), MPI_FLOAT, Handle(comm_)), "alltoall");
}

void Comm::Send(const float* x, size_t n, int peer, int tag) {
  if (!comm_) throw ckpt::Error("internal: point-to-point send on a one-rank communicator");
  if (n > kMaxCount) throw ckpt::Error("a message of " + std::to_string(n) + " floats is larger than MPI's count");
  MutableStats().sent_floats += n;
  auto s = std::make_unique<PendingSend>();
  s->data.assign(x, x + n);
  ckpt::CheckMpi(MPI_Isend(s->data.data(), static_cast<int>(n), MPI_FLOAT, peer, tag, Handle(comm_), &s->request), "isend");
  sends_.push_back(std::move(s));
  // Deliveries that completed free their copies as we go.
  std::erase_if(sends_, [](const std::unique_ptr<PendingSend>& p) {
    int done = 0;
    MPI_Test(&p->request, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
}

void Comm::Recv(float* x, size_t n, int peer, int tag) {
  if (!comm_) throw ckpt::Error("internal: point-to-point receive on a one-rank communicator");
  if (n > kMaxCount) throw ckpt::Error("a message of " + std::to_string(n) + " floats is larger than MPI's count");
  MPI_Status st;
  {
    Timed timed(0, /*recv=*/true);
    ckpt::CheckMpi(MPI_Recv(x, static_cast<int>(n), MPI_FLOAT, peer, tag, Handle(comm_), &st), "recv");
  }
  int got = 0;
  MPI_Get_count(&st, MPI_FLOAT, &got);
  if (static_cast<size_t>(got) != n)
    throw ckpt::Error("pipeline message from rank " + std::to_string(peer) + " holds " + std::to_string(got) + " floats, not " +
                      std::to_string(n));
}

void Comm::WaitSends() {
  for (auto& s : sends_) ckpt::CheckMpi(MPI_Wait(&s->request, MPI_STATUS_IGNORE), "wait");
  sends_.clear();
}

void Comm::Broadcast(std::string* s, int root) {
  if (size_ > 1) ckpt::BroadcastString(comm_, s, root);
}

void Comm::Barrier() {
  if (size_ > 1) ckpt::CheckMpi(MPI_Barrier(Handle(comm_)), "barrier");
}

ParallelComms MakeParallelComms(const ckpt::RankGrid& grid, const std::string& where) {
  Comm& world = Comm::World();
  if (world.size() != grid.world_size())
    throw ckpt::Error(where + ": " + grid.ToString() + " needs " + std::to_string(grid.world_size()) + " processes (tp * pp * dp), but " +
                      std::to_string(world.size()) + (world.size() == 1 ? " was started" : " were started") +
                      (Comm::UsingMpi() ? " by mpirun" : " (run it under mpirun -np " + std::to_string(grid.world_size()) + ", or use train.sh)"));
  ParallelComms pc;
  pc.grid = grid;
  pc.coord = grid.CoordOf(world.rank());
  pc.world = &world;
  pc.tp = world.Group(grid.Group(world.rank(), {ckpt::Axis::kTp}));
  pc.dp = world.Group(grid.Group(world.rank(), {ckpt::Axis::kDp}));
  pc.pp = world.Group(grid.Group(world.rank(), {ckpt::Axis::kPp}));
  pc.ep = world.Group(grid.ExpertGroup(world.rank(), ckpt::ExpertAxis::kEp));
  pc.expert_dp = world.Group(grid.ExpertGroup(world.rank(), ckpt::ExpertAxis::kExpertDp));
  return pc;
}

}  // namespace train

// Google Benchmark: what checkpointing costs a training loop. A loop does a
// fixed amount of compute per step on every core; every `save_every` steps it
// takes a snapshot of ~1 GiB of model + optimizer state (CopyForSnapshot) and
// saves it through CheckpointStore, async or sync. The same loop with no
// saving, and a plain memcpy of the snapshot, run in the same process.
// Reported counters:
//   async_overhead_pct   mean step time with async saves vs no saving, in %
//                        (steps only; the wait at the end is reported apart)
//   sync_overhead_pct    the same for sync saves
//   async_final_wait_s   Finalize() at the end: waiting for the last save
//   async_block_vs_memcpy  time the loop is blocked per save (snapshot copy
//                          into pooled buffers + Save call) / a plain memcpy of
//                          the snapshot into memory already touched (the floor)
// Environment: SHARDKIT_BENCH_DIR (default /tmp), SHARDKIT_BENCH_MIB (1024).
#include <benchmark/benchmark.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "ckpt/store/checkpoint_store.h"

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int64_t EnvInt(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : dflt;
}

// Fixed compute per step on all cores (a stand-in for forward/backward).
void Compute(std::vector<float>& scratch, int64_t rounds) {
  const size_t n = scratch.size();
  tbb::parallel_for(tbb::blocked_range<size_t>(0, n, 4096), [&](const tbb::blocked_range<size_t>& r) {
    for (int64_t k = 0; k < rounds; ++k)
      for (size_t i = r.begin(); i < r.end(); ++i) scratch[i] = scratch[i] * 0.999f + std::sqrt(scratch[i] + 1.0f);
  });
}

ckpt::Value MakeState(int64_t mib) {
  ckpt::Value d = ckpt::Value::NewDict();
  const int64_t per = 64 << 20;  // 64 MiB tensors
  for (int64_t i = 0; i < (mib << 20) / per; ++i) {
    ckpt::Tensor t = ckpt::Tensor::Zeros(ckpt::DType::kFloat32, {per / 4});
    std::memset(t.mutable_data(), static_cast<int>(i), t.nbytes());
    d.as_dict().Set("p" + std::to_string(i), ckpt::Value(t));
  }
  return d;
}

struct LoopResult {
  double mean_step = 0, final_wait = 0;
  double first_block = 0, steady_block = 0;  // the first save; the mean of the others
};

// mode: 0 none, 1 sync, 2 async.
LoopResult Loop(int mode, const ckpt::Value& state, int steps, int save_every, int64_t rounds, const std::string& dir) {
  std::filesystem::remove_all(dir);
  std::vector<float> scratch(1 << 20, 1.f);
  LoopResult r;
  int saves = 0;
  double total = 0, blocked = 0;
  {
    std::unique_ptr<ckpt::CheckpointStore> store;
    auto pool = ckpt::SnapshotPool::Create();
    pool->Reserve(state);  // at start-up, outside the timed steps
    if (mode) store = std::make_unique<ckpt::CheckpointStore>(ckpt::StoreOptions{.dir = dir, .save_top_k = 2, .async = mode == 2});
    for (int step = 1; step <= steps; ++step) {
      const auto t0 = Clock::now();
      Compute(scratch, rounds);
      if (mode && step % save_every == 0) {
        const auto b0 = Clock::now();
        ckpt::Snapshot s;
        s.tag = {"bench", step, static_cast<double>(step), false};
        s.files = {{ckpt::RankFilePath(ckpt::RankFileKind::kModel, {}), ckpt::CopyForSnapshot(state, pool.get()), {}}};
        store->Save(std::move(s));
        const double b = Seconds(Clock::now() - b0);
        if (saves == 0) r.first_block = b;
        else blocked += b;
        ++saves;
      }
      total += Seconds(Clock::now() - t0);
    }
    const auto f0 = Clock::now();
    if (store) store->Finalize();
    r.final_wait = Seconds(Clock::now() - f0);
  }
  benchmark::DoNotOptimize(scratch.data());
  r.mean_step = total / steps;
  r.steady_block = saves > 1 ? blocked / (saves - 1) : r.first_block;
  return r;
}

void BM_CheckpointOverhead(benchmark::State& state) {
  const int64_t mib = EnvInt("SHARDKIT_BENCH_MIB", 1024);
  // Defaults: ~1 s steps on 2 cores, a save every 5 steps, and two steps after
  // the last save so it overlaps training as saves do mid-run.
  const int steps = static_cast<int>(EnvInt("SHARDKIT_BENCH_STEPS", 22));
  const int save_every = static_cast<int>(EnvInt("SHARDKIT_BENCH_SAVE_EVERY", 5));
  const int64_t rounds = EnvInt("SHARDKIT_BENCH_ROUNDS", 1300);
  const std::string dir = std::string(std::getenv("SHARDKIT_BENCH_DIR") ? std::getenv("SHARDKIT_BENCH_DIR") : "/tmp") + "/store_bench";
  const ckpt::Value model = MakeState(mib);
  const int reps = static_cast<int>(EnvInt("SHARDKIT_BENCH_REPS", 3));
  // This machine's timing drifts by several percent between runs, so the
  // three modes are interleaved `reps` times and each figure is the median.
  auto median = [](std::vector<LoopResult> v, auto field) {
    std::sort(v.begin(), v.end(), [&](const LoopResult& a, const LoopResult& b) { return a.*field < b.*field; });
    return v[v.size() / 2].*field;
  };
  for (auto _ : state) {
    std::vector<LoopResult> nones, asyncs, syncs;
    for (int rep = 0; rep < reps; ++rep) {
      nones.push_back(Loop(0, model, steps, save_every, rounds, dir));
      asyncs.push_back(Loop(2, model, steps, save_every, rounds, dir));
      syncs.push_back(Loop(1, model, steps, save_every, rounds, dir));
    }
    LoopResult none, async, sync;
    for (auto [out, runs] : {std::pair{&none, &nones}, std::pair{&async, &asyncs}, std::pair{&sync, &syncs}}) {
      out->mean_step = median(*runs, &LoopResult::mean_step);
      out->final_wait = median(*runs, &LoopResult::final_wait);
      out->first_block = median(*runs, &LoopResult::first_block);
      out->steady_block = median(*runs, &LoopResult::steady_block);
    }
    // A plain single-threaded memcpy of the snapshot into memory already
    // touched (best of 3): the floor for blocking.
    double memcpy_s = 1e30;
    std::vector<ckpt::Tensor> dst;
    for (const auto& [k, v] : model.as_dict().items) dst.push_back(ckpt::Tensor::Zeros(v.as_tensor().dtype(), v.as_tensor().shape()));
    for (int rep = 0; rep < 3; ++rep) {
      const auto m0 = Clock::now();
      size_t i = 0;
      for (const auto& [k, v] : model.as_dict().items) std::memcpy(dst[i++].mutable_data(), v.as_tensor().data(), v.as_tensor().nbytes());
      memcpy_s = std::min(memcpy_s, Seconds(Clock::now() - m0));
      benchmark::DoNotOptimize(dst.data());
    }
    state.counters["step_s_none"] = none.mean_step;
    state.counters["step_s_async"] = async.mean_step;
    state.counters["step_s_sync"] = sync.mean_step;
    state.counters["async_overhead_pct"] = 100 * (async.mean_step / none.mean_step - 1);
    state.counters["sync_overhead_pct"] = 100 * (sync.mean_step / none.mean_step - 1);
    state.counters["async_final_wait_s"] = async.final_wait;
    state.counters["block_s_async_first"] = async.first_block;
    state.counters["block_s_async"] = async.steady_block;
    state.counters["block_s_sync"] = sync.steady_block;
    state.counters["memcpy_s"] = memcpy_s;
    state.counters["async_block_vs_memcpy"] = async.steady_block / memcpy_s;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace

BENCHMARK(BM_CheckpointOverhead)->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();
BENCHMARK_MAIN();

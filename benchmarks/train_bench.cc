// Google Benchmark: training-step throughput of the training core (forward,
// backward, AdamW) for a model picked by SHARDKIT_BENCH_MODEL (tiny: the
// default config's model; 100m: ~110M parameters; mixtral: a small Mixtral,
// 8 experts, top 2) and activation recompute
// SHARDKIT_BENCH_RECOMPUTE ("", selective, full), on SHARDKIT_BENCH_THREADS threads. Counters: tokens_per_s,
// activations_MiB (held for backward) and max_rss_MiB (the process's peak).
// benchmarks/train_tokens.py and train_moe.py run PyTorch on the same model and batch.
#include <benchmark/benchmark.h>
#include <sys/resource.h>
#include <tbb/global_control.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "libtrain/model.h"
#include "libtrain/optimizer.h"

namespace {

struct Shape {
  train::ModelConfig model;
  int64_t batch, seq;
};

Shape Pick() {
  const char* m = std::getenv("SHARDKIT_BENCH_MODEL");
  Shape s;
  if (m && std::string(m) == "mixtral") {  // benchmarks/train_moe.py: a small Megatron-style Mixtral, dropless
    s.model.vocab = 264, s.model.hidden = 128, s.model.ffn = 256, s.model.heads = 4, s.model.kv_heads = 4, s.model.layers = 4;
    s.model.experts = 8, s.model.moe_top_k = 2, s.model.capacity_factor = 0, s.model.router_aux_loss_coef = 0.02;
    s.batch = 4, s.seq = 128;
  } else if (m && std::string(m) == "100m") {
    s.model.vocab = 32000, s.model.hidden = 768, s.model.ffn = 2048, s.model.heads = 12, s.model.kv_heads = 12, s.model.layers = 12;
    s.batch = 1, s.seq = 256;
  } else {  // conf/tiny_llama.yaml
    s.model.vocab = 264, s.model.hidden = 64, s.model.ffn = 172, s.model.heads = 4, s.model.kv_heads = 4, s.model.layers = 2;
    s.batch = 4, s.seq = 64;
  }
  const char* r = std::getenv("SHARDKIT_BENCH_RECOMPUTE");
  s.model.recompute = r ? r : "";
  return s;
}

void BM_TrainStep(benchmark::State& state) {
  const Shape s = Pick();
  // SHARDKIT_BENCH_THREADS caps TBB's workers (the torch side's set_num_threads); unset: TBB's default.
  std::unique_ptr<tbb::global_control> threads;
  if (const char* n = std::getenv("SHARDKIT_BENCH_THREADS"))
    threads = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism, std::atoi(n));
  train::Model m(s.model);
  m.InitWeights();
  train::AdamW opt(m, {});
  std::mt19937 rng(1);
  std::vector<int32_t> tokens(s.batch * s.seq), targets(s.batch * s.seq);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % s.model.vocab);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % s.model.vocab);
  size_t act = 0;
  for (auto _ : state) {
    m.ZeroGrad();
    benchmark::DoNotOptimize(m.Forward(tokens.data(), targets.data(), s.batch, s.seq));
    act = m.activation_bytes();
    m.Backward();
    opt.ReduceAndClip(m, 1.0, 1.0);
    opt.Step(m, 1e-4);
  }
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(s.batch * s.seq), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["activations_MiB"] = static_cast<double>(act) / (1 << 20);
  state.counters["max_rss_MiB"] = static_cast<double>(ru.ru_maxrss) / 1024;
  int64_t params = 0;
  for (const auto& p : m.layout()) params += m.param(p.name).numel();
  state.counters["params_M"] = static_cast<double>(params) / 1e6;
}

}  // namespace

BENCHMARK(BM_TrainStep)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(8.0);
BENCHMARK_MAIN();

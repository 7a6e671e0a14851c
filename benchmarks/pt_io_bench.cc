// Google Benchmark: SavePt and LoadPt (+ touching every byte with XXH3) of a
// checkpoint of many tensors. Size and directory come from the environment
// (SHARDKIT_BENCH_MIB, SHARDKIT_BENCH_DIR) so benchmarks/pt_io.py can run
// torch and cp on the same content in the same run and report ratios.
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <random>

#include "ckpt/pt/pt_file.h"

namespace {

int64_t EnvInt(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : dflt;
}

std::string Path() {
  const char* d = std::getenv("SHARDKIT_BENCH_DIR");
  return std::string(d ? d : "/tmp") + "/ours.pt";
}

// Llama-like mix: large bf16/fp32 matrices plus many small norm vectors.
const ckpt::Value& Content() {
  static const ckpt::Value root = [] {
    const int64_t total = EnvInt("SHARDKIT_BENCH_MIB", 2048) << 20;
    ckpt::Value d = ckpt::Value::NewDict();
    std::mt19937_64 rng(0);
    int64_t bytes = 0;
    for (int i = 0; bytes < total; ++i) {
      const bool big = i % 4 != 3;
      ckpt::Tensor t = ckpt::Tensor::Zeros(big ? ckpt::DType::kFloat32 : ckpt::DType::kBFloat16,
                                           big ? std::vector<int64_t>{1024, 2048} : std::vector<int64_t>{4096});
      auto* p = reinterpret_cast<uint64_t*>(t.mutable_data());
      for (size_t k = 0; k < t.nbytes() / 8; ++k) p[k] = rng();
      bytes += t.nbytes();
      d.as_dict().Set("layers." + std::to_string(i) + ".weight", ckpt::Value(t));
    }
    return d;
  }();
  return root;
}

// Same starting state for every timed run, as benchmarks/pt_io.py does for
// torch and cp: no target file, nothing dirty, page cache dropped (when
// permitted), then optionally the input read once so it is cached.
void Settle(bool remove_target, bool warm_input) {
  if (remove_target) std::remove(Path().c_str());
  ::sync();
  if (FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w")) {
    std::fputs("3", f);
    std::fclose(f);
  }
  if (warm_input) {
    auto m = ckpt::Env::Default()->MapFile(Path());
    benchmark::DoNotOptimize(XXH3_64bits(m->data(), m->size()));
  }
}

void BM_SavePt(benchmark::State& state) {
  const ckpt::Value& v = Content();
  for (auto _ : state) {
    state.PauseTiming();
    Settle(true, false);
    state.ResumeTiming();
    ckpt::SavePt(Path(), v);
  }
  state.SetBytesProcessed(state.iterations() * ckpt::Env::Default()->FileSize(Path()));
}

void BM_LoadPtTouchAll(benchmark::State& state) {
  uint64_t bytes = 0;
  for (auto _ : state) {
    state.PauseTiming();
    Settle(false, true);
    state.ResumeTiming();
    ckpt::Value v = ckpt::LoadPt(Path());
    uint64_t h = 0;
    bytes = 0;
    for (const auto& [k, t] : v.as_dict().items) {
      const auto& s = t.as_tensor().storage();
      h ^= XXH3_64bits(s->data(), s->nbytes());
      bytes += s->nbytes();
    }
    benchmark::DoNotOptimize(h);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

}  // namespace

BENCHMARK(BM_SavePt)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LoadPtTouchAll)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_MAIN();

// Writes checkpoints in a loop through CheckpointStore, for the SIGKILL fault
// tests: ckpt_store_stress DIR ASYNC(0|1) STEPS SEED. Prints "saved TAG" (one
// line, flushed) when a tag is committed, so the killer knows what was
// complete before the kill. Like a restarted job, it resumes after the newest
// complete checkpoint in DIR.
#include <cstdio>
#include <filesystem>
#include <string>

#include "ckpt/store/checkpoint_store.h"
#include "ckpt/testing/test_util.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: ckpt_store_stress DIR ASYNC STEPS SEED\n");
    return 2;
  }
  ckpt::StoreOptions o;
  o.dir = argv[1];
  o.async = std::string(argv[2]) == "1";
  o.save_top_k = 3;
  o.log = [](const std::string& line) {
    if (line.rfind("checkpoint: saved ", 0) == 0) {
      std::printf("saved %s\n", line.substr(18).c_str());
      std::fflush(stdout);
    }
  };
  const int steps = std::stoi(argv[3]);
  const uint64_t seed = std::stoull(argv[4]);
  try {
    int64_t first = 1;
    if (auto tag = ckpt::ResolveResume(o.env, o.dir, {.resume_if_exists = true, .resume_ignore_no_checkpoint = true}, nullptr))
      first = ckpt::ParseTagName(std::filesystem::path(*tag).filename().string())->step + 1;
    ckpt::CheckpointStore store(o);
    for (int64_t step = first; step < first + steps; ++step)
      store.Save(ckpt::testing::MakeSnapshot("stress", step, {2, 2, 2, true}, 64 * 1024, seed));
    store.Finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_store_stress: %s\n", e.what());
    return 1;
  }
  return 0;
}

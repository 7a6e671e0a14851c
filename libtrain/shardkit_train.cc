// shardkit-train CONFIG.yaml [key=value ...]: trains the Llama-style decoder
// described by an NxDT config on one process, checkpointing in NxDT's layout
// and resuming by itself (exp_manager.resume_if_exists).
#include <iostream>
#include <string>
#include <vector>

#include "ckpt/error.h"
#include "ckpt/resume.h"
#include "libtrain/trainer.h"
#include "migrate/yaml_tree.h"

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::cerr << "usage: shardkit-train CONFIG.yaml [key=value | +key=value | ~key ...]\n";
    return argc < 2 ? 2 : 0;
  }
  std::vector<std::string> overrides(argv + 2, argv + argc);
  try {
    const train::TrainConfig c = train::LoadTrainConfig(argv[1], overrides);
    const auto log = [](const std::string& l) { std::cerr << "shardkit-train: " << l << "\n"; };
    log("run directory " + c.RunDir());
    const train::TrainResult r = train::RunTraining(c, log);
    log("done: steps " + std::to_string(r.start_step) + " -> " + std::to_string(r.end_step) +
        (r.losses.empty() ? "" : ", loss " + std::to_string(r.losses.front()) + " -> " + std::to_string(r.losses.back())));
    return 0;
  } catch (const ckpt::DamagedCheckpoints& e) {  // nothing to resume from, and nothing was touched
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return 2;
  } catch (const migrate::InputError& e) {
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return 2;
  } catch (const ckpt::Error& e) {
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "shardkit-train: out of memory building or training this model; check the model sizes in " << argv[1] << "\n";
    return 1;
  } catch (const std::exception& e) {  // a library's own error: still a message and an exit code, never an abort
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return 1;
  }
}

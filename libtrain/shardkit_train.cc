// shardkit-train [--world_size] CONFIG.yaml [key=value ...]: trains the Llama-style decoder
// described by an NxDT config, checkpointing in NxDT's layout and resuming by
// itself (exp_manager.resume_if_exists). One process, or under
// `mpirun -np tp*pp*dp` one rank each (train.sh starts it so). --world_size
// prints the number of processes the config asks for and exits.
//
// A rank that fails reports and ends the whole job (Comm::Abort), so no peer
// waits in a collective it will never complete.
#include <tbb/global_control.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <thread>
#include <string>
#include <vector>

#include "ckpt/util/error.h"
#include "ckpt/store/resume.h"
#include "libtrain/comm.h"
#include "libtrain/train_config.h"
#include "libtrain/trainer.h"
#include "migrate/yaml_tree.h"

namespace {
int Exit(int code) {
  if (code != 0 && train::Comm::UsingMpi()) train::Comm::Abort(code);
  return code;
}
}  // namespace

int main(int argc, char** argv) {
  const bool print_world = argc > 1 && std::string(argv[1]) == "--world_size";
  if (print_world) --argc, ++argv;
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::cerr << "usage: shardkit-train [--world_size] CONFIG.yaml [key=value | +key=value | ~key ...]\n"
                 "  under mpirun -np (trainer.devices * trainer.num_nodes) for parallel training; train.sh does that\n";
    return argc < 2 ? 2 : 0;
  }
  std::vector<std::string> overrides(argv + 2, argv + argc);
  try {
    const train::TrainConfig c = train::LoadTrainConfig(argv[1], overrides);
    if (print_world) {
      std::cout << c.grid.world_size() << "\n";
      return 0;
    }
    const auto log = [](const std::string& l) { std::cerr << "shardkit-train: " << l << "\n"; };
    // Oversubscribed (more ranks than cores, as in tests on 2 cores): one compute thread per rank.
    const ckpt::MpiLaunch launch = ckpt::ReadMpiLaunch();
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");  // ranks on this node
    const int here = local && std::atoi(local) > 0 ? std::atoi(local) : launch.world_size;
    const size_t threads = here >= static_cast<int>(cores) ? 1 : cores / here;
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
    if (launch.rank == 0) log("run directory " + c.RunDir());
    const train::TrainResult r = train::RunTraining(c, log);
    if (launch.rank == 0) log("done: steps " + std::to_string(r.start_step) + " -> " + std::to_string(r.end_step) +
        (r.losses.empty() ? "" : ", loss " + std::to_string(r.losses.front()) + " -> " + std::to_string(r.losses.back())));
    return 0;
  } catch (const ckpt::DamagedCheckpoints& e) {  // nothing to resume from, and nothing was touched
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return Exit(2);
  } catch (const train::ConfigError& e) {  // the config asks for what is wrong or not implemented
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return Exit(2);
  } catch (const migrate::InputError& e) {
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return Exit(2);
  } catch (const ckpt::Error& e) {
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return Exit(1);
  } catch (const std::bad_alloc&) {
    std::cerr << "shardkit-train: out of memory building or training this model; check the model sizes in " << argv[1] << "\n";
    return Exit(1);
  } catch (const std::exception& e) {  // a library's own error: still a message and an exit code, never an abort
    std::cerr << "shardkit-train: " << e.what() << "\n";
    return Exit(1);
  }
}

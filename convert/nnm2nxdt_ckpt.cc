// nnm2nxdt-ckpt: converts an NNM checkpoint to an NxDT tag with its
// optimizer state, LR schedule and step (convert/converter.h). Takes NxDT's
// converter arguments as they are:
//   nnm2nxdt-ckpt --tp 8 --pp 4 --n_layers 32 --nnm_ckpt_path A --nxdt_ckpt_path B
// plus --checkpoint_dir, --checkpoint_name, --weights_only, --save_xser,
// --dry_run, --overwrite, --threads, --optimizer_groups and --require_optimizer. Under mpirun the ranks split the files.
// --tp/--pp other than the checkpoint's convert and re-cut in one pass; the
// model format then comes from the checkpoint's hyper_parameters, else from
// --nnm_config, --model_config or --heads and its kin (tools/format_hints_cli.h).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <thread>

#include "ckpt/mpi/mpi_group.h"
#include "tools/common/cli.h"
#include "tools/common/job_cli.h"
#include "tools/common/threads.h"
#include "ckpt/shard/reshard.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/util/progress.h"
#include "convert/converter.h"
#include "convert/nnm_convert.h"
#include "tools/format_hints_cli.h"

namespace {

// NxDT's converter declares its booleans with argparse type=bool, so "False"
// turns them on; here True/False/1/0/yes/no/on/off mean what they say.
std::optional<bool> ParseBool(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "true" || s == "1" || s == "yes" || s == "on" || s == "y" || s == "t") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off" || s == "n" || s == "f") return false;
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Convert an NNM checkpoint to an NxDT tag, optimizer state, LR schedule and step included"};
  convert::ConverterArgs a;
  std::string parallel = "True";
  int processes = 0, threads = 0;
  app.add_option("--nnm_ckpt_path", a.nnm_ckpt_path, "NNM checkpoint: a rank-folder tree or a single file")->required();
  app.add_option("--nxdt_ckpt_path", a.nxdt_ckpt_path, "the output tag folder (for exp_manager.resume_from_checkpoint)");
  app.add_option("--checkpoint_dir", a.checkpoint_dir,
                 "instead: create <name>--step=S-consumed_samples=C.ckpt in this folder, where auto-resume finds it");
  app.add_option("--tp", a.tp, "the output's tensor-parallel degree (default: the checkpoint's; another is converted and re-cut in one pass)")
      ->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--pp", a.pp, "the output's pipeline-parallel degree (default: the checkpoint's; another is converted and re-cut in one pass)")
      ->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--pipeline_cuts", a.pipeline_cuts, "with another --pp: the first layer of each stage after the first, e.g. 1,3 (default: NxD's even split)")
      ->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks))
      ->delimiter(',');
  app.add_flag("--trust_first_replica", a.trust_first_replica,
               "read replicated tensors (norms on every tp rank) from tp rank 0; without it, copies that differ are refused at other "
               "degrees and written as mapped at the checkpoint's own");
  std::string budget;
  app.add_option("--memory_budget", budget, "memory the reshard engine may use, e.g. 512M (default 512M)");
  tools::FormatHintOptions hint_opts;
  hint_opts.AddTo(app);
  app.add_option("--nnm_config", hint_opts.config, "the NNM job's YAML (its model: num_attention_heads, num_kv_heads, ...), for a checkpoint "
                 "without hyper_parameters.cfg; checked against the tensors")
      ->excludes("--config");
  app.add_option("--n_layers", a.n_layers, "number of layers (checked against the checkpoint)")->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--checkpoint_name", a.checkpoint_name, "the file to convert when a rank folder holds several");
  app.add_option("--enable_parallel_processing", parallel, "True/False (default True)");
  app.add_option("--num_parallel_processes", processes, "parallel workers (NxDT's name for --threads)")->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--threads", threads, "worker threads (default: every core)")->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_flag("--weights_only", a.weights_only, "convert the model weights only, as NxDT's converter does");
  app.add_flag("--save_xser", a.save_xser, "write the xser container (X.pt, X.pt.tensors/, X.pt.info.pt)");
  bool no_save_xser = false;
  app.add_flag("--no_save_xser", no_save_xser, "write plain .pt files (the default)")->excludes("--save_xser");
  app.add_flag("--dry_run", a.dry_run, "print the plan (files, keys, renames, bytes) and write nothing");
  app.add_flag("--overwrite", a.overwrite, "replace a non-empty output tag (kept until the new one is complete)");
  app.add_flag("--require_optimizer", a.require_optimizer, "fail (exit 2) when the input holds no optimizer state");
  std::string groups = "keep";
  app.add_option("--optimizer_groups", groups,
                 "keep: decay exactly what NNM decayed, or fail when NxDT cannot (NNM's GPT, whose LayerNorm weights did not decay); "
                 "nxdt: regroup as NxDT's megatron models group (NeMo's rule: only biases apart, model.do_layer_norm_weight_decay False). "
                 "The manifest records the grouping written")
      ->check(CLI::IsMember({"keep", "nxdt"}));
  SHARDKIT_PARSE(app, argc, argv);

  a.nxdt_optimizer_groups = groups == "nxdt";
  auto log = [](const std::string& s) { std::cerr << s << std::endl; };
  try {
    a.hints = hint_opts.Hints();
    if (!budget.empty()) a.memory_budget = ckpt::ParseSize(budget, "--memory_budget");
  } catch (const ckpt::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  const auto enabled = ParseBool(parallel);
  if (!enabled) {
    std::cerr << "error: --enable_parallel_processing: '" << parallel << "' is not a boolean (True/False/1/0/yes/no)\n";
    return 2;
  }
  int workers = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!*enabled) workers = 1;
  else if (threads) workers = threads;
  else if (processes) workers = std::min(workers, processes);
  a.threads = workers;

  // mpirun (Open MPI / PMIx) tells each process its rank and the job.
  a.group = &ckpt::WorldGroup();
  a.progress_bar = ::isatty(2) && a.group->rank() == 0;
  try {
    // Every rank runs rank 0's job, or none writes (ckpt/store/job_agreement.h).
    ckpt::AgreeOnJob(*a.group, tools::JobOf(app,
                                            {.command = "nnm2nxdt-ckpt",
                                             .inputs = {"--nnm_ckpt_path", "--nnm_config", "--model_config", "--config"},
                                             .outputs = {"--nxdt_ckpt_path", "--checkpoint_dir"},
                                             .not_in_output = {"--threads", "--num_parallel_processes", "--enable_parallel_processing",
                                                               "--memory_budget"}},
                                            ckpt::Env::Default()));
    const auto s = tools::WithThreads(a.threads, [&] { return convert::RunConversion(a, ckpt::Env::Default(), log); });
    if (a.dry_run) return 0;
    char line[512];
    std::snprintf(line, sizeof line, "converted %d input files -> %d files, %lld tensors, %s in %.2f s (%s/s); peak memory %s of the %s budget",
                  s.inputs, s.files, static_cast<long long>(s.tensors), ckpt::HumanBytes(s.bytes).c_str(), s.seconds,
                  ckpt::HumanBytes(static_cast<uint64_t>(static_cast<double>(s.bytes) / std::max(s.seconds, 1e-9))).c_str(),
                  ckpt::HumanBytes(ckpt::PeakRss()).c_str(), ckpt::HumanBytes(a.memory_budget).c_str());
    if (a.group->size() > 1) log("rank " + std::to_string(a.group->rank()) + ": " + line);
    else log(line);
    if (a.group->rank() == 0) log("NxDT checkpoint: " + s.tag_dir);
    return 0;
  } catch (const convert::MissingOptimizerState& e) {
    return ckpt::FailGroup(*a.group, 2, e.what());
  } catch (const ckpt::Error& e) {  // bad input: names the file and key
    return ckpt::FailGroup(*a.group, 2, e.what());
  } catch (const std::exception& e) {  // anything unexpected (a library's own error)
    return ckpt::FailGroup(*a.group, 1, e.what());
  }
}

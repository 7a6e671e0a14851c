// The command line of the tools that write a checkpoint in a chosen layout:
//   ckpt-reshard SRC DST --tp N --pp M [--dp K] [--zero1|--no-zero1] ...:
//     re-lays a checkpoint tag for other parallel degrees, optimizer state
//     included, streaming in bounded memory (tools/reshard.h);
//   ckpt-import IN.h5 DST --tp N --pp M ...: the same from a ckpt-export
//     file (tools/h5_state.h); its output equals ckpt-reshard's;
//   ckpt-import --format hf DIR DST --tp N --pp M ...: from a Hugging Face
//     model folder (tools/hf_state.h), weights only.
// Exit 0 on success, 2 for bad input or a failed check (the message names
// the file, key or degree), 1 for anything unexpected.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "ckpt/mpi/mpi_group.h"
#include "tools/common/cli.h"
#include "tools/common/job_cli.h"
#include "tools/common/threads.h"
#include "ckpt/util/error.h"
#include "ckpt/spec/rank_grid.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/util/progress.h"
#include "ckpt/spec/model_family.h"
#include "tools/format_hints_cli.h"
#include "tools/h5_state.h"
#include "tools/hf_state.h"
#include "tools/all_sources.h"
#include "tools/layout_cli.h"
#include "ckpt/shard/reshard.h"

namespace {


nlohmann::ordered_json GridJson(const ckpt::RankGrid& g, const std::vector<int64_t>& bounds, int virtual_stages) {
  nlohmann::ordered_json j = {{"tp", g.tp}, {"pp", g.pp}, {"dp", g.dp}, {"zero1", g.zero1}, {"pipeline_cuts", ckpt::CutsOf(bounds)}};
  if (g.ep > 1) j["ep"] = g.ep;
  if (virtual_stages > 1) j["virtual_pipeline_size"] = virtual_stages;
  return j;
}

}  // namespace

namespace tools {

ckpt::ReshardSummary RunImport(const ckpt::ReshardArgs& args, bool hf, const ckpt::SourceOptions& o, ckpt::Env* env, const ckpt::LogFn& log) {
  const auto t0 = std::chrono::steady_clock::now();
  ckpt::ReshardArgs a = args;
  a.tool = "import";
  ckpt::ReshardSummary sum;
  sum.src_tag = ckpt::WithoutTrailingSeparators(a.src);
  if (!hf && (!env->Exists(a.src) || env->IsDirectory(a.src))) throw ckpt::Error(a.src + ": no such file (IN is a ckpt-export .h5 file)");
  const ckpt::OpenedSource src = AllSources().Open(env, hf ? sum.src_tag : a.src, o, hf ? "hf" : "h5");
  sum.bytes_read = src.bytes;
  return ckpt::WriteInLayout(*src.state, src.tag_name, a, env, log, t0, std::move(sum));
}

int LayoutMain(int argc, char** argv, LayoutSource source) {
  const bool h5 = source == LayoutSource::kExport;
  CLI::App app{h5 ? "Write a ckpt-export HDF5 file as a checkpoint tag in any tensor, pipeline and data parallel layout"
                  : "Re-lay a checkpoint for other tensor, pipeline and data parallel degrees, optimizer state included"};
  ckpt::ReshardArgs a;
  int dp = 0, ep = 0;
  bool zero1 = false, no_zero1 = false, json = false, no_verify = false, save_xser = false, no_save_xser = false;
  std::string budget = "512M", cuts;
  FormatHintOptions hints;
  int64_t out_kv = 0;
  std::string out_backend;
  std::optional<bool> out_fuse, out_qkv_linear;
  std::string out_family;
  a.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("src", a.src, h5 ? "a file ckpt-export wrote" : "a checkpoint tag, or a checkpoint folder (its newest complete tag is taken)")->required();
  app.add_option("dst", a.dst, "the new tag folder");
  app.add_option("--checkpoint_dir", a.checkpoint_dir, "instead of DST: create the tag here, named as the trainer names it, for auto-resume");
  app.add_option("--tp", a.tp, "target tensor-parallel degree")->required()->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--pp", a.pp, "target pipeline-parallel degree")->required()->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--dp", dp, "target data-parallel degree (default: the source's)")->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--ep", ep, "target expert-parallel degree of an MoE (Mixtral) model, inside dp as NxD lays it out (default: the source's)")
      ->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_flag("--zero1", zero1, "write ZeRO-1 optimizer files, one per dp rank");
  app.add_flag("--no-zero1", no_zero1, "write one plain optimizer file per stage");
  app.add_option("--pipeline_cuts", cuts, "first layer of stages 1..pp-1 (default: NxD's even split, remainder last)");
  app.add_option("--virtual_pipeline_size", a.virtual_pipeline_size,
                 "NxD's virtual pipeline stages per pp rank: pp rank p holds stages p, p + pp, ... of pp x this many (--pipeline_cuts "
                 "then cuts all of them); default: the source's when --pp is the source's and no cuts are given, else 1")
      ->check(CLI::Range(int64_t{1}, ckpt::kMaxRanks));
  app.add_option("--memory_budget", budget, "peak memory to stay within (default 512M)");
  app.add_option("--threads", a.threads, "files written at once (default: every core)")->check(CLI::Range(1, 1024));
  app.add_flag("--dry_run", a.dry_run, "print the plan and write nothing");
  app.add_flag("--save_xser", save_xser, "write rank files as xser, as NxD's use_xser does (X.pt, X.pt.tensors/, X.pt.info.pt)");
  app.add_flag("--no_save_xser", no_save_xser, std::string("write plain .pt rank files") + (h5 ? " (the default)" : ""));
  app.add_flag("--overwrite", a.overwrite, "replace an existing target tag (kept until the new one is complete)");
  app.add_flag("--json", json, "print the summary as JSON on stdout");
  std::string format = "h5";
  int64_t divisible = 128;
  std::string model_source = "megatron";
  ckpt::SourceOptions import;  // an HF folder's: make_vocab_size_divisible_by, fuse_qkv and qkv_linear go in its hints
  bool fuse_qkv = true, qkv_linear = false;
  if (!h5) {  // an export records its model format and fingerprints
    app.add_flag("--no_verify", no_verify, "skip checking the source's checksums first");
    app.add_flag("--weights_only", a.weights_only,
                 "read the model only and write no optimizer state (the way past an optimizer that cannot be read, such as "
                 "the one-shard ZeRO-1 state NxDT saves at dp > 1)");
    hints.AddTo(app);
    app.add_option("--out_kv_size_multiplier", out_kv, "HF-style tags: the target's kv_size_multiplier (default: the source's)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--out_hw_backend", out_backend, "HF-style tags: the target's KV replication rule (default: the source's)")
        ->check(CLI::IsMember({"trn1", "trn2"}));
    app.add_option("--out_fuse_qkv", out_fuse, "HF-style tags: true or false, NxDT's model.fuse_qkv for the target (default: the source's)");
    app.add_option("--out_qkv_linear", out_qkv_linear, "HF-style tags: true or false, NxDT's model.qkv_linear for the target (default: the source's)");
    app.add_option("--out_model_family", out_family,
                   "megatron (NNM and NxDT megatron names) or hf_llama (NxDT's model_source: hf): write the weights in the other family")
        ->check(CLI::IsMember({"megatron", "hf_llama"}));
    app.add_flag("--trust_first_replica", a.trust_first_replica,
                 "read replicated tensors (norms, replicated KV heads) from their first holder without comparing the other copies");
  } else {
    app.add_option("--format", format, "h5: a ckpt-export file; hf: a Hugging Face model folder (weights only)")
        ->check(CLI::IsMember({"h5", "hf"}));
    app.add_option("--make_vocab_size_divisible_by", divisible, "with --format hf: the vocabulary padding rule (NxDT's default 128)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    // The HF-style family: what NxD's checkpoint_converter.py --convert_from_full_state writes, named as NxDT's config names it.
    app.add_option("--model_source", model_source, "with --format hf: megatron (NNM/NxDT megatron names, the default) or hf (NxDT's model_source: hf)")
        ->check(CLI::IsMember({"megatron", "hf"}));
    app.add_option("--model_config", import.model_config, "with --format hf: the config.json of a single weights file SRC (checkpoint.pt, pytorch_model.bin)");
    app.add_option("--fuse_qkv", fuse_qkv, "--model_source hf: NxDT's model.fuse_qkv, true or false (default true)");
    app.add_option("--qkv_linear", qkv_linear, "--model_source hf: NxDT's model.qkv_linear, true or false (default false)");
    app.add_option("--kv_size_multiplier", out_kv, "--model_source hf: NxDT's distributed_strategy.kv_replicator (default 1)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--hw_backend", out_backend, "--model_source hf: trn1 (the default) or trn2, which replicate KV heads differently")
        ->check(CLI::IsMember({"trn1", "trn2"}));
  }
  SHARDKIT_PARSE(app, argc, argv);
  if (zero1 && no_zero1) {
    std::cerr << "error: --zero1 and --no-zero1 exclude each other\n";
    return 2;
  }
  if (zero1 || no_zero1) a.zero1 = zero1;
  if (save_xser && no_save_xser) {
    std::cerr << "error: --save_xser and --no_save_xser exclude each other\n";
    return 2;
  }
  if (save_xser || no_save_xser) a.save_xser = save_xser;
  if (dp) a.dp = dp;
  if (ep) a.ep = ep;
  if (out_kv) a.out_kv_size_multiplier = out_kv;
  if (!out_backend.empty()) a.out_hw_backend = ckpt::ParseBackend(out_backend);
  import.hints.make_vocab_size_divisible_by = divisible;
  import.hints.fuse_qkv = fuse_qkv, import.hints.qkv_linear = qkv_linear;
  if (model_source == "hf") {
    if (format != "hf") {
      std::cerr << "error: --model_source hf needs --format hf\n";
      return 2;
    }
    import.family = ckpt::ModelFamily::kHfLlama;
    if (!a.out_hw_backend) a.out_hw_backend = ckpt::HwBackend::kTrn1;  // NxD's rule for every backend but Trn2
  } else if (h5 && (out_kv || !out_backend.empty())) {
    std::cerr << "error: --kv_size_multiplier and --hw_backend apply to --model_source hf\n";
    return 2;
  }
  a.out_fuse_qkv = out_fuse, a.out_qkv_linear = out_qkv_linear;
  if (!out_family.empty()) a.out_model_family = ckpt::ParseFamily(out_family);
  a.verify_source = !no_verify;
  a.keep_virtual_stages = true;
  a.group = &ckpt::WorldGroup();  // under mpirun the ranks split the files
  a.progress_bar = ::isatty(2) && a.group->rank() == 0 && !json;
  auto log = [](const std::string& s) { std::cerr << s << std::endl; };
  try {
    // Every rank runs rank 0's job, or none writes (ckpt/store/job_agreement.h).
    ckpt::AgreeOnJob(*a.group, JobOf(app,
                                     {.command = h5 ? "ckpt-import" : "ckpt-reshard",
                                      .inputs = {"src", "--model_config", "--config"},
                                      .outputs = {"dst", "--checkpoint_dir"},
                                      .not_in_output = {"--threads", "--memory_budget", "--json"}},
                                     ckpt::Env::Default()));
    a.hints = hints.Hints();
    a.memory_budget = ckpt::ParseSize(budget, "--memory_budget");
    for (size_t at = 0; !cuts.empty() && at <= cuts.size();) {
      const size_t comma = std::min(cuts.find(',', at), cuts.size());
      const std::string item = cuts.substr(at, comma - at);
      if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 9)
        throw ckpt::Error("--pipeline_cuts '" + cuts + "': '" + item + "' is not a layer number");
      a.pipeline_cuts.push_back(std::stoll(item));
      at = comma + 1;
    }
    const ckpt::ReshardSummary s = WithThreads(a.threads, [&] {
      return h5 ? RunImport(a, format == "hf", import, ckpt::Env::Default(), log) : ckpt::RunReshard(a, ckpt::Env::Default(), log);
    });
    const double rate = static_cast<double>(s.bytes_written) / std::max(s.seconds, 1e-9);
    if (json && a.group->rank() == 0) {
      nlohmann::ordered_json j = {{"source", s.src_tag},
                                  {"target", s.dst_tag},
                                  {"dry_run", a.dry_run},
                                  {"from", GridJson(s.from, s.from_bounds, s.from_virtual_stages)},
                                  {"to", GridJson(s.to, s.to_bounds, s.to_virtual_stages)},
                                  {"model", s.format.ToJson()},
                                  {"files", s.files},
                                  {"bytes_read", s.bytes_read},
                                  {"bytes_written", s.bytes_written},
                                  {"seconds", s.seconds},
                                  {"peak_rss", s.peak_rss},
                                  {"memory_budget", a.memory_budget},
                                  {"stream_chunk", s.stream_chunk},
                                  {"notes", s.notes}};
      std::cout << j.dump(1) << std::endl;
    }
    if (!a.dry_run) {
      char line[512];
      std::snprintf(line, sizeof line, "wrote %d files, %s in %.2f s (%s/s); peak memory %s of the %s budget (streamed in %s chunks: no tensor is held whole)",
                    s.files, ckpt::HumanBytes(s.bytes_written).c_str(), s.seconds, ckpt::HumanBytes(static_cast<uint64_t>(rate)).c_str(),
                    ckpt::HumanBytes(s.peak_rss).c_str(), ckpt::HumanBytes(a.memory_budget).c_str(), ckpt::HumanBytes(s.stream_chunk).c_str());
      log(a.group->size() > 1 ? "rank " + std::to_string(a.group->rank()) + ": " + line : std::string(line));
      if (a.group->rank() == 0) log((h5 ? "imported checkpoint: " : "resharded checkpoint: ") + s.dst_tag);
    }
    return 0;
  } catch (const ckpt::Error& e) {
    return ckpt::FailGroup(*a.group, 2, e.what());
  } catch (const std::exception& e) {
    return ckpt::FailGroup(*a.group, 1, e.what());
  }
}

}  // namespace tools

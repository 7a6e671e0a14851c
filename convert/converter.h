// Running one NNM -> NxDT conversion: find the NNM files, load them (mapped,
// in parallel), plan the mapping (nnm_convert.h), then write the tag through
// the checkpoint store's commit protocol (tag_writer.h):
//   - the tag is written in a staging folder beside the target
//     (".<target>.nnm2nxdt-partial"), never under the target's name;
//   - `done` is written only after every file of every rank is durable and
//     the manifest lists their sizes and CRC-32s;
//   - then the staging folder takes the target's name. An existing target
//     (--overwrite) is set aside first and removed only after the new tag is
//     in place, so a failed or killed run never loses it.
// Under `mpirun -np N` the ranks split the input files between them and rank
// 0 commits; the processes agree on the save through the file system.
//
// The mapping, viewed in memory as an NxDT tag at NNM's degrees
// (ckpt::ShardedTag::FromFiles), feeds the reshard engine (ckpt::WriteInLayout),
// which writes the tag at the target's degrees (NNM's own, or other --tp/--pp
// in the same pass) with its model format and fingerprints in the manifest.
// When the view cannot be read (the model format is unknown, replicas differ,
// NNM's unmerged SwiGLU) the files are written as mapped at NNM's degrees, and
// other degrees are refused before anything is written.
#pragma once

#include <functional>
#include <string>

#include "ckpt/util/env.h"
#include "ckpt/shard/logical_state.h"
#include "ckpt/spec/rank_grid.h"
#include "ckpt/util/writer_group.h"

namespace convert {

struct ConverterArgs {
  std::string nnm_ckpt_path;
  std::string nxdt_ckpt_path;  // the output tag folder, or
  std::string checkpoint_dir;  // the folder to create the tag in, named from the NNM file
  std::string checkpoint_name;
  int tp = 0, pp = 0, n_layers = 0;  // 0: not given; the checkpoint's. Other tp/pp: converted and resharded in one pass
  std::vector<int64_t> pipeline_cuts;  // with another pp: the first layer of each stage after the first (default: even)
  bool weights_only = false, save_xser = false, dry_run = false, overwrite = false;
  bool require_optimizer = false;   // an input without optimizer state is an error (MissingOptimizerState)
  bool nxdt_optimizer_groups = false;  // regroup into NxDT's split instead of keeping what NNM decayed
  bool progress_bar = false;  // a terminal bar instead of a log line per file
  ckpt::WriterGroup* group = &ckpt::SoloGroup();  // under mpirun the ranks split the output files
  // What the NNM checkpoint may not record (it has no hyper_parameters.cfg, or --weights_only):
  // --heads, --nnm_config, --model_config. Checked against what it records.
  ckpt::FormatHints hints;
  uint64_t memory_budget = uint64_t{512} << 20;  // the reshard engine's
  int threads = 1;                                // the reshard engine's writing threads
  bool trust_first_replica = false;  // the view's ckpt::TagReadOptions::trust_first_replica
};

struct ConvertSummary {
  std::string tag_dir;
  int inputs = 0, files = 0;
  int64_t tensors = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};

// Throws ckpt::Error (naming the file and key) for anything wrong.
ConvertSummary RunConversion(const ConverterArgs& args, ckpt::Env* env, const std::function<void(const std::string&)>& log);

}  // namespace convert

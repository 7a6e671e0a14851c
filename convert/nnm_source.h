// Finding the files of an NNM checkpoint. NNM keeps one
// Lightning checkpoint file per model-parallel rank:
//   <root>/<file>                                  TP = PP = 1
//   <root>/mp_rank_TT/<file>                       PP = 1
//   <root>/tp_rank_TT_pp_rank_PPP/<file>           PP > 1
// and, with ZeRO-1, the optimizer state of each data-parallel rank in
//   <rank dir>/optim/dp_rank_DDD/<stem>-optimizer_states[-last].ckpt
// File names are free (`model_optim_rng.ckpt`,
// `megatron_llama--step=1085-consumed_samples=69632.0-last.ckpt`, ...). A
// rank folder may hold several; one name is chosen for all ranks.
//
// FindNnmCheckpoint checks the layout is complete and consistent and throws
// ckpt::Error listing what it found when it is not: a missing rank folder, a
// rank without the chosen file, ranks whose newest files differ.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/spec/tag_paths.h"

namespace convert {

struct NnmSource {
  std::string root;       // as given
  // A folder given: every folder and file found resolves inside it (links
  // out are refused before anything in them is listed or read). Empty for a
  // single file, which the user named.
  std::string folder;
  std::string file_name;  // the checkpoint file chosen in every rank folder
  std::string folders;    // how the rank files are kept: "single file", "mp_rank_XX", "tp_rank_XX_pp_rank_XXX"
  // tp and pp; under ZeRO-1, dp is the data-parallel degree of the optimizer
  // files (zero1 set), else 1.
  ckpt::RankGrid grid;
  // The checkpoint file of (tp rank t, pp rank p) is files[p * tp + t].
  std::vector<std::string> files;
  // ZeRO-1: the optimizer file of (t, p, d) is
  // zero1_files[(p * tp + t) * zero1_dp() + d].
  std::vector<std::string> zero1_files;
  // Parsed from file_name when it follows the callback template.
  std::optional<ckpt::TagName> name;

  // The ZeRO-1 data-parallel degree; 0 without ZeRO-1.
  int zero1_dp() const { return grid.zero1 ? grid.dp : 0; }
  const std::string& File(int t, int p) const { return files[p * grid.tp + t]; }
  const std::string& Zero1File(int t, int p, int d) const { return zero1_files[(p * grid.tp + t) * zero1_dp() + d]; }
};

// `path` is a checkpoint file or a folder as above; `checkpoint_name` picks
// the file when set, else the one with the highest step (a -last file wins a
// tie) is chosen and announced through `log`.
NnmSource FindNnmCheckpoint(ckpt::Env* env, const std::string& path, const std::string& checkpoint_name,
                            const std::function<void(const std::string&)>& log);

// A checkpoint file name without its extension (.ckpt or .pt).
std::string CheckpointStem(const std::string& file_name);

// The ZeRO-1 optimizer file name NNM pairs with a checkpoint file name:
// "x-last.ckpt" -> "x-optimizer_states-last.ckpt", "x.ckpt" -> "x-optimizer_states.ckpt".
std::string Zero1FileName(const std::string& checkpoint_file_name);

}  // namespace convert

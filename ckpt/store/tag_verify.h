// Checking a checkpoint tag: markers, files against manifest.json (sizes
// always, CRC-32s when asked, in parallel), files the manifest does not
// list, leftover temporaries, and rank-grid completeness (every model file for
// the grid, optim files for every dp rank under ZeRO-1), and every .pt file
// loads. Tags NxD wrote have no manifest: their grid is inferred from the rank
// file names present, and with checksums every file is loaded with its zip
// records' CRC-32s checked. Files that resolve outside the tag (symbolic
// links) are problems, never read.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/manifest.h"

namespace ckpt {

struct TagProblem {
  std::string file;  // relative to the tag; empty for the tag as a whole
  std::string what;
};

struct TagReport {
  std::string path;
  bool has_done = false, has_manifest = false;
  // No manifest, so the files were checked by what they say of themselves:
  // zip CRC-32s, pickles and tensor bounds (with VerifyOptions::checksums).
  bool checked_without_manifest = false;
  // model/ alone, no marker, manifest, optim/ or tag-level file: what NxD's
  // scripts/checkpoint_converter.py writes (save_partial_xser/_no_xser). A
  // weights-only tag, complete without `done`, since no save marks it.
  bool model_only = false;
  std::optional<RankGrid> grid;
  uint64_t files_checked = 0, bytes_checked = 0;
  std::vector<TagProblem> problems;
  bool ok() const { return problems.empty(); }
};

struct VerifyOptions {
  bool checksums = true;
  // MoE tensors in model files are left to the reader that follows (ckpt::DescribeModel reads an
  // HF-style Mixtral's weights and refuses the rest naming MoE), not reported as a problem.
  bool moe_left_to_reader = false;
  // With checksums and a manifest: the CRC-32 of a listed file, from its path and size (the
  // manifest's, which the file's matches). Unset, the whole file is read (DigestFile); a job
  // that recorded what it read of the source (ckpt/util/read_fold.h) reads only the rest.
  std::function<uint32_t(const std::string& path, uint64_t size)> file_crc = nullptr;
};

TagReport VerifyTag(Env* env, const std::string& tag_dir, const VerifyOptions& opts = {});

// The part of VerifyTag with checksums that reads file contents, for the files
// `files` of a tag whose manifest is `m`: each one's CRC-32 against the
// manifest, and that each directly loaded .pt loads (ZeRO-1 shards against
// m.grid.dp). Files VerifyTag without checksums already finds wanting (not
// listed, missing, outside the tag, of another size) are skipped, not read.
// So VerifyTag without checksums plus this over every listed file finds what
// VerifyTag with checksums finds, and the work can be spread over the ranks
// that load the files (a resume's).
std::vector<TagProblem> VerifyListedContent(Env* env, const std::string& tag_dir, const Manifest& m, const std::vector<std::string>& files);

// For a reader of the model alone (--weights_only, model.weight_init_only): removes
// the problems of optim/ files, which it does not open, handing each to `told`.
void DropOptimizerProblems(TagReport& r, const std::function<void(const TagProblem&)>& told);

// Whether `dir` holds model/ and nothing a save writes besides (TagReport::model_only).
bool IsModelOnlyFolder(Env* env, const std::string& dir);

// Whether `dir` is a checkpoint tag rather than a folder of them: it holds a
// `model/` folder or a marker a save leaves (`done`, `checkpoint`,
// `manifest.json`), or is named as NxDT names tags; and it holds no NNM rank
// folder (tp_rank_XX_pp_rank_XXX, mp_rank_XX: NNM names its checkpoint
// folders as NxDT names tags). The one answer every command gives.
bool LooksLikeTag(Env* env, const std::string& dir);
// Whether `dir` holds NNM's rank folders (tp_rank_.., mp_rank_..).
bool HoldsNnmRankFolders(Env* env, const std::string& dir);

// One tag folder in a checkpoint directory, as found on disk.
struct TagEntry {
  std::string path, dir_name;
  std::optional<TagName> parsed;
  bool has_done = false;
  bool listed_in_newest = false;  // NxD 2.16 keeps a newest-tag list
  int64_t mtime_ns = 0;
};

// Tag folders under `checkpoint_dir`: names ending .ckpt, folders holding a
// `checkpoint` or `done` marker (NxD's own tags, named freely, e.g. step_7),
// and names listed in its `newest` file. Newest first: by step from the tag
// name, mtime only as a tie-break (mtime breaks when a directory is copied)
// and the only order among tags whose names carry no step, as in NxD.
std::vector<TagEntry> ListTags(Env* env, const std::string& checkpoint_dir);

}  // namespace ckpt

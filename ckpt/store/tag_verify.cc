#include "ckpt/store/tag_verify.h"

#include "ckpt/spec/model_family.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>

#include "ckpt/util/error.h"
#include "ckpt/util/input_guard.h"
#include "ckpt/store/manifest.h"
#include "ckpt/spec/ep_zero1_state.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/pt/xser.h"
#include "ckpt/store/tag_writer.h"
#include "ckpt/store/training_state.h"

namespace ckpt {
namespace {

// Every regular file under `root`, relative, skipping nothing. A folder
// linked out of `root` (model/, an xser .tensors folder) is an entry of its
// own, for the caller to refuse, and is never listed.
void Walk(Env* env, const std::string& root, const ConfinedTree& tree, const std::string& rel, std::vector<std::string>* out) {
  const std::string dir = rel.empty() ? root : root + "/" + rel;
  for (const auto& name : env->ListDir(dir)) {
    const std::string r = rel.empty() ? name : rel + "/" + name;
    if (env->IsDirectory(root + "/" + r) && tree.Inside(root + "/" + r)) Walk(env, root, tree, r, out);
    else out->push_back(r);
  }
}

bool IsOwnBookkeeping(const std::string& rel) {
  return rel == kCheckpointMarker || rel == kDoneMarker || rel == kManifestFile ||
         rel.rfind(std::string(kRankRecordDir) + "/", 0) == 0;
}

// The grid implied by the rank files present (NxD tags have no manifest).
// Model files may name an ep rank (an expert-parallel MoE tag: the tag reader
// checks they all do); optimizer files that do (NxDT's lossy expert-parallel
// save, ckpt/spec/ep_zero1_state.h) are problems.
std::optional<RankGrid> InferGrid(const std::vector<std::string>& files, const std::function<void(std::string, std::string)>& problem) {
  RankGrid g{0, 0, 0, false};
  bool any = false;
  std::vector<RankCoord> model;
  std::string an_ep_file;
  for (const auto& f : files) {
    for (const char* sub : {"model/", "optim/"}) {
      if (f.rfind(sub, 0) != 0) continue;
      std::string name = f.substr(6);
      if (name.find('/') != std::string::npos) continue;  // xser tensors
      std::optional<RankCoord> rc;
      try {
        rc = sub[0] == 'm' ? ParseAnyRankFileName(name) : ParseRankFileName(name);
      } catch (const Error& e) {
        problem(f, e.what());
      }
      if (!rc) continue;
      any = true;
      g.tp = std::max(g.tp, rc->tp + 1);
      g.pp = std::max(g.pp, rc->pp + 1);
      if (rc->ep) g.ep = std::max(g.ep, *rc->ep + 1);
      if (rc->ep && an_ep_file.empty()) an_ep_file = f;
      if (sub[0] == 'm') model.push_back(*rc);
      if (sub[0] == 'o') g.dp = std::max(g.dp, rc->dp + 1);
    }
  }
  if (!any) return std::nullopt;
  if (const std::string why = EpNamingProblem(model); !why.empty()) {
    problem(an_ep_file, why);
    return std::nullopt;
  }
  g.dp = std::max(g.dp, 1);
  g.zero1 = g.dp > 1;
  return g;
}

// The .pt files a reader opens directly: everything ending .pt except the
// tensor files inside an xser folder, which their X.pt loads.
bool IsDirectlyLoaded(const std::string& rel) {
  return rel.ends_with(".pt") && rel.find(".pt.tensors/") == std::string::npos;
}

// Loads `rel` as a reader would: the zip structure, the pickle, every
// tensor's storage, and (with `crc`) every zip record's CRC-32, which torch
// writes. An optimizer file's ZeRO-1 shards are checked against its
// shape_info and `zero1_dp` (0: not checked). `moe_described`: the manifest
// records an MoE model (its writer, the trainer, reads it back), or VerifyOptions::moe_left_to_reader.
// `ep`: the expert-parallel size (the model files' names or the manifest tell); at ep > 1 an optim/ file is
// NxD's NeuronEPZero1Optimizer's, checked by EpZero1ShardProblem. Returns the problem, or "".
std::string LoadProblem(Env* env, const std::string& tag_dir, const std::string& rel, bool crc, int zero1_dp, bool moe_described, int ep = 1) {
  Value v;
  try {
    LoadOptions opts;
    opts.verify_crc = crc;
    v = LoadTagFile(env, tag_dir, rel, opts);
  } catch (const Error& e) {
    return std::string("unreadable: ") + e.what();
  }
  // Bytes alone do not vouch for a model no reader takes: an MoE (Mixtral) model's files holding a
  // part shardkit's family does not, or lacking one, are told so (MoeFileProblem), unless the
  // manifest describes the MoE model (the trainer resumes its own tags). Expert-parallel files are
  // told by their names (InferGrid).
  if (rel.starts_with("model/") && v.is_dict() && !moe_described) {
    std::vector<std::string> keys;
    // An expert-parallel file's SPMDRank tensors are NxD's (the reader checks their values).
    const auto at = ParseAnyRankFileName(rel.substr(rel.rfind('/') + 1));
    for (const auto& [k, _] : v.as_dict().items)
      if (k.is_str() && !(at && at->ep && IsSpmdRankName(k.as_str()))) keys.push_back(k.as_str());
    if (std::string why = MoeFileProblem(keys); !why.empty()) return why;
  }
  if (zero1_dp > 0 && rel.starts_with("optim/")) {
    // NxD's NeuronEPZero1Optimizer (ep > 1) cuts expert state over expert-dp (ckpt/spec/ep_zero1_state.h).
    std::string why = ep > 1 ? EpZero1ShardProblem(v, zero1_dp, ep, rel) : Zero1ShardProblem(v, zero1_dp, rel);
    if (why.starts_with(rel + ": ")) why.erase(0, rel.size() + 2);  // the report names the file
    return why;
  }
  return "";
}

// The problem of a listed file whose size matches the manifest: its CRC-32
// differs, or it does not load; or "".
std::string ContentProblem(Env* env, const std::string& tag_dir, const std::string& rel, const FileDigest& want, int zero1_dp,
                           bool moe_described, int ep, const decltype(VerifyOptions::file_crc)& file_crc) {
  const std::string path = tag_dir + "/" + rel;
  const uint32_t got = file_crc ? file_crc(path, want.size) : DigestFile(env, path).crc32;
  if (got != want.crc32) return "checksum " + CrcHex(got) + " differs from the manifest's " + CrcHex(want.crc32);
  // Bytes that match a manifest rewritten to match them (a truncated file
  // and its recomputed record) must still load.
  return IsDirectlyLoaded(rel) ? LoadProblem(env, tag_dir, rel, false, zero1_dp, moe_described, ep) : "";
}

// Where training stands, as `rel` (user_content.pt, scheduler.pt) records it: a step, sample count
// or LR a resumed run could not continue from (UserContent/SchedulerState::FromValue: negative,
// non-finite, fractional or absurd) is a problem, or "". NxD's free-form user content (no
// global_step) records none of these and is not judged here.
std::string TrainingStateProblem(Env* env, const std::string& tag_dir, const std::string& rel) {
  try {
    const Value v = LoadTagFile(env, tag_dir, rel);
    if (!v.is_dict()) return "";
    if (rel == kUserContentFile && v.as_dict().Find("global_step")) UserContent::FromValue(v, rel);
    if (rel == kSchedulerFile && v.as_dict().Find("last_epoch")) SchedulerState::FromValue(v, rel);
    return "";
  } catch (const Error& e) {
    std::string why = e.what();
    if (why.starts_with(rel + ": ")) why.erase(0, rel.size() + 2);  // the report names the file
    return why;
  }
}

// NxDT's save of an expert-parallel ZeRO-1 optimizer (EpZero1LostMessage): optim/ files named by
// ep rank, ep rank 0's holding ZeRO-1 state. Told as the optim/ folder's problem.
void ReportLostExpertOptimizer(Env* env, const std::string& tag_dir, const std::vector<std::string>& files, const std::set<std::string>& present,
                               const std::set<std::string>& outside, const std::function<void(std::string, std::string)>& problem) {
  std::vector<std::string> optim, names;  // optim/'s rank file names; model/'s and optim/'s
  for (const auto& f : files)
    for (const char* sub : {"model/", "optim/"})
      if (f.starts_with(sub) && f.find('/', 6) == std::string::npos) {
        names.push_back(f.substr(6));
        if (sub[0] == 'o') optim.push_back(f.substr(6));
      }
  const auto ep0 = EpNamedOptimFile(optim);
  if (!ep0 || !present.count("optim/" + *ep0) || outside.count("optim/" + *ep0)) return;
  const std::string tensors = "optim/" + XserTensorDir(*ep0) + "/";
  const bool xser = std::any_of(files.begin(), files.end(), [&](const std::string& f) { return f.starts_with(tensors); });
  try {
    if (std::string why = EpZero1LostMessage("damaged by design", LoadTagFile(env, tag_dir, "optim/" + *ep0), EpSizeOfNames(names), xser);
        !why.empty())
      problem("optim/", std::move(why));
  } catch (const Error&) {
    // an unreadable file is reported by the load
  }
}

}  // namespace

TagReport VerifyTag(Env* env, const std::string& tag_dir, const VerifyOptions& opts) {
  TagReport r;
  r.path = tag_dir;
  auto problem = [&](std::string file, std::string what) { r.problems.push_back({std::move(file), std::move(what)}); };
  if (!env->IsDirectory(tag_dir)) {
    problem("", "not a directory");
    return r;
  }
  std::vector<std::string> files;
  const ConfinedTree tree(tag_dir);
  Walk(env, tag_dir, tree, "", &files);
  const std::set<std::string> present(files.begin(), files.end());
  r.has_done = present.count(kDoneMarker);
  r.has_manifest = present.count(kManifestFile);
  r.model_only = IsModelOnlyFolder(env, tag_dir);
  if (!r.has_done && !r.model_only) problem(kDoneMarker, "missing: the save never completed");

  for (const auto& f : files)
    if (IsTempPath(f)) problem(f, "leftover temporary file from an interrupted write");
  // A rank file (or model/ itself) linked out of the tag is not this tag's to read, nor is
  // anything but a regular file.
  std::set<std::string> outside;
  for (const auto& f : files) {
    std::error_code ec;
    if (!tree.Inside(tag_dir + "/" + f)) {
      outside.insert(f);
      problem(f, "resolves to " + ResolvedPath(tag_dir + "/" + f) + ", outside the tag (a symbolic link); not read");
    } else if (!std::filesystem::is_regular_file(tag_dir + "/" + f, ec)) {  // a FIFO would block a reader
      outside.insert(f);
      problem(f, "is not a regular file (a FIFO, socket or device); not read");
    }
  }

  if (r.has_manifest) {
    Manifest m;
    try {
      m = Manifest::Load(env, tag_dir + "/" + kManifestFile);
    } catch (const Error& e) {
      problem(kManifestFile, e.what());
      return r;
    }
    r.grid = m.grid;
    const int zero1_dp = m.grid.dp;
    if (!present.count(kCheckpointMarker)) problem(kCheckpointMarker, "missing marker");
    for (const auto& f : files)
      if (!IsOwnBookkeeping(f) && !IsTempPath(f) && !m.files.count(f)) problem(f, "not listed in the manifest");
    std::vector<std::pair<std::string, FileDigest>> listed(m.files.begin(), m.files.end());
    std::mutex mu;
    tbb::parallel_for(size_t{0}, listed.size(), [&](size_t i) {
      const auto& [rel, want] = listed[i];
      const std::string path = tag_dir + "/" + rel;
      std::string what;
      uint64_t bytes = 0;
      if (!present.count(rel)) {
        what = "missing (listed in the manifest)";
      } else if (outside.count(rel)) {
        return;  // reported above
      } else {
        try {
          const uint64_t size = env->FileSize(path);
          if (size != want.size) {
            what = "size " + std::to_string(size) + " differs from the manifest's " + std::to_string(want.size);
          } else if (opts.checksums) {
            what = ContentProblem(env, tag_dir, rel, want, zero1_dp, opts.moe_left_to_reader || (m.model && m.model->moe()), m.grid.ep,
                                  opts.file_crc);
            bytes = size;
          }
        } catch (const Error& e) {
          what = e.what();
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      r.files_checked += 1;
      r.bytes_checked += bytes;
      if (!what.empty()) problem(rel, what);
    });
  } else {
    r.grid = InferGrid(files, problem);
    if (!r.grid) problem("model/", "no rank files (model/dp_rank_XX_tp_rank_XX_pp_rank_XX.pt)");
    // Shards are checked against the dp of the files present; at dp 1 NxDT's one-shard save is
    // told below in its own words.
    const int zero1_dp = r.grid && r.grid->dp > 1 ? r.grid->dp : 0;
    // No manifest (NxD or NxDT wrote it, or ours lost it): what the files say of
    // themselves is checked instead. Every zip record's CRC-32, a parse of every
    // pickle and every tensor's storage bounds.
    if (opts.checksums) {
      r.checked_without_manifest = true;
      std::vector<std::string> loaded;
      for (const auto& f : files)
        if (IsDirectlyLoaded(f) && !outside.count(f) && !IsTempPath(f)) loaded.push_back(f);
      std::mutex mu;
      tbb::parallel_for(size_t{0}, loaded.size(), [&](size_t i) {
        const std::string what = LoadProblem(env, tag_dir, loaded[i], true, zero1_dp, opts.moe_left_to_reader, r.grid ? r.grid->ep : 1);
        uint64_t bytes = 0;
        try {
          bytes = env->FileSize(tag_dir + "/" + loaded[i]);
        } catch (const Error&) {
        }
        std::lock_guard<std::mutex> lock(mu);
        r.files_checked += 1;
        r.bytes_checked += bytes;
        if (!what.empty()) problem(loaded[i], what);
      });
    }
  }

  // A grid far larger than the files present (a rank file named tp_rank_99999999, say) is one
  // problem, not millions of missing files.
  if (r.grid && int64_t{r.grid->tp} * r.grid->pp * r.grid->dp > static_cast<int64_t>(files.size()) + 64) {
    problem("model/", "rank file names imply a grid tp=" + std::to_string(r.grid->tp) + " pp=" + std::to_string(r.grid->pp) +
                          " dp=" + std::to_string(r.grid->dp) + ", far more ranks than the " + std::to_string(files.size()) +
                          " files present");
    r.grid.reset();
  }
  // One container per tag (NxD checkpoint_storage.py is_checkpoint_xser decides per tag), and no
  // tensor folder without its X.pt.
  {
    std::set<std::string> entries;  // what model/ and optim/ hold, one level down
    for (const auto& f : files)
      if (f.rfind("model/", 0) == 0 || f.rfind("optim/", 0) == 0) entries.insert(f.substr(0, f.find('/', 6)));
    for (const auto& p : XserContainerProblems(entries)) problem(p.entry, p.what);
  }
  // NxDT's ZeRO-1 at dp > 1: one optimizer file per stage whose shards hold a part of each tensor.
  if (r.grid && r.grid->dp == 1 && !r.has_manifest) {
    const std::string first = RankFilePath(RankFileKind::kOptim, {0, 0, 0});
    if (present.count(first) && !outside.count(first)) {
      try {
        if (const int64_t dp = Zero1SavedAsOneShard(LoadTagFile(env, tag_dir, first)))
          problem(first, Zero1OneShardMessage("damaged by design", dp));
      } catch (const Error&) {
        // an unreadable file is reported by the load above
      }
    }
  }
  if (!r.has_manifest) ReportLostExpertOptimizer(env, tag_dir, files, present, outside, problem);
  for (const char* rel : {kUserContentFile, kSchedulerFile}) {
    const bool reported = std::any_of(r.problems.begin(), r.problems.end(), [&](const TagProblem& p) { return p.file == rel; });
    if (present.count(rel) && !outside.count(rel) && !reported)
      if (std::string why = TrainingStateProblem(env, tag_dir, rel); !why.empty()) problem(rel, std::move(why));
  }
  if (r.grid) {  // rank-grid completeness
    for (const auto& f : r.grid->ModelFiles())
      if (!present.count(f)) problem(f, "missing for the rank grid tp=" + std::to_string(r.grid->tp) + " pp=" + std::to_string(r.grid->pp));
    // A weights-only save has no optim/ at all; otherwise every optim file
    // of the grid must be there.
    const bool any_optim = std::any_of(files.begin(), files.end(), [](const std::string& f) { return f.rfind("optim/", 0) == 0; });
    if (any_optim)
      for (const auto& f : r.grid->OptimFiles())
        if (!present.count(f))
          problem(f, std::string("missing for the rank grid") + (r.grid->zero1 ? " (ZeRO-1: one optim file per dp rank)" : ""));
  }
  std::sort(r.problems.begin(), r.problems.end(), [](const TagProblem& a, const TagProblem& b) {
    return std::tie(a.file, a.what) < std::tie(b.file, b.what);
  });
  return r;
}

std::vector<TagProblem> VerifyListedContent(Env* env, const std::string& tag_dir, const Manifest& m, const std::vector<std::string>& files) {
  std::vector<TagProblem> problems;
  std::mutex mu;
  const ConfinedTree tree(tag_dir);
  tbb::parallel_for(size_t{0}, files.size(), [&](size_t i) {
    const std::string& rel = files[i];
    const std::string path = tag_dir + "/" + rel;
    const auto want = m.files.find(rel);
    std::error_code ec;
    // What VerifyTag without checksums reports (unlisted, missing, outside, not regular, wrong size) is not read.
    if (want == m.files.end() || IsTempPath(rel) || !env->Exists(path) || !tree.Inside(path) ||
        !std::filesystem::is_regular_file(path, ec))
      return;
    std::string what;
    try {
      if (env->FileSize(path) != want->second.size) return;
      what = ContentProblem(env, tag_dir, rel, want->second, m.grid.dp, m.model && m.model->moe(), m.grid.ep, {});
    } catch (const Error& e) {
      what = e.what();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (!what.empty()) problems.push_back({rel, what});
  });
  return problems;
}

void DropOptimizerProblems(TagReport& r, const std::function<void(const TagProblem&)>& told) {
  std::erase_if(r.problems, [&](const TagProblem& p) {
    if (p.file.rfind("optim/", 0) != 0) return false;
    told(p);
    return true;
  });
}

bool HoldsNnmRankFolders(Env* env, const std::string& dir) {
  if (!env->IsDirectory(dir)) return false;
  for (const auto& n : env->ListDir(dir))
    if ((n.starts_with("tp_rank_") || n.starts_with("mp_rank_")) && env->IsDirectory(dir + "/" + n)) return true;
  return false;
}

bool LooksLikeTag(Env* env, const std::string& dir) {
  if (!env->IsDirectory(dir) || HoldsNnmRankFolders(env, dir)) return false;
  for (const char* f : {kDoneMarker, kCheckpointMarker, kManifestFile, "model"})
    if (env->Exists(dir + "/" + f)) return true;
  return ParseTagName(std::filesystem::path(WithoutTrailingSeparators(dir)).filename().string()).has_value();
}

bool IsModelOnlyFolder(Env* env, const std::string& dir) {
  if (!env->IsDirectory(dir + "/model")) return false;
  for (const auto& n : env->ListDir(dir))
    if (n != "model") return false;
  return true;
}

std::vector<TagEntry> ListTags(Env* env, const std::string& checkpoint_dir) {
  std::set<std::string> newest;
  const std::string newest_path = checkpoint_dir + "/" + kNewestFile;
  if (env->Exists(newest_path) && !env->IsDirectory(newest_path)) {
    auto m = env->MapFile(newest_path);
    std::istringstream in(std::string(reinterpret_cast<const char*>(m->data()), m->size()));
    for (std::string line; std::getline(in, line);)
      if (!line.empty() && line != "." && line != ".." && line.find('/') == std::string::npos) newest.insert(line);  // names, not paths
  }
  std::vector<TagEntry> tags;
  for (const auto& name : env->ListDir(checkpoint_dir)) {
    const std::string path = checkpoint_dir + "/" + name;
    if (!env->IsDirectory(path)) continue;
    const bool listed = newest.count(name);
    // NxD's own trainer names tags freely and finds them as NxD's
    // checkpoint_storage.list_checkpoint_tags does: by the `checkpoint` marker
    // inside (complete ones by `done`).
    const bool marked = env->Exists(path + "/" + kCheckpointMarker) || env->Exists(path + "/" + kDoneMarker);
    if ((!name.ends_with(".ckpt") && !listed && !marked) || IsSetAsideTagName(name)) continue;
    TagEntry t;
    t.path = path;
    t.dir_name = name;
    t.parsed = ParseTagName(name);
    t.has_done = env->Exists(path + "/" + kDoneMarker);
    t.listed_in_newest = listed;
    t.mtime_ns = env->FileMTimeNs(path);
    tags.push_back(std::move(t));
  }
  std::sort(tags.begin(), tags.end(), [](const TagEntry& a, const TagEntry& b) {
    const int64_t sa = a.parsed ? a.parsed->step : -1, sb = b.parsed ? b.parsed->step : -1;
    if (sa != sb) return sa > sb;
    return a.mtime_ns > b.mtime_ns;
  });
  return tags;
}

}  // namespace ckpt

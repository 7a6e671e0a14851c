#include "convert/nnm_source.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>

#include "ckpt/util/input_guard.h"
#include "ckpt/util/error.h"

namespace convert {
namespace {

std::string Join(const std::vector<std::string>& v, const std::string& sep = ", ") {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

bool IsCheckpointFileName(const std::string& n) {
  return !n.starts_with(".") && !ckpt::IsTempPath(n) && CheckpointStem(n) != n;
}

// The checkpoint files directly in `dir`.
std::vector<std::string> CheckpointFiles(ckpt::Env* env, const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& n : env->ListDir(dir))
    if (IsCheckpointFileName(n) && !env->IsDirectory(dir + "/" + n)) out.push_back(n);
  return out;
}

// The file of one rank folder: `wanted` if set, else the newest by step.
std::string ChooseFile(ckpt::Env* env, const std::string& dir, const std::string& wanted) {
  const auto files = CheckpointFiles(env, dir);
  if (!wanted.empty()) {
    if (std::find(files.begin(), files.end(), wanted) == files.end())
      throw ckpt::Error(dir + ": no checkpoint file named '" + wanted + "' (found: " + (files.empty() ? "none" : Join(files)) + ")");
    return wanted;
  }
  if (files.empty()) throw ckpt::Error(dir + ": holds no checkpoint file (*.ckpt or *.pt)");
  if (files.size() == 1) return files[0];
  std::vector<std::pair<ckpt::TagName, std::string>> named;
  for (const auto& f : files)
    if (auto t = ckpt::ParseTagName(f)) named.emplace_back(*t, f);
  if (named.empty())
    throw ckpt::Error(dir + ": holds several checkpoint files and none names its step (" + Join(files) +
                      "); pick one with --checkpoint_name");
  return std::max_element(named.begin(), named.end(), [](const auto& a, const auto& b) {
           return std::pair(a.first.step, a.first.last) < std::pair(b.first.step, b.first.last);
         })->second;
}

struct RankDir {
  int tp, pp;
  std::string path;
};

std::vector<RankDir> RankDirs(ckpt::Env* env, const std::string& root, int* tp, int* pp, std::string* folders) {
  static const std::regex mp_re(R"(mp_rank_(\d{1,6}))"), tppp_re(R"(tp_rank_(\d{1,6})_pp_rank_(\d{1,6}))");
  std::map<std::pair<int, int>, std::string> mp, tppp;  // (pp, tp) -> dir
  for (const auto& n : env->ListDir(root)) {
    std::smatch m;
    const bool mp_name = std::regex_match(n, m, mp_re);
    if ((!mp_name && !std::regex_match(n, m, tppp_re)) || !env->IsDirectory(root + "/" + n)) continue;
    ckpt::RequireInside(root, root + "/" + n);  // a rank folder linked out of the checkpoint is never listed
    if (mp_name) mp[{0, std::stoi(m[1])}] = root + "/" + n;
    else tppp[{std::stoi(m[2]), std::stoi(m[1])}] = root + "/" + n;
  }
  if (!mp.empty() && !tppp.empty())
    throw ckpt::Error(root + ": holds both mp_rank_XX and tp_rank_XX_pp_rank_XXX folders; which checkpoint is it?");
  const auto& found = mp.empty() ? tppp : mp;
  if (found.empty()) {
    *tp = *pp = 1;
    *folders = "single file";
    return {{0, 0, root}};
  }
  *folders = mp.empty() ? "tp_rank_XX_pp_rank_XXX" : "mp_rank_XX";
  *tp = *pp = 0;
  for (const auto& [k, d] : found) *pp = std::max(*pp, k.first + 1), *tp = std::max(*tp, k.second + 1);
  std::vector<RankDir> dirs;
  std::vector<std::string> missing;
  for (int p = 0; p < *pp; ++p)
    for (int t = 0; t < *tp; ++t) {
      auto it = found.find({p, t});
      if (it == found.end()) {
        char buf[64];
        if (mp.empty()) std::snprintf(buf, sizeof buf, "tp_rank_%02d_pp_rank_%03d", t, p);
        else std::snprintf(buf, sizeof buf, "mp_rank_%02d", t);
        missing.push_back(buf);
      } else {
        dirs.push_back({t, p, it->second});
      }
    }
  if (!missing.empty())
    throw ckpt::Error(root + ": rank folders are missing for a " + std::to_string(*tp) + " x " + std::to_string(*pp) +
                      " (tp x pp) checkpoint: " + Join(missing));
  return dirs;
}

}  // namespace

std::string CheckpointStem(const std::string& f) {
  for (const std::string ext : {".ckpt", ".pt"})
    if (f.ends_with(ext)) return f.substr(0, f.size() - ext.size());
  return f;
}

std::string Zero1FileName(const std::string& f) {
  const std::string stem = CheckpointStem(f);
  if (stem.ends_with("-last")) return stem.substr(0, stem.size() - 5) + "-optimizer_states-last.ckpt";
  return stem + "-optimizer_states.ckpt";
}

NnmSource FindNnmCheckpoint(ckpt::Env* env, const std::string& path, const std::string& checkpoint_name,
                            const std::function<void(const std::string&)>& log) {
  NnmSource s;
  s.root = path;
  if (!env->Exists(path)) throw ckpt::Error(path + ": no such file or folder");
  std::vector<RankDir> dirs;
  if (!env->IsDirectory(path)) {
    const std::filesystem::path p(path);
    if (!checkpoint_name.empty() && checkpoint_name != p.filename().string())
      throw ckpt::Error(path + ": is a file, but --checkpoint_name names '" + checkpoint_name + "'");
    s.folders = "single file";
    dirs = {{0, 0, p.has_parent_path() ? p.parent_path().string() : "."}};
    s.file_name = p.filename().string();
  } else {
    s.folder = path;
    dirs = RankDirs(env, path, &s.grid.tp, &s.grid.pp, &s.folders);
    std::map<std::string, std::vector<std::string>> chosen;  // file -> rank folders
    for (const auto& d : dirs) chosen[ChooseFile(env, d.path, checkpoint_name)].push_back(std::filesystem::path(d.path).filename());
    if (chosen.size() > 1) {
      std::string what;
      for (const auto& [f, ds] : chosen) what += "\n  " + f + ": " + Join(ds);
      throw ckpt::Error(path + ": the rank folders do not hold the same checkpoint (mixed steps?); newest file per folder:" +
                        what + "\npick one present in every folder with --checkpoint_name");
    }
    s.file_name = chosen.begin()->first;
    if (checkpoint_name.empty() && CheckpointFiles(env, dirs[0].path).size() > 1)
      log("several checkpoints in each rank folder; converting " + s.file_name + " (highest step; use --checkpoint_name to pick another)");
  }
  s.name = ckpt::ParseTagName(s.file_name);
  s.files.resize(dirs.size());
  // Every folder is checked before it is listed, every file before it is read (ckpt/util/input_guard.h).
  const auto confine = [&](const std::string& p) {
    if (!s.folder.empty()) ckpt::RequireInside(s.folder, p);
  };
  for (const auto& d : dirs) {
    std::string& file = s.files[d.pp * s.grid.tp + d.tp];
    file = d.path + "/" + s.file_name;
    confine(file);
  }

  // ZeRO-1 optimizer files.
  static const std::regex dp_re(R"(dp_rank_(\d{1,6}))");
  std::vector<int> dps;
  for (const auto& d : dirs) {
    const std::string optim = d.path + "/optim";
    int dp = 0;
    if (env->IsDirectory(optim)) {
      confine(optim);
      for (const auto& n : env->ListDir(optim)) {
        std::smatch m;
        if (std::regex_match(n, m, dp_re) && env->IsDirectory(optim + "/" + n)) dp = std::max(dp, std::stoi(m[1]) + 1);
      }
    }
    dps.push_back(dp);
  }
  if (std::adjacent_find(dps.begin(), dps.end(), std::not_equal_to<>()) != dps.end()) {
    std::string what;
    for (size_t i = 0; i < dirs.size(); ++i) what += "\n  " + dirs[i].path + ": " + std::to_string(dps[i]);
    throw ckpt::Error(path + ": rank folders disagree on their ZeRO-1 optim/dp_rank_XXX folders:" + what);
  }
  s.grid.dp = std::max(1, dps[0]);
  s.grid.zero1 = dps[0] > 0;
  if (s.zero1_dp() > 0) {
    const std::string want = Zero1FileName(s.file_name);
    s.zero1_files.resize(dirs.size() * s.zero1_dp());
    for (const auto& d : dirs)
      for (int r = 0; r < s.zero1_dp(); ++r) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "dp_rank_%03d", r);
        const std::string dir = d.path + "/optim/" + buf;
        if (!env->IsDirectory(dir)) throw ckpt::Error(dir + ": missing (ZeRO-1 data-parallel ranks must run 0.." + std::to_string(s.zero1_dp() - 1) + ")");
        confine(dir);
        if (!env->Exists(dir + "/" + want)) {
          const auto there = CheckpointFiles(env, dir);
          throw ckpt::Error(dir + ": no ZeRO-1 optimizer file '" + want + "' for " + s.file_name + " (found: " +
                            (there.empty() ? "none" : Join(there)) + ")");
        }
        std::string& file = s.zero1_files[(d.pp * s.grid.tp + d.tp) * s.zero1_dp() + r];
        file = dir + "/" + want;
        confine(file);
      }
  }
  return s;
}

}  // namespace convert

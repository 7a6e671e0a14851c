#include "ckpt/shard/tag_files.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>

#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/xser.h"
#include "ckpt/spec/ep_zero1_state.h"
#include "ckpt/spec/optimizer_state.h"
#include "ckpt/shard/sharded_tag.h"
#include "ckpt/util/input_guard.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/util/error.h"

namespace ckpt {


void TagFiles::SetInMemory(std::map<std::string, Value> files) {
  in_memory_ = true;
  given_ = std::move(files);
}

// A rank file (or model/ itself) linked out of the tag is refused, never read.
std::string TagFiles::Path(const std::string& rel) const {
  if (in_memory_) return dir_ + " (as " + rel + ")";
  RequireInside(dir_, dir_ + "/" + rel);
  return dir_ + "/" + rel;
}

// What model/ or optim/ holds (names; none when the folder is absent).
std::vector<std::string> TagFiles::ListNames(const std::string& sub) const {
  std::vector<std::string> names;
  if (in_memory_) {
    for (const auto& [rel, v] : given_)
      if (rel.starts_with(sub + "/")) names.push_back(rel.substr(sub.size() + 1));
  } else if (env_->IsDirectory(Path(sub))) {
    names = env_->ListDir(Path(sub));
  }
  return names;
}

// The rank files of model/ or optim/ (names); what the folder holds is added to `entries`.
std::vector<std::string> TagFiles::ListRankFiles(const std::string& sub, std::set<std::string>& entries) const {
  std::vector<std::string> out;
  for (const auto& n : ListNames(sub)) {
    if (IsTempPath(n)) continue;
    entries.insert(sub + "/" + n);
    try {
      if (ParseAnyRankFileName(n)) out.push_back(n);
    } catch (const Error& e) {
      throw Error(Path(sub) + "/" + e.what());
    }
  }
  return out;
}

void TagFiles::Discover(const TagReadOptions& opts, std::optional<Manifest>& manifest, TagDescription& L, bool* optimizer_skipped) {
  if (!in_memory_ && !env_->IsDirectory(dir_)) throw Error(dir_ + ": not a folder");
  if (!in_memory_ && !env_->IsDirectory(Path("model"))) throw Error(dir_ + ": holds no model/ folder; not a checkpoint tag");
  if (!opts.weights_only) RefuseLostExpertOptimizer();
  std::set<std::tuple<int, int, int>> model;  // (ep, tp, pp)
  int tp = 0, pp = 0, ep = 0;
  // One container per tag, as NxD's loader reads it: a mix, or a tensor folder without its X.pt, is refused.
  std::set<std::string> entries;
  const auto model_files = ListRankFiles("model", entries);
  const auto optim_files = ListRankFiles("optim", entries);
  if (const auto bad = XserContainerProblems(entries); !bad.empty()) throw Error(Path(bad[0].entry) + ": " + bad[0].what);
  xser_ = std::any_of(model_files.begin(), model_files.end(), [&](const std::string& n) { return entries.count("model/" + XserTensorDir(n)); });
  std::vector<RankCoord> coords;
  std::string an_ep_file;
  for (const auto& n : model_files) {
    auto r = ParseAnyRankFileName(n);
    if (r->dp != 0) throw Error(Path("model/" + n) + ": model files come from dp rank 0 only");
    if (r->ep && an_ep_file.empty()) an_ep_file = n;
    coords.push_back(*r);
    model.insert({r->ep.value_or(0), r->tp, r->pp});
    tp = std::max(tp, r->tp + 1), pp = std::max(pp, r->pp + 1), ep = std::max(ep, r->ep.value_or(0) + 1);
  }
  if (model.empty()) throw Error(Path("model") + ": holds no rank files (dp_rank_00_tp_rank_XX_pp_rank_XX.pt)");
  if (const std::string why = EpNamingProblem(coords); !why.empty()) throw Error(Path("model/" + an_ep_file) + ": " + why);
  if (!in_memory_ && env_->Exists(Path(kManifestFile))) {
    manifest = Manifest::Load(env_, Path(kManifestFile));
    if (manifest->grid.tp != tp || manifest->grid.pp != pp || manifest->grid.ep != ep)
      throw Error(Path(kManifestFile) + ": records tp=" + std::to_string(manifest->grid.tp) + " pp=" + std::to_string(manifest->grid.pp) +
                  " ep=" + std::to_string(manifest->grid.ep) + " but model/ holds files up to tp rank " + std::to_string(tp - 1) + ", pp rank " +
                  std::to_string(pp - 1) + ", ep rank " + std::to_string(ep - 1));
  }
  RankGrid{.tp = tp, .pp = pp, .ep = ep}.ForEachRankFile(RankFileKind::kModel, [&](const RankCoord& c) {
    if (!model.count({c.ep.value_or(0), c.tp, c.pp}))
      throw Error(Path(RankFilePath(RankFileKind::kModel, c)) + ": missing; the tag holds other ranks' model files (tp " + std::to_string(tp) +
                  ", pp " + std::to_string(pp) + (ep > 1 ? ", ep " + std::to_string(ep) : "") + ")");
  });
  L.grid.tp = tp, L.grid.pp = pp, L.grid.ep = ep;
  L.has_optimizer = !optim_files.empty() && !opts.weights_only;
  *optimizer_skipped = !optim_files.empty() && opts.weights_only;
  if (!L.has_optimizer) {
    // ep lies inside dp (RankGrid::ep): a job at ep E had at least E dp ranks.
    L.grid.dp = std::max(manifest ? manifest->grid.dp : 1, ep);
    return;
  }
  CheckOptimizerFiles(optim_files, manifest, L);
}

// NxDT's save of an expert-parallel ZeRO-1 optimizer (EpZero1LostMessage) lost moments no reader
// can restore: told first, before its ep rank file names are refused as MoE.
void TagFiles::RefuseLostExpertOptimizer() const {
  const std::vector<std::string> optim = ListNames("optim");
  const auto ep0 = EpNamedOptimFile(optim);
  if (!ep0) return;
  std::vector<std::string> names = ListNames("model");
  names.insert(names.end(), optim.begin(), optim.end());
  const bool xser = std::find(optim.begin(), optim.end(), XserTensorDir(*ep0)) != optim.end();
  if (const std::string why = EpZero1LostMessage(Path("optim"), Peek("optim/" + *ep0), EpSizeOfNames(names), xser); !why.empty())
    throw Error(why);
}

// Optimizer files: ZeRO-1 when they hold base_state, one per dp rank; every
// rank's present. ZeRO-1 or plain is read from the files themselves.
void TagFiles::CheckOptimizerFiles(const std::vector<std::string>& names, const std::optional<Manifest>& manifest, TagDescription& L) {
  const int tp = L.grid.tp, pp = L.grid.pp;
  std::set<std::tuple<int, int, int>> optim;
  int dp = 0;
  for (const auto& n : names) {
    std::optional<RankCoord> r;
    try {
      r = ParseRankFileName(n);  // NxD's expert-parallel ZeRO-1 files carry no ep rank; ep-named ones are NxDT's lossy save
    } catch (const Error& e) {
      throw Error(Path("optim") + "/" + e.what());
    }
    if (r) optim.insert({r->dp, r->tp, r->pp}), dp = std::max(dp, r->dp + 1);
  }
  RankGrid{.tp = tp, .pp = pp, .dp = dp, .zero1 = true}.ForEachRankFile(RankFileKind::kOptim, [&](const RankCoord& c) {
    if (!optim.count({c.dp, c.tp, c.pp}))
      throw Error(Path(RankFilePath(RankFileKind::kOptim, c)) + ": missing; the tag holds optimizer files for " + std::to_string(dp) +
                  " dp rank(s) of tp " + std::to_string(tp) + ", pp " + std::to_string(pp));
  });
  L.grid.dp = dp;
  const Value first = Peek(RankFilePath(RankFileKind::kOptim, {0, 0, 0}));
  L.grid.zero1 = first.is_dict() && first.as_dict().Find("base_state") != nullptr;
  if (L.grid.zero1 && dp == 1 && (!manifest || manifest->grid.dp > 1))
    if (const int64_t lost = Zero1SavedAsOneShard(first)) throw Error(Zero1OneShardMessage(Path(RankFilePath(RankFileKind::kOptim, {0, 0, 0})), lost));
  if (!L.grid.zero1) {
    if (dp > 1) throw Error(Path(RankFilePath(RankFileKind::kOptim, {1, 0, 0})) + ": a plain optimizer state dict comes from dp rank 0 only");
    L.grid.dp = manifest ? manifest->grid.dp : 1;
  } else if (manifest && (manifest->grid.dp != dp || !manifest->grid.zero1)) {
    throw Error(Path(kManifestFile) + ": records dp=" + std::to_string(manifest->grid.dp) + (manifest->grid.zero1 ? " with" : " without") +
                " ZeRO-1, but optim/ holds ZeRO-1 files for " + std::to_string(dp) + " dp rank(s)");
  }
}

namespace {
// Releases the pages parsing an xser rank file touched in its tensor files: they are not needed again.
void DropParsedPages(const Value& v) {
  std::set<const MappedFile*> files;
  ForEachTensor(v, [&](const Tensor& x) {
    if (const StorageOrigin* o = x.storage() ? x.storage()->origin() : nullptr; o && files.insert(o->file).second)
      o->file->DropPages(o->file->data(), o->file->size());
  });
}
}  // namespace

// An xser tag is thousands of small files, and a cold disk serves one open
// at a time slowly: every rank file is read by 8 threads at once, so the
// disk has many requests in flight, before they are checked in order (Load
// takes each from here, or its error). Memory is what Load holds anyway.
void TagFiles::Preload(const TagDescription& layout) {
  const RankGrid& g = layout.grid;
  std::vector<std::string> rels;
  rels = g.ModelFiles();
  if (layout.has_optimizer)
    for (auto& rel : g.OptimFiles()) rels.push_back(std::move(rel));
  std::vector<std::variant<Value, std::exception_ptr>> got(rels.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next++) < rels.size();) {
      try {
        Value v = LoadTagFile(env_, dir_, rels[i]);
        // Released as each file is parsed, not when Load takes it: otherwise
        // every rank file's parsed pages (whole small tensor files, mapped a
        // large folio at a time) stay resident until then, past the memory budget.
        DropParsedPages(v);
        got[i] = std::move(v);
      } catch (...) {
        got[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t k = 1; k < std::min<size_t>(8, rels.size()); ++k) threads.emplace_back(work);
  work();
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < rels.size(); ++i) preloaded_.emplace(rels[i], std::move(got[i]));
}

Value TagFiles::Peek(const std::string& rel) const {
  if (!in_memory_) return LoadTagFile(env_, dir_, rel);
  auto it = given_.find(rel);
  if (it == given_.end()) throw Error(Path(rel) + ": missing");
  return it->second;
}

Value TagFiles::Load(const std::string& rel) {
  if (in_memory_) {
    Value v = Peek(rel);
    ForEachTensor(v, [&](const Tensor& x) {
      if (!x.data() && x.numel() > 0) throw Error(Path(rel) + ": holds a tensor whose bytes are generated as written, which a reader cannot index");
      bytes_ += x.nbytes();
    });
    return v;
  }
  if (xser_) {
    Value v;
    if (auto pre = preloaded_.find(rel); pre != preloaded_.end()) {
      auto got = std::move(pre->second);
      preloaded_.erase(pre);
      if (auto* e = std::get_if<std::exception_ptr>(&got)) std::rethrow_exception(*e);
      v = std::move(std::get<Value>(got));  // Preload released its parsed pages
    } else {
      v = LoadTagFile(env_, dir_, rel);
      DropParsedPages(v);
    }
    bytes_ += env_->FileSize(Path(rel));
    std::set<const MappedFile*> files;
    ForEachTensor(v, [&](const Tensor& x) {
      if (const StorageOrigin* o = x.storage() ? x.storage()->origin() : nullptr; o && files.insert(o->file).second) bytes_ += o->file->size();
    });
    held_.push_back(v);
    return v;
  }
  auto f = env_->MapFile(Path(rel));
  bytes_ += f->size();
  Value v = LoadPtFromFile(f);
  f->DropPages(f->data(), f->size());  // what parsing touched (headers, the pickle) is not needed again
  files_.push_back(f);
  file_of_[rel] = f.get();
  return v;
}

const MappedFile* TagFiles::FileOf(const Tensor& x, const std::string& rel) const {
  if (const StorageOrigin* o = x.storage() ? x.storage()->origin() : nullptr) return o->file;
  auto it = file_of_.find(rel);
  return it == file_of_.end() ? nullptr : it->second;
}

void TagFiles::LoadModelFiles(const RankGrid& g) {
  tp_ = g.tp, pp_ = g.pp;
  model_.resize(static_cast<size_t>(g.tp) * g.pp * g.ep);
  g.ForEachRankFile(RankFileKind::kModel, [&](const RankCoord& c) {
    const std::string rel = RankFilePath(RankFileKind::kModel, c);
    Value& v = model_[(static_cast<size_t>(c.ep.value_or(0)) * pp_ + c.pp) * tp_ + c.tp];
    v = Load(rel);
    if (!v.is_dict()) throw Error(Path(rel) + " is a " + v.kind_name() + ", not a dict");
  });
}

const Value* TagFiles::UserContent() {
  if (!user_content_loaded_) {
    user_content_loaded_ = true;
    if (in_memory_ ? given_.count(kUserContentFile) > 0 : env_->Exists(Path(kUserContentFile))) user_content_ = Peek(kUserContentFile);
  }
  return user_content_ ? &*user_content_ : nullptr;
}

std::optional<Value> TagFiles::TagFile(const std::string& name) const {
  if (in_memory_) {
    auto it = given_.find(name);
    return it == given_.end() ? std::nullopt : std::optional<Value>(it->second);
  }
  const std::string path = dir_ + "/" + name;
  if (!env_->Exists(path)) return std::nullopt;
  return LoadTagFile(env_, dir_, name);
}

}  // namespace ckpt

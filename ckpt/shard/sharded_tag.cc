#include "ckpt/shard/sharded_tag.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <regex>
#include <set>
#include <thread>
#include <type_traits>
#include <variant>

#include "ckpt/util/error.h"
#include "ckpt/store/input_guard.h"
#include "ckpt/store/manifest.h"
#include "ckpt/shard/model_family.h"
#include "ckpt/shard/optimizer_groups.h"
#include "ckpt/shard/optimizer_state.h"
#include "ckpt/store/output_guard.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/store/training_state.h"
#include "ckpt/pt/xser.h"

namespace ckpt {

const char* FieldName(StateField f) {
  switch (f) {
    case StateField::kParam: return "param";
    case StateField::kExpAvg: return "exp_avg";
    case StateField::kExpAvgSq: return "exp_avg_sq";
    case StateField::kMaster: return "master";
  }
  return "?";
}

void Touched::Add(const MappedFile* f, const uint8_t* p, size_t n) {
  if (!f) return;  // bytes of no mapped file (a legacy .pt read into memory)
  auto s = std::find_if(spans_.begin(), spans_.end(), [&](const Span& x) { return x.file == f; });
  if (s == spans_.end()) spans_.push_back({f, p, p + n});
  else s->lo = std::min(s->lo, p), s->hi = std::max(s->hi, p + n);
  uint64_t covered = 0;
  for (const Span& x : spans_) covered += static_cast<uint64_t>(x.hi - x.lo);
  if (covered > limit_) Release();
}

void Touched::Release() {
  for (const Span& s : spans_) s.file->DropPages(s.lo, static_cast<size_t>(s.hi - s.lo));
  spans_.clear();
}

namespace {

const Dict& AsDict(const Value& v, const std::string& where) {
  if (!v.is_dict()) throw Error(where + " is a " + v.kind_name() + ", not a dict");
  return v.as_dict();
}

const Tensor& AsTensor(const Value& v, const std::string& where) {
  if (!v.is_tensor()) throw Error(where + " is a " + v.kind_name() + ", not a tensor");
  // NxD's converter saves o_proj transposed (a clone of a transpose keeps its strides): 1-D and 2-D views of any strides are read.
  if (!v.as_tensor().is_contiguous() && v.as_tensor().dim() > 2)
    throw Error(where + " is a strided view of " + std::to_string(v.as_tensor().dim()) + " dimensions; only 1-D and 2-D ones are read");
  return v.as_tensor();
}

std::string ShapeOf(const Tensor& t) { return ShapeString(t.shape()); }

std::vector<size_t> NonEmpty(std::vector<size_t> sizes) {
  sizes.erase(std::remove(sizes.begin(), sizes.end(), size_t{0}), sizes.end());
  return sizes;
}

}  // namespace

class ShardedTagBuilder {
 public:
  ShardedTagBuilder(Env* env, const std::string& dir, const FormatHints& hints, const TagReadOptions& opts)
      : env_(env), hints_(hints), opts_(opts) {
    t_ = std::unique_ptr<ShardedTag>(new ShardedTag());
    t_->env_ = env_;
    t_->dir_ = dir;
  }

  void SetInMemory(std::map<std::string, Value> files, const Manifest& manifest) {
    in_memory_ = true;
    t_->given_ = std::move(files);
    manifest_ = manifest;
  }

  std::unique_ptr<ShardedTag> Build() {
    FindFiles();
    if (t_->xser_) Preload();
    LoadModelFiles();
    LearnStages();
    LearnFormat();
    CheckModelFiles();
    if (t_->layout_.has_optimizer) LoadOptimizerFiles();
    LearnStep();
    for (auto& [key, idx] : t_->index_) {
      std::sort(idx.extents.begin(), idx.extents.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
      uint64_t at = 0;
      for (const auto& e : idx.extents) {
        if (e.begin != at) throw Error(t_->dir_ + ": " + key.name + " (" + FieldName(key.field) + "): the rank files do not cover elements " +
                                       std::to_string(at) + ".." + std::to_string(e.begin) + " of it");
        at = e.end;
      }
      if (at != static_cast<uint64_t>(ShapeNumel(Rule(key.name).shape)))
        throw Error(t_->dir_ + ": " + key.name + " (" + FieldName(key.field) + "): the rank files hold " + std::to_string(at) + " of its " +
                    std::to_string(ShapeNumel(Rule(key.name).shape)) + " elements");
    }
    if (!opts_.trust_first_replica) CompareReplicas();
    return std::move(t_);
  }

 private:
  std::map<std::string, std::variant<Value, std::exception_ptr>> preloaded_;  // Preload's, until Load takes them

  struct RankFiles {
    Value model;
    std::vector<Value> optim;  // one per dp rank (ZeRO-1) or one
  };

  std::string Rel(const std::string& sub, const RankCoord& r) const { return sub + "/" + RankFileName(r); }
  // A rank file (or model/ itself) linked out of the tag is refused, never read.
  std::string Path(const std::string& rel) const {
    if (in_memory_) return t_->dir_ + " (as " + rel + ")";
    RequireInside(t_->dir_, t_->dir_ + "/" + rel);
    return t_->dir_ + "/" + rel;
  }

  // An xser tag is thousands of small files, and a cold disk serves one open
  // at a time slowly: every rank file is read by 8 threads at once, so the
  // disk has many requests in flight, before they are checked in order (Load
  // takes each from here, or its error). Memory is what Load holds anyway.
  void Preload() {
    const RankGrid& g = t_->layout_.grid;
    std::vector<std::string> rels;
    for (int p = 0; p < g.pp; ++p)
      for (int t = 0; t < g.tp; ++t) {
        rels.push_back(Rel("model", {0, t, p}));
        if (t_->layout_.has_optimizer)
          for (int d = 0; d < (g.zero1 ? g.dp : 1); ++d) rels.push_back(Rel("optim", {d, t, p}));
      }
    std::vector<std::variant<Value, std::exception_ptr>> got(rels.size());
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next++) < rels.size();) {
        try {
          Value v = LoadTagFile(env_, t_->dir_, rels[i]);
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

  // A tag-level or rank file, without the accounting Load does.
  Value Peek(const std::string& rel) {
    if (!in_memory_) return LoadTagFile(env_, t_->dir_, rel);
    auto it = t_->given_.find(rel);
    if (it == t_->given_.end()) throw Error(Path(rel) + ": missing");
    return it->second;
  }

  Value Load(const std::string& rel) {
    if (in_memory_) {
      Value v = Peek(rel);
      ForEachTensor(v, [&](const Tensor& x) {
        if (!x.data() && x.numel() > 0) throw Error(Path(rel) + ": holds a tensor whose bytes are generated as written, which a reader cannot index");
        t_->bytes_ += x.nbytes();
      });
      return v;
    }
    if (t_->xser_) {
      Value v;
      if (auto pre = preloaded_.find(rel); pre != preloaded_.end()) {
        auto got = std::move(pre->second);
        preloaded_.erase(pre);
        if (auto* e = std::get_if<std::exception_ptr>(&got)) std::rethrow_exception(*e);
        v = std::move(std::get<Value>(got));
      } else {
        v = LoadTagFile(env_, t_->dir_, rel);
      }
      t_->bytes_ += env_->FileSize(Path(rel));
      std::set<const MappedFile*> files;
      ForEachTensor(v, [&](const Tensor& x) {
        if (const StorageOrigin* o = x.storage() ? x.storage()->origin() : nullptr; o && files.insert(o->file).second) t_->bytes_ += o->file->size();
      });
      DropParsedPages(v);
      t_->held_.push_back(v);
      return v;
    }
    auto f = env_->MapFile(Path(rel));
    t_->bytes_ += f->size();
    Value v = LoadPtFromFile(f);
    f->DropPages(f->data(), f->size());  // what parsing touched (headers, the pickle) is not needed again
    t_->files_.push_back(f);
    file_of_[rel] = f.get();
    return v;
  }

  // Releases the pages parsing an xser rank file touched in its tensor files: they are not needed again.
  static void DropParsedPages(const Value& v) {
    std::set<const MappedFile*> files;
    ForEachTensor(v, [&](const Tensor& x) {
      if (const StorageOrigin* o = x.storage() ? x.storage()->origin() : nullptr; o && files.insert(o->file).second)
        o->file->DropPages(o->file->data(), o->file->size());
    });
  }

  // The mapped file a tensor's bytes lie in: its own tensor file under xser.
  const MappedFile* FileOf(const Tensor& x, const std::string& rel) const {
    if (const StorageOrigin* o = x.storage() ? x.storage()->origin() : nullptr) return o->file;
    auto it = file_of_.find(rel);
    return it == file_of_.end() ? nullptr : it->second;
  }

  // The rank files of model/ or optim/ (names); what the folder holds is added to `entries`.
  std::vector<std::string> ListRankFiles(const std::string& sub, std::set<std::string>& entries) {
    std::vector<std::string> out;
    std::vector<std::string> names;
    if (in_memory_) {
      for (const auto& [rel, v] : t_->given_)
        if (rel.starts_with(sub + "/")) names.push_back(rel.substr(sub.size() + 1));
    } else {
      if (!env_->IsDirectory(Path(sub))) return out;
      names = env_->ListDir(Path(sub));
    }
    for (const auto& n : names) {
      if (IsTempPath(n)) continue;
      entries.insert(sub + "/" + n);
      try {
        if (ParseRankFileName(n)) out.push_back(n);
      } catch (const Error& e) {
        throw Error(Path(sub) + "/" + e.what());
      }
    }
    return out;
  }

  const ParamRule& Rule(const std::string& name) const {
    for (const auto& p : t_->params_)
      if (p.name == name) return p;
    throw Error("no parameter " + name);
  }

  void FindFiles() {
    TagDescription& L = t_->layout_;
    if (!in_memory_ && !env_->IsDirectory(t_->dir_)) throw Error(t_->dir_ + ": not a folder");
    if (!in_memory_ && !env_->IsDirectory(Path("model"))) throw Error(t_->dir_ + ": holds no model/ folder; not a checkpoint tag");
    std::set<std::pair<int, int>> model;
    int tp = 0, pp = 0;
    // One container per tag, as NxD's loader reads it: a mix, or a tensor folder without its X.pt, is refused.
    std::set<std::string> entries;
    const auto model_files = ListRankFiles("model", entries);
    const auto optim_files = ListRankFiles("optim", entries);
    if (const auto bad = XserContainerProblems(entries); !bad.empty()) throw Error(Path(bad[0].entry) + ": " + bad[0].what);
    t_->xser_ = std::any_of(model_files.begin(), model_files.end(), [&](const std::string& n) { return entries.count("model/" + XserTensorDir(n)); });
    for (const auto& n : model_files) {
      auto r = ParseRankFileName(n);
      if (r->dp != 0) throw Error(Path("model/" + n) + ": model files come from dp rank 0 only");
      model.insert({r->tp, r->pp});
      tp = std::max(tp, r->tp + 1), pp = std::max(pp, r->pp + 1);
    }
    if (model.empty()) throw Error(Path("model") + ": holds no rank files (dp_rank_00_tp_rank_XX_pp_rank_XX.pt)");
    if (!in_memory_ && env_->Exists(Path(kManifestFile))) {
      manifest_ = Manifest::Load(env_, Path(kManifestFile));
      if (manifest_->grid.tp != tp || manifest_->grid.pp != pp)
        throw Error(Path(kManifestFile) + ": records tp=" + std::to_string(manifest_->grid.tp) + " pp=" + std::to_string(manifest_->grid.pp) +
                    " but model/ holds files up to tp rank " + std::to_string(tp - 1) + ", pp rank " + std::to_string(pp - 1));
    }
    for (int p = 0; p < pp; ++p)
      for (int t = 0; t < tp; ++t)
        if (!model.count({t, p})) throw Error(Path(Rel("model", {0, t, p})) + ": missing; the tag holds other ranks' model files (tp " +
                                              std::to_string(tp) + ", pp " + std::to_string(pp) + ")");
    L.grid.tp = tp, L.grid.pp = pp;
    // Optimizer files: ZeRO-1 when they hold base_state, one per dp rank.
    std::set<std::tuple<int, int, int>> optim;
    int dp = 0;
    for (const auto& n : optim_files)
      if (auto r = ParseRankFileName(n)) optim.insert({r->dp, r->tp, r->pp}), dp = std::max(dp, r->dp + 1);
    L.has_optimizer = !optim.empty() && !opts_.weights_only;
    t_->optimizer_skipped_ = !optim.empty() && opts_.weights_only;
    if (!L.has_optimizer) {
      L.grid.dp = manifest_ ? manifest_->grid.dp : 1;
      return;
    }
    for (int d = 0; d < dp; ++d)
      for (int p = 0; p < pp; ++p)
        for (int t = 0; t < tp; ++t)
          if (!optim.count({d, t, p}))
            throw Error(Path(Rel("optim", {d, t, p})) + ": missing; the tag holds optimizer files for " + std::to_string(dp) +
                        " dp rank(s) of tp " + std::to_string(tp) + ", pp " + std::to_string(pp));
    // ZeRO-1 or plain is read from the files themselves (LoadOptimizerFiles).
    L.grid.dp = dp;
    const Value first = Peek(Rel("optim", {0, 0, 0}));
    L.grid.zero1 = first.is_dict() && first.as_dict().Find("base_state") != nullptr;
    if (L.grid.zero1 && dp == 1 && (!manifest_ || manifest_->grid.dp > 1))
      if (const int64_t lost = Zero1SavedAsOneShard(first)) throw Error(Zero1OneShardMessage(Path(Rel("optim", {0, 0, 0})), lost));
    if (!L.grid.zero1) {
      if (dp > 1) throw Error(Path(Rel("optim", {1, 0, 0})) + ": a plain optimizer state dict comes from dp rank 0 only");
      L.grid.dp = manifest_ ? manifest_->grid.dp : 1;
    } else if (manifest_ && (manifest_->grid.dp != dp || !manifest_->grid.zero1)) {
      throw Error(Path(kManifestFile) + ": records dp=" + std::to_string(manifest_->grid.dp) + (manifest_->grid.zero1 ? " with" : " without") +
                  " ZeRO-1, but optim/ holds ZeRO-1 files for " + std::to_string(dp) + " dp rank(s)");
    }
  }

  void LoadModelFiles() {
    const RankGrid& g = t_->layout_.grid;
    ranks_.resize(static_cast<size_t>(g.tp) * g.pp);
    for (int p = 0; p < g.pp; ++p)
      for (int t = 0; t < g.tp; ++t) {
        const std::string rel = Rel("model", {0, t, p});
        RankFiles& rf = At(t, p);
        rf.model = Load(rel);
        AsDict(rf.model, Path(rel));
        if (p == 0 && t == 0) t_->ordered_ = rf.model.as_dict().ordered;
      }
  }

  RankFiles& At(int t, int p) { return ranks_[static_cast<size_t>(p) * t_->layout_.grid.tp + t]; }

  // Stage p's layers are the layer numbers in its files: contiguous, in order.
  void LearnStages() {
    const RankGrid& g = t_->layout_.grid;
    std::vector<int64_t> bounds{0};
    for (int p = 0; p < g.pp; ++p) {
      int64_t lo = -1, hi = -1;
      for (const auto& [k, v] : At(0, p).model.as_dict().items) {
        if (!k.is_str()) throw Error(Path(Rel("model", {0, 0, p})) + ": holds a key that is not a string");
        const int l = LayerOfName(k.as_str());
        if (l < 0) continue;
        lo = lo < 0 ? l : std::min<int64_t>(lo, l), hi = std::max<int64_t>(hi, l);
      }
      if (lo < 0) throw Error(Path(Rel("model", {0, 0, p})) + ": holds no decoder layer; every pipeline stage holds at least one");
      if (lo != bounds.back())
        throw Error(Path(Rel("model", {0, 0, p})) + ": starts at layer " + std::to_string(lo) + " but the stage before ends at layer " +
                    std::to_string(bounds.back() - 1) + "; stages must hold consecutive layers");
      bounds.push_back(hi + 1);
    }
    t_->layout_.stage_bounds = bounds;
  }

  static bool SameBytes(const Tensor& a, const Tensor& b) {
    return a.dtype() == b.dtype() && a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous() &&
           std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
  }

  const Tensor* FindTensor(const std::string& suffix, int t = 0) {
    for (int p = 0; p < t_->layout_.grid.pp; ++p)
      for (const auto& [k, v] : At(t, p).model.as_dict().items)
        if (k.as_str().ends_with(suffix) && v.is_tensor()) return &v.as_tensor();
    return nullptr;
  }

  void LearnFormat() {
    TagDescription& L = t_->layout_;
    const int tp = L.grid.tp;
    if (manifest_ && manifest_->model) {
      L.format = *manifest_->model;
      L.format_from_manifest = true;
      CheckHintsAgree(L.format);
      RefineVocabulary(L.format, tp);
    } else if (FamilyOfNames(ModelNames(), Path("model")) == ModelFamily::kHfLlama) {
      LearnHfFormat();
    } else {
      const std::string why = t_->dir_ + (in_memory_ ? " does not record its model format (no hyper_parameters.cfg), "
                                                     : " has no manifest recording its model format (NxD writes none), ");
      ModelFormat& f = L.format;
      const Tensor* norm = FindTensor("final_layernorm.weight");
      const Tensor* emb = FindTensor("embedding.word_embeddings.weight");
      const Tensor* fc2 = FindTensor("mlp.dense_4h_to_h.weight");
      const Tensor* fc1 = FindTensor("mlp.dense_h_to_4h.weight");
      if (!norm || !emb || !fc2 || !fc1 || norm->shape().size() != 1 || emb->shape().size() != 2 || fc2->shape().size() != 2 ||
          fc1->shape().size() != 2)
        throw Error(why + "and its model files do not hold a Megatron decoder's word_embeddings, final_layernorm and mlp weights");
      f.hidden = norm->shape()[0];
      f.layers = L.stage_bounds.back();
      f.ffn = fc2->shape()[1] * tp;
      f.gelu = fc1->shape()[0] * tp == f.ffn;
      f.layernorm = FindTensor("input_layernorm.bias") != nullptr;
      f.bias = FindTensor("self_attention.dense.bias") != nullptr;
      if (const Tensor* pos = FindTensor("position_embeddings.weight")) f.learned_positions = true, f.max_positions = pos->shape()[0];
      // Tied: no output layer (Megatron-LM's naming), or one equal to the embedding (NxDT's).
      const Tensor* out = FindTensor("output_layer.weight");
      f.tied_output = out == nullptr || SameBytes(*out, *emb);
      TakeRecordedConfig();
      // With rope no tensor holds it; the job config does (the longest sequence the rotary table covers).
      if (!f.learned_positions) f.max_positions = hints_.max_positions.value_or(RecordedConfigInt("max_position_embeddings", ModelFormat::kMaxPositions).value_or(0));
      if (!hints_.heads) throw FormatUnknown(why + "so give --heads (model.num_attention_heads)");
      f.heads = *hints_.heads;
      if (f.heads < 1 || f.hidden % f.heads) throw Error("--heads " + std::to_string(f.heads) + " does not divide the hidden size " + std::to_string(f.hidden));
      const Tensor* kv = FindTensor("self_attention.key_value.weight");
      if (!kv) {
        f.kv_heads = f.heads;
      } else if (hints_.kv_heads) {
        f.kv_heads = *hints_.kv_heads;
      } else {
        const int64_t rows = kv->shape()[0], group = 2 * f.head_dim();
        if (rows == group && tp > 1) throw FormatUnknown(why + "and each tp rank holds one KV group, so give --kv_heads (model.num_kv_heads)");
        f.kv_heads = rows * tp / group;
      }
      if (f.kv_heads < 1 || f.heads % f.kv_heads) throw Error("--kv_heads " + std::to_string(f.kv_heads) + " does not divide --heads");
      const int64_t padded = emb->shape()[0] * tp;
      std::optional<int64_t> rule = PaddingRule(padded, tp);
      if (hints_.vocab_size) {
        if (!rule) {
          // A vocabulary without a rule (--model_config's vocab_size on NNM's HF -> NNM converter's output, which
          // records no hyper_parameters): the rule that gives the rows read, said so.
          rule = ModelFormat::PaddingRuleGiving(*hints_.vocab_size, padded, tp);
          if (!rule)
            throw Error(t_->dir_ + ": its word_embeddings hold " + std::to_string(padded) + " rows over tp " + std::to_string(tp) +
                        ", which no make_vocab_size_divisible_by gives from vocab_size " + std::to_string(*hints_.vocab_size));
          t_->format_notes_.push_back("make_vocab_size_divisible_by " + std::to_string(*rule) + " inferred: it pads vocab_size " +
                                      std::to_string(*hints_.vocab_size) + " to the " + std::to_string(padded) + " word_embeddings rows at tp " +
                                      std::to_string(tp) + (*rule == ModelFormat::kNnmDefaultPaddingRule ? " (NNM's default)" : "") +
                                      "; give --make_vocab_size_divisible_by if the job used another");
        }
        f.vocab_size = *hints_.vocab_size, f.make_vocab_size_divisible_by = *rule;
      } else {
        f.vocab_size = padded;  // every row is kept as vocabulary
        f.make_vocab_size_divisible_by = rule.value_or(1);
        if (rule && !hints_.make_vocab_size_divisible_by)
          t_->format_notes_.push_back("vocabulary padded to a multiple of " + std::to_string(*rule) + " x tp (make_vocab_size_divisible_by in the job config in " +
                                      "user_content.pt); its true size is not recorded, so all " + std::to_string(padded) + " rows are taken as vocabulary: " +
                                      "at a tp that is not a multiple of " + std::to_string(tp) + ", give --vocab_size");
      }
      // Not in the tensors: the job config an NxDT tag records, hints, else the defaults (said so).
      TakeForwardHints(f, "layernorm_epsilon", "--rope_theta, --layernorm_epsilon");
      if (f.vocab_size < 1 || f.make_vocab_size_divisible_by < 1 || f.PaddedVocab(tp) != padded)
        throw Error(t_->dir_ + ": its word_embeddings hold " + std::to_string(padded) + " rows over tp " + std::to_string(tp) +
                    ", not vocab_size " + std::to_string(f.vocab_size) + " padded to a multiple of " +
                    std::to_string(f.make_vocab_size_divisible_by) + " x " + std::to_string(tp));
    }
    if (const std::string why = L.format.CheckTensorParallel(tp); !why.empty()) throw Error(t_->dir_ + ": " + why);
    t_->params_ = LogicalParameters(L.format, tp);
    // GPT's tied output copy: NxDT's language_model.output_layer.weight on the last stage, or
    // Megatron-LM's word_embeddings.weight there (pp > 1) and nothing at pp = 1.
    if (L.format.tied_output) {
      const Dict& last = At(0, L.grid.pp - 1).model.as_dict();
      L.tied_naming = last.Find(kMegatronLmTiedCopy) || (L.grid.pp == 1 && !last.Find(kTiedOutputCopy)) ? TiedCopyNaming::kMegatronLm
                                                                                                          : TiedCopyNaming::kNxdt;
    }
  }

  // Every model file holds exactly its stage's parameters, shaped by the rules.
  void CheckModelFiles() {
    const TagDescription& L = t_->layout_;
    std::map<std::tuple<std::string, StateField, int64_t>, int> owner;
    for (int p = 0; p < L.grid.pp; ++p) {
      const auto stage = StageParameters(t_->params_, L.stage_bounds, p, L.tied_naming);
      for (int t = 0; t < L.grid.tp; ++t) {
        const std::string where = Path(Rel("model", {0, t, p}));
        const Dict& d = At(t, p).model.as_dict();
        std::map<std::string, size_t> place;  // the stage's parameters, by name: NxD loads by name, so any key order
        for (size_t i = 0; i < stage.size(); ++i) place[stage[i].name] = i;
        std::vector<bool> seen(stage.size());
        std::string prev;
        for (const auto& [k, v] : d.items) {
          if (!k.is_str()) throw Error(where + ": holds a key that is not a string");
          const std::string& name = k.as_str();
          if (auto it = place.find(name); it != place.end()) {
            if (seen[it->second]) throw Error(where + ": '" + name + "' appears twice");
            seen[it->second] = true;
            const StageParam& sp = stage[it->second];
            const Tensor& x = AsTensor(v, where + ": '" + name + "'");
            const auto want = LocalShape(*sp.rule, L.format, L.grid.tp, t);
            if (x.shape() != want)
              throw Error(where + ": '" + name + "' has shape " + ShapeOf(x) + " but " + L.format.Describe() + " at tp " +
                          std::to_string(L.grid.tp) + " gives tp rank " + std::to_string(t) + " " + ShapeString(want));
            if (!sp.tied_copy()) {
              AddRuns(*sp.rule, StateField::kParam, t, x, FileOf(x, Rel("model", {0, t, p})), 0, want[0], want[0], owner, x.dtype(),
                      where + ": '" + name + "'");
            } else if (const Value* e = At(t, 0).model.as_dict().Find(sp.rule->name); !e || !e->is_tensor() || !SameBytes(x, e->as_tensor())) {
              // A tied copy is read from the embedding; one that differs would be lost silently.
              throw Error(where + ": '" + name + "' is GPT's tied output layer (share_embeddings_and_output_weights), but it differs from " +
                          Path(Rel("model", {0, t, 0})) + "'s '" + sp.rule->name + "'");
            }
            prev = name;
            continue;
          }
          const int layer = LayerOfName(name);
          const bool known = std::any_of(t_->params_.begin(), t_->params_.end(), [&](const ParamRule& r) { return r.name == name; });
          if (known || name == kMegatronLmTiedCopy)
            throw Error(where + ": '" + name + "' belongs to another pipeline stage: stage " + std::to_string(p) + " holds layers " +
                        std::to_string(L.stage_bounds[p]) + ".." + std::to_string(L.stage_bounds[p + 1] - 1) +
                        (p == 0 ? " and the embedding" : "") + (p + 1 == L.grid.pp ? " and the final norm and output layer" : ""));
          if (layer < 0 || !(name.ends_with(".inv_freq") || name.ends_with("._extra_state")))
          {
            if (const auto other = FamilyOfName(name); other && *other != L.format.family)
              throw Error(where + ": '" + name + "' is a " + FamilyName(*other) + " name, but the tag's model is " + FamilyName(L.format.family) +
                          ": a tag mixing model families is refused");
            throw Error(where + ": '" + name + "' is not a parameter of " + L.format.Describe() + " that ckpt-reshard knows how to split");
          }
          if (t == 0) t_->buffers_.push_back({name, prev, layer, v});
          prev = name;
        }
        for (size_t i = 0; i < stage.size(); ++i)
          if (!seen[i]) throw Error(where + ": has no '" + stage[i].name + "'");
      }
    }
  }

  // Indexes a local tensor's rows [row_lo, row_hi) held by `x` (ZeRO-1: one
  // dp shard of them, whose row 0 is row_lo); `rows` is the local tensor's dim 0.
  // A strided `x` (a transposed o_proj) is indexed a row at a time, each
  // extent stepping through storage by its column stride.
  void AddRuns(const ParamRule& rule, StateField field, int t, const Tensor& x, const MappedFile* file, int64_t row_lo, int64_t row_hi,
               int64_t rows, std::map<std::tuple<std::string, StateField, int64_t>, int>& owner, DType dtype, const std::string& where) {
    const TagDescription& L = t_->layout_;
    auto& idx = t_->index_[{rule.name, field}];
    if (!idx.typed) idx.dtype = dtype, idx.typed = true;
    if (dtype != idx.dtype) throw Error(where + " is " + std::string(DTypeName(dtype)) + " but other ranks hold " + std::string(DTypeName(idx.dtype)));
    row_hi = std::min(row_hi, rows);
    if (row_hi <= row_lo) return;
    const auto local = LocalShape(rule, L.format, L.grid.tp, t);
    const int64_t inner = ShapeNumel(local) / local[0];
    const size_t es = ElementSize(dtype);
    const uint8_t* data = x.data();
    const bool dense = x.is_contiguous();
    const int64_t s0 = x.dim() > 0 ? x.strides()[0] : 1, s1 = x.dim() > 1 ? x.strides()[1] : 1;  // strided x only
    for (const Run& run : LocalRuns(rule, L.format, L.grid.tp, t)) {
      // Replicas (norms on every tp rank, KV heads NxD repeats) are read from
      // their first holder; the other copies are compared with it (CompareReplicas).
      const int holder = owner.try_emplace({rule.name, field, run.logical}, t).first->second;
      auto add = [&](const ShardedTag::Extent& e) {
        if (holder == t) idx.extents.push_back(e);
        else replicas_.push_back({rule.name, field, e, holder, t});
      };
      // Local row r's elements [c, c + n) hold logical elements from `logical`.
      auto add_row = [&](int64_t r, int64_t c, int64_t n, int64_t logical) {
        const int64_t at = dense ? (r - row_lo) * inner + c : (r - row_lo) * s0 + c * s1;
        add({static_cast<uint64_t>(logical), static_cast<uint64_t>(logical + n), data + at * es, file, dense ? 1 : s1});
      };
      if (rule.split == SplitDim::kColumns) {  // each local row holds `run.count` columns from local column run.local
        const int64_t width = rule.shape[1];
        for (int64_t r = row_lo; r < row_hi; ++r) add_row(r, run.local, run.count, r * width + run.logical);
        continue;
      }
      const int64_t lo = std::max(row_lo, run.local), hi = std::min(row_hi, run.local + run.count);
      if (lo >= hi) continue;
      const int64_t g = run.logical + (lo - run.local);
      if (dense) {
        add({static_cast<uint64_t>(g * inner), static_cast<uint64_t>((g + hi - lo) * inner), data + (lo - row_lo) * inner * es, file, 1});
        continue;
      }
      for (int64_t r = lo; r < hi; ++r) add_row(r, 0, inner, (g + r - lo) * inner);
    }
  }

  // Every replica equals its first holder's copy, byte for byte: NxD keeps
  // replicated tensors equal (tp all-reduces their gradients; KV groups sum
  // theirs, parallel_state.py arrange_kv_groups), so a difference is damage or
  // a layout read under the wrong rule, and reading one copy would hide it.
  void CompareReplicas() {
    std::vector<uint8_t> want, got;
    for (const Replica& r : replicas_) {
      const size_t es = ElementSize(t_->index_.at({r.name, r.field}).dtype);
      const uint64_t n = r.extent.end - r.extent.begin;
      for (uint64_t at = 0; at < n;) {
        const uint64_t take = std::min<uint64_t>(n - at, (uint64_t{1} << 20) / es);
        want.resize(take * es);
        Touched touched;
        t_->Read(r.name, r.field, r.extent.begin + at, want, &touched);
        got.resize(take * es);
        ShardedTag::CopyOut(r.extent, at, take, es, got.data(), &touched);
        const bool same = want == got;
        if (!same) {
          const auto& f = t_->layout_.format;
          const std::string rule = f.kv_size_multiplier > 1 ? std::string(" under kv_size_multiplier ") + std::to_string(f.kv_size_multiplier) +
                                                                  " (" + BackendName(f.hw_backend) + ")"
                                                            : "";
          throw Error(t_->dir_ + ": '" + r.name + "' (" + FieldName(r.field) + "): tp ranks " + std::to_string(r.holder) + " and " +
                      std::to_string(r.rank) + " hold different copies of logical elements " + std::to_string(r.extent.begin) + ".." +
                      std::to_string(r.extent.end - 1) + ", which both replicate" + rule +
                      " (NxD keeps replicas equal); --trust_first_replica reads tp rank " + std::to_string(r.holder) + "'s");
        }
        at += take;
      }
    }
  }

  void LoadOptimizerFiles() {
    TagDescription& L = t_->layout_;
    const int files = L.grid.zero1 ? L.grid.dp : 1;
    std::map<std::tuple<std::string, StateField, int64_t>, int> owner;
    bool first = true;
    for (int p = 0; p < L.grid.pp; ++p) {
      const auto stage = StageParameters(t_->params_, L.stage_bounds, p, L.tied_naming);
      std::vector<std::string> names;
      for (const auto& sp : stage) names.push_back(sp.name);
      const std::string same_stage_copy = SameStageTiedCopy(stage);
      auto stage_param = [&](const std::string& name) -> const StageParam& {
        return stage[std::find(names.begin(), names.end(), name) - names.begin()];
      };
      for (int t = 0; t < L.grid.tp; ++t) {
        for (int d = 0; d < files; ++d) {
          const std::string rel = Rel("optim", {d, t, p}), where = Path(rel);
          const Value v = Load(rel);
          const Dict& top = AsDict(v, where);
          const bool zero1 = top.Find("base_state") != nullptr;
          if (zero1 != L.grid.zero1)
            throw Error(where + (zero1 ? ": is a ZeRO-1 state dict (base_state), but the tag has one optimizer file per stage"
                                       : ": is a plain state dict, but the tag has ZeRO-1 files for " + std::to_string(L.grid.dp) + " dp ranks"));
          for (const auto& [k, _] : top.items) {
            const std::string key = k.is_str() ? k.as_str() : "?";
            static const std::set<std::string> kKnown{"state", "param_groups", "base_state", "shape_info", "sharded_master_weights"};
            if (!kKnown.count(key)) throw Error(where + ": holds '" + key + "', which ckpt-reshard does not know how to re-lay");
          }
          std::vector<int64_t> file_ids;  // each position's id in the file (torch's: shared by a parameter listed twice)
          const Grouping order = Ids(top.At("param_groups"), names, same_stage_copy, where, first, &file_ids);
          if (first) t_->param_groups_ = top.At("param_groups"), L.master_weights = top.Find("sharded_master_weights") != nullptr, first = false;
          // Shards of another size than dp's (a context-parallel save lost some) are told as such,
          // before a shape check would name one field without why.
          if (zero1)
            if (const std::string why = Zero1ShardProblem(v, L.grid.dp, where, [&](int64_t id) {
                  const std::string n = "parameter id " + std::to_string(id);
                  return id < static_cast<int64_t>(order.order.size()) ? n + " (" + order.order[id].name + ")" : n;
                });
                !why.empty())
              throw Error(why);
          if (zero1 && !AsDict(top.At("state"), where + ": 'state'").items.empty())
            throw Error(where + ": ZeRO-1 'state' is not empty; its entries have no known place in a re-laid file");
          const Dict& state = AsDict(top.At(zero1 ? "base_state" : "state"), where + ": '" + (zero1 ? "base_state" : "state") + "'");
          const Dict* masters = top.Find("sharded_master_weights") ? &AsDict(top.At("sharded_master_weights"), where + ": masters") : nullptr;
          if ((masters != nullptr) != L.master_weights) throw Error(where + ": has master weights where other files have none, or the reverse");
          const Dict* shapes = zero1 ? &AsDict(top.At("shape_info"), where + ": 'shape_info'") : nullptr;
          // GPT's tied weight listed twice (NeMo's groups at pp = 1): torch gives both positions the
          // later one's id, so a plain state dict keys its state once, by that id; a ZeRO-1 one keys its
          // shards by position, and NxD's gradient hook leaves the copy's shard without state (both
          // observed: tests/data/upstream/nxdt_megatron). The state is read from the embedding's position.
          std::set<int64_t> claimed;
          for (size_t id = 0; id < order.order.size(); ++id) {
            const int64_t shared = file_ids[id];
            if (shared == static_cast<int64_t>(id)) continue;
            const StageParam& a = stage_param(order.order[id].name);
            const StageParam& b = stage_param(order.order[shared].name);
            if (!b.tied_copy() || b.rule != a.rule)
              throw Error(where + ": param_groups give parameter " + std::to_string(id) + " (" + a.name + ") the id of parameter " +
                          std::to_string(shared) + " (" + b.name + "): torch shares an id only between two names of one tied parameter");
          }
          for (size_t id = 0; id < order.order.size(); ++id) {
            const std::string& name = order.order[id].name;
            const StageParam& sp = stage_param(name);
            const ParamRule& rule = *sp.rule;
            const std::string at = where + ": parameter id " + std::to_string(id) + " (" + name + ")";
            const int64_t key = zero1 ? static_cast<int64_t>(id) : file_ids[id];
            const Value* e = EntryById(state, static_cast<size_t>(key));
            if (!e && sp.tied_copy()) continue;  // read from the embedding
            if (!e) throw Error(at + " has no state");
            claimed.insert(key);
            const Dict& entry = AsDict(*e, at);
            for (const auto& [k, _] : entry.items)
              if (!k.is_str() || (k.as_str() != "step" && k.as_str() != "exp_avg" && k.as_str() != "exp_avg_sq"))
                throw Error(at + " holds '" + (k.is_str() ? k.as_str() : "?") + "', not AdamW's step, exp_avg and exp_avg_sq");
            const auto local = LocalShape(rule, L.format, L.grid.tp, t);
            auto want = local;
            const int64_t rows = local[0];
            const int64_t shard = zero1 ? Zero1ShardRows(rows, L.grid.dp) : rows;
            want[0] = shard;
            if (zero1) {
              const Value* s = EntryById(*shapes, id);
              std::vector<int64_t> dims;
              if (s && s->is_seq())
                for (const auto& x : s->as_seq().items) dims.push_back(AsInteger(x, at + " shape_info"));
              if (dims != local) throw Error(at + ": shape_info is " + (s ? ShapeString(dims) : "missing") + ", not its local shape " + ShapeString(local));
            }
            if (sp.tied_copy()) {  // the embedding's state, updated alike: read from the embedding
              // Beside the embedding (pp = 1), its moments must be the embedding's: a copy that
              // differs would be lost. Not its master weight: NxD's gradient hook leaves that stale.
              const auto emb = std::find_if(order.order.begin(), order.order.end(), [&](const OptimizerSlot& s) { return s.name == rule.name; });
              if (emb != order.order.end()) {
                const size_t pos = emb - order.order.begin();
                const Value* theirs = EntryById(state, static_cast<size_t>(zero1 ? static_cast<int64_t>(pos) : file_ids[pos]));
                for (const char* field : {"exp_avg", "exp_avg_sq"}) {
                  const Value* a = entry.Find(field);
                  const Value* b = theirs && theirs->is_dict() ? theirs->as_dict().Find(field) : nullptr;
                  if (a && b && a->is_tensor() && b->is_tensor() && !SameBytes(a->as_tensor(), b->as_tensor()))
                    throw Error(at + ": GPT's tied output layer has an " + field + " that differs from the embedding's (parameter id " +
                                std::to_string(pos) + "): the copy's state would be lost");
                }
              }
              continue;
            }
            if (!t_->steps_.count(rule.name)) t_->steps_[rule.name] = entry.At("step");
            const std::pair<StateField, const Value*> fields[] = {{StateField::kExpAvg, &entry.At("exp_avg")},
                                                                   {StateField::kExpAvgSq, &entry.At("exp_avg_sq")},
                                                                   {StateField::kMaster, masters ? EntryById(*masters, id) : nullptr}};
            for (const auto& [field, val] : fields) {
              if (field == StateField::kMaster && !masters) continue;
              const std::string fat = at + " " + FieldName(field);
              if (!val) throw Error(fat + " is missing");
              const Tensor& x = AsTensor(*val, fat);
              if (x.shape() != want) throw Error(fat + " has shape " + ShapeOf(x) + ", not " + ShapeString(want));
              AddRuns(rule, field, t, x, FileOf(x, rel), d * shard, (d + 1) * shard, rows, owner, x.dtype(), fat);
            }
          }
          for (const auto& [k, _] : state.items)
            if (!k.is_int() || !claimed.count(k.as_int()))
              throw Error(where + ": holds state for id " + (k.is_int() ? std::to_string(k.as_int()) : "'?'") + ", which none of stage " +
                          std::to_string(p) + "'s " + std::to_string(order.order.size()) + " parameters has");
        }
      }
    }
  }

  // Ties the file's ids to parameters: the grouping whose group sizes the
  // file's param_groups list (ids numbered 0, 1, ... across groups, as torch
  // does). The first file decides among the rules that fit (NxDT's default
  // first); every other file must fit the same rule.
  Grouping Ids(const Value& groups, const std::vector<std::string>& names, const std::string& same_stage_copy, const std::string& where,
               bool first, std::vector<int64_t>* file_ids) {
    const std::vector<size_t> sizes = NonEmpty(ParamGroupSizes(groups, where + ": param_groups", file_ids));
    const ModelFormat& f = t_->layout_.format;
    std::vector<GroupingRule> rules{GroupingRule::kNxdt, GroupingRule::kNxdtLayerNormDecay};
    if (f.family != ModelFamily::kHfLlama) rules.push_back(GroupingRule::kNameSplit);
    std::string tried;
    // A manifest that records the grouping decides it.
    if (manifest_ && manifest_->optimizer_grouping) rules = {*manifest_->optimizer_grouping};
    for (GroupingRule r : rules) {
      if (!first && r != t_->layout_.grouping) continue;
      Grouping g = FamilyGrouping(f, GroupedNames(names, same_stage_copy, r), r);
      if (NonEmpty(g.GroupSizes()) == sizes) {
        if (first) t_->layout_.grouping = r;
        return g;
      }
      tried += (tried.empty() ? "" : "; ") + g.id + ": " + g.description;
    }
    std::string got;
    for (size_t s : sizes) got += (got.empty() ? "" : ", ") + std::to_string(s);
    throw Error(where + ": its param_groups hold groups of sizes [" + got + "] over the stage's " + std::to_string(names.size()) +
                " parameters, which " + (first ? "fit no grouping shardkit knows (" : "do not fit the grouping of the first optimizer file (") +
                tried + ")");
  }

  // Every key of tp rank 0's model files, over the stages.
  std::vector<std::string> ModelNames() {
    std::vector<std::string> names;
    for (int p = 0; p < t_->layout_.grid.pp; ++p)
      for (const auto& [k, v] : At(0, p).model.as_dict().items)
        if (k.is_str()) names.push_back(k.as_str());
    return names;
  }

  // An HF-style tag without a manifest (what NxD's checkpoint_converter.py
  // and NxDT's HF models write): sizes from shapes, the attention layout from
  // the names (LlamaAttention.__init__), heads from a hint, and NxD's KV
  // replication from the data: ranks holding equal KV rows (InferKvReplication).
  void LearnHfFormat() {
    TagDescription& L = t_->layout_;
    const int tp = L.grid.tp;
    const std::string why = t_->dir_ + " has no manifest recording its model format (NxD writes none), ";
    ModelFormat& f = L.format;
    f.family = ModelFamily::kHfLlama;
    const Tensor* norm = FindTensor(ParamName(f, Module::kFinalNorm));
    const Tensor* emb = FindTensor(ParamName(f, Module::kEmbedding));
    const Tensor* down = FindTensor(ParamName(f, Module::kMlpOut, static_cast<int>(L.stage_bounds[0])));
    if (!norm || !emb || !down || norm->shape().size() != 1 || emb->shape().size() != 2 || down->shape().size() != 2)
      throw Error(why + "and its model files do not hold an HF-style Llama's model.embed_tokens, model.norm and mlp.down_proj weights");
    f.hidden = norm->shape()[0];
    f.layers = L.stage_bounds.back();
    f.ffn = down->shape()[1] * tp;
    f.vocab_size = emb->shape()[0] * tp;
    f.make_vocab_size_divisible_by = 1;
    f.tied_output = FindTensor(ParamName(f, Module::kOutput)) == nullptr;
    // The attention tensors name the layout (NxDT's model.qkv_linear and model.fuse_qkv).
    const auto k_leaf = HfAttentionOfNames(ModelNames(), f);
    if (!k_leaf)
      throw Error(why + "and its model files hold no attention weights of NxDT's HF-style Llama (qkv_proj.weight_qkv, qkv_proj.weight_q/_k/_v, qkv_proj.weight or q_proj/k_proj/v_proj)");
    // A job config's attention flags must name these tensors (LlamaAttention.__init__'s choice).
    const bool fuse_shows = f.qkv_linear || f.fuse_qkv;  // plain q/k/v say nothing of fuse_qkv (it is ignored with GQA)
    if ((hints_.qkv_linear && *hints_.qkv_linear != f.qkv_linear) || (hints_.fuse_qkv && fuse_shows && *hints_.fuse_qkv != f.fuse_qkv))
      throw Error(t_->dir_ + ": the job config says model.qkv_linear " + (hints_.qkv_linear && *hints_.qkv_linear ? "True" : "False") +
                  ", model.fuse_qkv " + (hints_.fuse_qkv.value_or(true) ? "True" : "False") + ", but the tag holds '" + *k_leaf + "'");
    auto against = [&](const std::optional<int64_t>& hint, int64_t seen, const char* what) {
      if (hint && *hint != seen)
        throw Error(t_->dir_ + ": the given " + what + " is " + std::to_string(*hint) + ", but the tensors give " + std::to_string(seen));
    };
    against(hints_.hidden, f.hidden, "hidden size");
    against(hints_.ffn, f.ffn, "FFN width (intermediate_size)");
    against(hints_.layers, f.layers, "layer count");
    against(hints_.vocab_size, f.vocab_size, "vocabulary (the HF-style family does not pad it)");
    if (!hints_.heads) throw FormatUnknown(why + "so give --heads, or --model_config with the model's HF config.json");
    f.heads = *hints_.heads;
    if (f.heads < 1 || f.hidden % f.heads) throw Error("--heads " + std::to_string(f.heads) + " does not divide the hidden size " + std::to_string(f.hidden));
    if (f.heads % tp) throw Error(t_->dir_ + ": tp " + std::to_string(tp) + " does not divide the " + std::to_string(f.heads) + " heads");
    const int64_t hd = f.head_dim(), qn = f.heads / tp;
    // KV heads per rank, from the local rows of K.
    const Tensor* kv = FindTensor("." + *k_leaf);
    const int64_t rows = kv->shape().at(0);
    int64_t n = 0, k_row = 0;  // KV heads per rank; K's first local row
    if (f.qkv_linear && f.fuse_qkv) n = (rows / hd - qn) / 2, k_row = qn * hd;
    else if (f.fuse_qkv) n = qn, k_row = qn * hd;
    else n = rows / hd;
    const int64_t want_rows = f.fuse_qkv ? (qn + 2 * n) * hd : n * hd;
    if (n < 1 || rows != want_rows)
      throw Error(t_->dir_ + ": '" + *k_leaf + "' has " + std::to_string(rows) + " rows per tp rank, which no whole " +
                  "number of KV heads of head_dim " + std::to_string(hd) + " gives with " + std::to_string(qn) + " query heads per rank");
    if (f.qkv_linear) {
      // Tp ranks whose K and V rows of the first layer are equal (stage 0's files hold layer 0): a fused
      // weight_qkv holds them as rows [k_row, k_row + 2 n hd), weight_k and weight_v whole.
      const int layer = static_cast<int>(L.stage_bounds[0]);
      std::vector<std::pair<std::string, int64_t>> pieces;  // tensor, first row
      if (f.fuse_qkv) pieces = {{ParamName(f, Module::kQkv, layer), k_row}};
      else pieces = {{ParamName(f, Module::kKey, layer), 0}, {ParamName(f, Module::kValue, layer), 0}};
      const int64_t piece_rows = f.fuse_qkv ? 2 * n * hd : n * hd;
      auto kv_rows = [&](int t, const std::pair<std::string, int64_t>& piece) -> std::optional<Tensor> {
        const Value* v = At(t, 0).model.as_dict().Find(piece.first);
        if (!v || !v->is_tensor() || v->as_tensor().shape() != kv->shape()) return std::nullopt;
        return v->as_tensor().Narrow0(piece.second, piece.second + piece_rows).Contiguous();
      };
      const KvReplicationSeen seen = InferKvReplication(tp, [&](int a, int b) {
        for (const auto& piece : pieces) {
          const auto x = kv_rows(a, piece), y = kv_rows(b, piece);
          if (!x || !y || std::memcmp(x->data(), y->data(), x->nbytes()) != 0) return false;
        }
        return true;
      });
      const std::string data = "the tp ranks holding equal KV rows form the groups " + seen.groups;
      if (hints_.kv_size_multiplier && *hints_.kv_size_multiplier != seen.multiplier)
        throw Error(t_->dir_ + ": --kv_size_multiplier " + std::to_string(*hints_.kv_size_multiplier) + " contradicts the data: " + data +
                    ", so kv_size_multiplier is " + std::to_string(seen.multiplier));
      f.kv_size_multiplier = seen.multiplier;
      f.hw_backend = seen.backend;
      if (hints_.hw_backend) {
        if (seen.backend != HwBackend::kUnknown && *hints_.hw_backend != seen.backend)
          throw Error(t_->dir_ + ": --hw_backend " + BackendName(*hints_.hw_backend) + " contradicts the data: " + data + ", which is " +
                      BackendName(seen.backend) + "'s " + (seen.backend == HwBackend::kTrn1 ? "interleaved" : "consecutive") +
                      " KV replication" +
                      (*hints_.hw_backend == HwBackend::kTrn2
                           ? ". NxD's checkpoint_converter.py writes Trn2 tags with the Trn1 rule (its K/V branch has no hw_backend check), "
                             "so such a tag pairs some ranks' queries with the wrong KV head; convert it again from the full state"
                           : ""));
        f.hw_backend = *hints_.hw_backend;
      }
      t_->format_notes_.push_back("kv_size_multiplier " + std::to_string(seen.multiplier) + (seen.multiplier > 1 && seen.multiplier < tp ? std::string(" and ") + BackendName(seen.backend) : "") +
                                  " inferred from the data: " + data +
                                  (seen.backend == HwBackend::kUnknown && !hints_.hw_backend ? " (the backend does not matter for this layout)" : ""));
    } else if (hints_.kv_size_multiplier && *hints_.kv_size_multiplier != 1) {
      throw Error(t_->dir_ + ": --kv_size_multiplier " + std::to_string(*hints_.kv_size_multiplier) + " contradicts the tag: it has no qkv_linear " +
                  "attention (qkv_proj.weight_*), so NxD replicates no KV heads");
    } else if (hints_.hw_backend) {
      f.hw_backend = *hints_.hw_backend;
    }
    if ((n * tp) % f.kv_size_multiplier) throw Error(t_->dir_ + ": " + std::to_string(n) + " KV heads per tp rank do not fit kv_size_multiplier " + std::to_string(f.kv_size_multiplier));
    f.kv_heads = n * tp / f.kv_size_multiplier;
    against(hints_.kv_heads, f.kv_heads, "number of KV heads");
    if (f.heads % f.kv_heads) throw Error(t_->dir_ + ": the " + std::to_string(f.kv_heads) + " KV heads do not divide the " + std::to_string(f.heads) + " heads");
    f.max_positions = hints_.max_positions.value_or(0);
    TakeForwardHints(f, "rms_norm_eps", "--model_config, or --rope_theta and --layernorm_epsilon,");
  }

  // What the forward pass needs beyond the tensors, for a tag without a manifest: the hints
  // (or the job config an NxDT tag records), else the defaults, said so.
  void TakeForwardHints(ModelFormat& f, const std::string& eps_name, const std::string& flags) {
    const bool rope = !f.learned_positions;  // GPT's learned positions have no rotary base to assume
    if ((rope && !hints_.rope_theta) || !hints_.norm_eps)
      t_->format_notes_.push_back((rope ? std::string("rope_theta ") + (hints_.rope_theta ? "given" : "10000 assumed") + ", " : std::string()) +
                                  eps_name + " " + (hints_.norm_eps ? "given" : "1e-05 assumed") + ": the tag does not record " +
                                  (rope ? "them" : "it") + " (" + flags + " give them)");
    f.rope_theta = hints_.rope_theta.value_or(f.rope_theta);
    f.norm_eps = hints_.norm_eps.value_or(f.norm_eps);
    f.rotary_percentage = hints_.rotary_percentage.value_or(f.rotary_percentage);
    if (const std::string bad = f.CheckSizes(); !bad.empty()) throw Error(t_->dir_ + ": " + bad);
  }

  // A hint that contradicts the model format a manifest records is refused,
  // naming both. Not the vocabulary: a writer that could not tell the padding
  // records every row as vocabulary, which a true size may refine
  // (RefineVocabulary decides).
  void CheckHintsAgree(const ModelFormat& f) const {
    const std::string where = in_memory_ ? t_->dir_ : Path(kManifestFile);
    auto check = [&]<typename T>(const std::optional<T>& hint, T recorded, const char* flag) {
      if (hint && *hint != recorded)
        throw Error(std::string(flag) + " " + std::to_string(*hint) + " contradicts " + where + ", which records " + std::to_string(recorded));
    };
    check(hints_.heads, f.heads, "--heads"), check(hints_.kv_heads, f.kv_heads, "--kv_heads");
    check(hints_.rope_theta, f.rope_theta, "--rope_theta"), check(hints_.norm_eps, f.norm_eps, "--layernorm_epsilon");
    check(hints_.rotary_percentage, f.rotary_percentage, "--rotary_percentage");
    check(hints_.kv_size_multiplier, f.kv_size_multiplier, "--kv_size_multiplier");
    check(hints_.hidden, f.hidden, "the hidden size"), check(hints_.ffn, f.ffn, "the ffn size"), check(hints_.layers, f.layers, "num_layers");
    if (hints_.hw_backend && f.hw_backend != HwBackend::kUnknown && *hints_.hw_backend != f.hw_backend)
      throw Error(std::string("--hw_backend ") + BackendName(*hints_.hw_backend) + " contradicts " + where + ", which records " +
                  BackendName(f.hw_backend));
  }

  // A manifest records the vocabulary its writer knew, which for a tag that
  // recorded none (NxD's, NNM's) is every row. --vocab_size (and
  // --make_vocab_size_divisible_by) refine it when they give the rows the
  // tag holds at its tp, so a later tp pads the true size as NxDT does; hints
  // that give other rows are refused. The HF-style family pads nothing: its
  // vocabulary is the rows, and a rule given for it is ignored (LearnHfFormat).
  void RefineVocabulary(ModelFormat& f, int tp) {
    const std::string where = in_memory_ ? t_->dir_ : Path(kManifestFile);
    if (f.family != ModelFamily::kMegatron) {  // as LearnHfFormat: no padding rule to refine, the vocabulary is the rows
      if (hints_.vocab_size && *hints_.vocab_size != f.vocab_size)
        throw Error("--vocab_size " + std::to_string(*hints_.vocab_size) + " contradicts " + where + ", which records " + std::to_string(f.vocab_size) +
                    " (the HF-style family does not pad it)");
      return;
    }
    if (!hints_.vocab_size && !hints_.make_vocab_size_divisible_by) return;
    ModelFormat refined = f;
    if (hints_.vocab_size) refined.vocab_size = *hints_.vocab_size;
    if (hints_.make_vocab_size_divisible_by) refined.make_vocab_size_divisible_by = *hints_.make_vocab_size_divisible_by;
    if (refined.vocab_size == f.vocab_size && refined.make_vocab_size_divisible_by == f.make_vocab_size_divisible_by) return;
    const bool same_rows = refined.vocab_size >= 1 && refined.vocab_size <= ModelFormat::kMaxVocab &&
                           refined.make_vocab_size_divisible_by >= 1 && refined.make_vocab_size_divisible_by <= ModelFormat::kMaxPaddingRule &&
                           refined.PaddedVocab(tp) == f.PaddedVocab(tp);
    if (!same_rows)
      throw Error("--vocab_size " + std::to_string(refined.vocab_size) + " padded to a multiple of " + std::to_string(refined.make_vocab_size_divisible_by) +
                  " x tp " + std::to_string(tp) + " contradicts " + where + ", which records vocab_size " + std::to_string(f.vocab_size) +
                  ", make_vocab_size_divisible_by " + std::to_string(f.make_vocab_size_divisible_by) + " (" + std::to_string(f.PaddedVocab(tp)) + " rows)");
    t_->format_notes_.push_back("vocab_size " + std::to_string(refined.vocab_size) + ", make_vocab_size_divisible_by " +
                                std::to_string(refined.make_vocab_size_divisible_by) + " given: the same " + std::to_string(f.PaddedVocab(tp)) +
                                " rows as " + where + " records (vocab_size " + std::to_string(f.vocab_size) + ", make_vocab_size_divisible_by " +
                                std::to_string(f.make_vocab_size_divisible_by) + ")");
    f = refined;
  }

  // An NxDT tag records its job's model config in user_content.pt
  // (hyper_parameters.cfg, NxDT nlp_overrides.py save_checkpoint keeps
  // Lightning's hyper_parameters), and nnm2nxdt-ckpt carries NNM's there:
  // heads and KV heads come from there when no hint gives them, and a hint
  // that contradicts it is refused. A plain dict or omegaconf's DictConfig.
  void TakeRecordedConfig() {
    const Value* cfg = RecordedConfig();
    if (!cfg) return;
    // The first of `keys` the config holds as a number gives `hint` (an int hint takes integers only).
    auto take = [&]<typename T>(std::initializer_list<const char*> keys, std::optional<T>& hint, const char* flag, bool note) {
      for (const char* key : keys) {
        const Value* v = ConfigEntry(*cfg, key);
        if (!v || !(v->is_int() || (std::is_floating_point_v<T> && v->is_float()))) continue;
        const T x = v->is_int() ? static_cast<T>(v->as_int()) : static_cast<T>(v->as_float());
        if (hint && *hint != x) throw Error(JobConfigContradiction(flag, std::to_string(*hint), key, std::to_string(x)));
        if (!hint && note) t_->format_notes_.push_back(std::string(key) + " " + std::to_string(x) + " from the job config in user_content.pt");
        hint = x;
        return;
      }
    };
    take({"num_attention_heads"}, hints_.heads, "--heads", true);
    take({"num_kv_heads"}, hints_.kv_heads, "--kv_heads", true);
    // NxDT's megatron models name the rotary base position_freq_base (megatron_gpt_model.py).
    take({"position_freq_base", "rope_theta"}, hints_.rope_theta, "--rope_theta", false);
    take({"layernorm_epsilon"}, hints_.norm_eps, "--layernorm_epsilon", false);
    take({"rotary_percentage"}, hints_.rotary_percentage, "--rotary_percentage", false);
  }

  // The job config a tag records (hyper_parameters.cfg in user_content.pt), or null.
  const Value* RecordedConfig() {
    const Value* uc = UserContentFile();
    return uc ? RecordedJobConfig(*uc) : nullptr;
  }

  // "<flag> <hint> contradicts .../user_content.pt, whose job config (hyper_parameters.cfg.<key>) is <recorded>"
  std::string JobConfigContradiction(const std::string& flag, const std::string& hint, const std::string& key, const std::string& recorded) {
    return flag + " " + hint + " contradicts " + Path(kUserContentFile) + ", whose job config (hyper_parameters.cfg." + key + ") is " + recorded;
  }

  // An integer in [1, max] the job config a tag records (NxDT's, or NNM's
  // that nnm2nxdt-ckpt carries) holds under `key`, or none.
  std::optional<int64_t> RecordedConfigInt(const char* key, int64_t max) {
    const Value* cfg = RecordedConfig();
    const Value* v = cfg ? ConfigEntry(*cfg, key) : nullptr;
    if (!v || !v->is_int() || v->as_int() < 1 || v->as_int() > max) return std::nullopt;
    return v->as_int();
  }

  // The padding rule (make_vocab_size_divisible_by) for word_embeddings of
  // `rows` at `tp`: the hint, else the job config's when it gives those rows
  // (one that does not is noted and ignored), else none. A hint the job
  // config contradicts is refused. With the rule, a tp that is a multiple of
  // this one pads as Megatron pads the true vocabulary (VocabUtility,
  // padded_vocab_size: a multiple of the rule x tp), although the true size is
  // not recorded: GPT's 50257 tokens, 51200 rows at tp 8, are 53248 at tp 32.
  std::optional<int64_t> PaddingRule(int64_t rows, int tp) {
    std::optional<int64_t> recorded = RecordedConfigInt("make_vocab_size_divisible_by", ModelFormat::kMaxPaddingRule);
    if (recorded && rows % (*recorded * tp) != 0) {
      t_->format_notes_.push_back("make_vocab_size_divisible_by " + std::to_string(*recorded) + " in the job config in user_content.pt does not give its " +
                                  std::to_string(rows) + " word_embeddings rows at tp " + std::to_string(tp) + "; it is ignored");
      recorded.reset();
    }
    const std::optional<int64_t>& hint = hints_.make_vocab_size_divisible_by;
    if (hint && recorded && *hint != *recorded)
      throw Error(JobConfigContradiction("--make_vocab_size_divisible_by", std::to_string(*hint), "make_vocab_size_divisible_by",
                                         std::to_string(*recorded)));
    return hint ? hint : recorded;
  }

  // user_content.pt, loaded once (the model format and the step both read it), or null.
  const Value* UserContentFile() {
    if (!user_content_loaded_) {
      user_content_loaded_ = true;
      if (in_memory_ ? t_->given_.count(kUserContentFile) > 0 : env_->Exists(Path(kUserContentFile))) user_content_ = Peek(kUserContentFile);
    }
    return user_content_ ? &*user_content_ : nullptr;
  }

  void LearnStep() {
    if (manifest_) {
      t_->step_ = manifest_->step, t_->consumed_ = manifest_->consumed_samples;
      t_->recorded_ = manifest_->tensors;
      // A refined vocabulary changes the logical (unpadded) vocab-row tensors: their recorded fingerprints cover other rows.
      const ModelFormat& now = t_->layout_.format;
      const bool vocab_refined = manifest_->model && (manifest_->model->vocab_size != now.vocab_size ||
                                                      manifest_->model->make_vocab_size_divisible_by != now.make_vocab_size_divisible_by);
      if (vocab_refined && t_->recorded_)
        for (const auto& rule : t_->params_)
          if (rule.vocab) t_->recorded_->erase(rule.name);
      return;
    }
    // What the tag records wins over its name, as resume decides (ReadTrainingPosition):
    // a name is a label, and a lying one would otherwise pass into the new tag's manifest.
    const std::string name = std::filesystem::path(t_->dir_).filename().string();
    const std::optional<TagName> tn = ParseTagName(name);
    if (const Value* v = UserContentFile()) {
      // NxD saves whatever user content its caller passes: a dict without
      // NxDT's step entries leaves the step to the name below.
      try {
        const UserContent uc = UserContent::FromValue(*v, Path(kUserContentFile));
        t_->step_ = uc.ResumeStep();
        if (uc.consumed_samples) t_->consumed_ = *uc.consumed_samples;
        else if (tn) t_->consumed_ = tn->consumed_samples;
        else if (auto c = ConsumedSamplesFromTagPath(name)) t_->consumed_ = static_cast<double>(*c);
        else t_->consumed_known_ = false;
        if (tn && tn->step != t_->step_)
          t_->format_notes_.push_back("the tag's name says step " + std::to_string(tn->step) + " but its " + std::string(kUserContentFile) +
                                      " records step " + std::to_string(t_->step_) + ", which is taken");
        return;
      } catch (const Error&) {
      }
    }
    if (tn) {
      t_->step_ = tn->step, t_->consumed_ = tn->consumed_samples;
      return;
    }
    // NxD's llama example names its tags step_<N> (run_llama_nxd.py) and records no samples.
    t_->consumed_known_ = false;
    if (auto n = ParseNxdStepTagName(name)) t_->step_ = *n;
  }

  Env* env_;
  bool in_memory_ = false;  // ShardedTag::FromFiles
  FormatHints hints_;
  TagReadOptions opts_;
  std::optional<Value> user_content_;
  bool user_content_loaded_ = false;
  std::unique_ptr<ShardedTag> t_;
  std::optional<Manifest> manifest_;
  std::vector<RankFiles> ranks_;
  std::map<std::string, const MappedFile*> file_of_;
  struct Replica {
    std::string name;
    StateField field;
    ShardedTag::Extent extent;
    int holder, rank;
  };
  std::vector<Replica> replicas_;
};

std::unique_ptr<ShardedTag> ShardedTag::Open(Env* env, const std::string& tag_dir, const FormatHints& hints, const TagReadOptions& opts) {
  return ShardedTagBuilder(env, WithoutTrailingSeparators(tag_dir), hints, opts).Build();
}

std::unique_ptr<ShardedTag> ShardedTag::FromFiles(const std::string& label, std::map<std::string, Value> files, const Manifest& manifest,
                                                   const FormatHints& hints, const TagReadOptions& opts) {
  ShardedTagBuilder b(Env::Default(), label, hints, opts);
  b.SetInMemory(std::move(files), manifest);
  return b.Build();
}

std::optional<Value> ShardedTag::TagFile(const std::string& name) const {
  if (!given_.empty()) {
    auto it = given_.find(name);
    return it == given_.end() ? std::nullopt : std::optional<Value>(it->second);
  }
  const std::string path = dir_ + "/" + name;
  if (!env_->Exists(path)) return std::nullopt;
  return LoadTagFile(env_, dir_, name);
}

void ShardedTag::CopyOut(const Extent& e, uint64_t from, uint64_t n, size_t es, uint8_t* out, Touched* touched) {
  const uint8_t* src = e.data + from * e.stride * es;
  if (e.stride == 1) {
    std::memcpy(out, src, n * es);
  } else {
    for (uint64_t i = 0; i < n; ++i) std::memcpy(out + i * es, src + i * e.stride * es, es);
  }
  if (touched && n) touched->Add(e.file, src, ((n - 1) * e.stride + 1) * es);
}

DType ShardedTag::dtype(const std::string& name, StateField f) const {
  auto it = index_.find({name, f});
  if (it == index_.end()) throw Error(dir_ + ": holds no " + FieldName(f) + " of " + name);
  return it->second.dtype;
}

const Value& ShardedTag::Step(const std::string& name) const {
  auto it = steps_.find(name);
  if (it == steps_.end()) throw Error(dir_ + ": holds no optimizer step of " + name);
  return it->second;
}

void ShardedTag::Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const {
  const Index& idx = index_.at({name, f});
  const size_t es = ElementSize(idx.dtype);
  const uint64_t end = begin + out.size() / es;
  auto it = std::upper_bound(idx.extents.begin(), idx.extents.end(), begin, [](uint64_t b, const Extent& e) { return b < e.end; });
  // Read-ahead for every run of the range before copying any: runs in many small files (xser
  // has a file per tensor) are then read by the disk at once, not one fault after another.
  // A range across a split dimension touches one run per row and source; a
  // source's runs for successive rows lie one after another in its file, so
  // they are asked for together (not a system call per row). Runs further
  // apart than a page stay separate: the gap is not read.
  struct Ahead {  // bytes [lo, hi) of `file`
    const MappedFile* file;
    const uint8_t *lo, *hi;
  };
  std::vector<Ahead> ahead;
  for (auto p = it; p != idx.extents.end() && p->begin < end; ++p) {
    const uint64_t lo = std::max(begin, p->begin), hi = std::min(end, p->end);
    if (!p->file || lo >= hi) continue;
    const uint8_t* from = p->data + (lo - p->begin) * p->stride * es;
    const uint8_t* to = from + ((hi - lo - 1) * p->stride + 1) * es;
    auto a = std::find_if(ahead.rbegin(), ahead.rend(), [&](const Ahead& x) { return x.file == p->file; });
    if (a != ahead.rend() && from >= a->hi && from - a->hi <= 4096) a->hi = to;
    else ahead.push_back({p->file, from, to});
  }
  // Small reads (a row's pieces of a column split, read row by row) ask for
  // a window of 2 MiB ahead in their file once, and the rows after it come
  // from that window: a system call per row would cost more than it saves.
  constexpr uint64_t kSmall = 256 << 10, kWindow = 2 << 20;
  thread_local std::vector<Ahead> windows;  // this thread's recent windows (a hint: a stale one costs a fault)
  for (const Ahead& a : ahead) {
    if ((end - begin) * es >= kSmall) {
      a.file->Prefetch(a.lo, static_cast<size_t>(a.hi - a.lo));
      continue;
    }
    auto w = std::find_if(windows.begin(), windows.end(), [&](const Ahead& x) { return x.file == a.file && a.lo >= x.lo && a.hi <= x.hi; });
    if (w != windows.end()) continue;
    const uint8_t* hi = std::min(a.file->data() + a.file->size(), std::max(a.hi, a.lo + kWindow));
    a.file->Prefetch(a.lo, static_cast<size_t>(hi - a.lo));
    if (windows.size() >= 8) windows.erase(windows.begin());
    windows.push_back({a.file, a.lo, hi});
  }
  uint64_t at = begin;
  for (; at < end && it != idx.extents.end(); ++it) {
    const uint64_t lo = std::max(at, it->begin), hi = std::min(end, it->end);
    if (lo >= hi) break;
    if (lo > at) std::memset(out.data() + (at - begin) * es, 0, (lo - at) * es);
    CopyOut(*it, lo - it->begin, hi - lo, es, out.data() + (lo - begin) * es, touched);
    at = hi;
  }
  if (at < end) std::memset(out.data() + (at - begin) * es, 0, (end - at) * es);
}

}  // namespace ckpt

#include "ckpt/shard/sharded_tag.h"
#include "ckpt/spec/lora.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/store/manifest.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/training_state.h"
#include "ckpt/util/error.h"

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
  if (bytes() > limit_) Release();
}

void Touched::Release() {
  for (const Span& s : spans_) s.file->DropPages(s.lo, static_cast<size_t>(s.hi - s.lo));
  spans_.clear();
}

// Runs the four parts in order: find and load the files, describe the model,
// index the model files' runs, read the optimizer files; then the step.
class ShardedTagBuilder {
 public:
  ShardedTagBuilder(Env* env, const std::string& dir, const FormatHints& hints, const TagReadOptions& opts) : hints_(hints), opts_(opts) {
    t_ = std::unique_ptr<ShardedTag>(new ShardedTag());
    t_->files_ = std::make_unique<TagFiles>(env, dir);
    t_->index_.ReadThrough(env);
    t_->dir_ = dir;
    files_ = t_->files_.get();
  }

  void SetInMemory(std::map<std::string, Value> files, const Manifest& manifest) {
    files_->SetInMemory(std::move(files));
    manifest_ = manifest;
  }

  std::unique_ptr<ShardedTag> Build() {
    TagDescription& L = t_->layout_;
    files_->Discover(opts_, manifest_, L, &t_->optimizer_skipped_);
    if (files_->xser()) files_->Preload(L);
    files_->LoadModelFiles(L.grid);
    t_->ordered_ = files_->Model(0, 0).ordered;
    Describe();
    CheckModelFiles();
    // NxD saves the training's optimizer (base and adapters) whatever the model files hold: an
    // adapter-only tag's lists the base as the training's does (OptimizerParameters).
    if (L.has_optimizer && L.format.lora.on() && L.format.lora.saved == LoraSaved::kMerged)
      throw Error(dir() + ": is a LoRA tag saved with " + LoraSavedName(L.format.lora.saved) +
                  ": its optimizer files hold the state of the training's parameters (base and adapters), not of the ones its model "
                  "files hold, and shardkit does not re-lay those; --weights_only reads the model alone");
    if (L.has_optimizer)
      ReadTagOptimizer(*files_, L, OptimizerParameters(L.format, L.grid.tp), manifest_ ? manifest_->optimizer_grouping : std::nullopt, t_->index_, &t_->optimizer_);
    LearnStep();
    t_->index_.CheckCovered(dir(), t_->params_);
    if (!opts_.trust_first_replica) t_->index_.CompareReplicas(dir(), L.format);
    return std::move(t_);
  }

 private:
  const std::string& dir() const { return t_->dir_; }

  void Describe() {
    TagDescription& L = t_->layout_;
    ModelEvidence e;
    e.dir = dir();
    e.in_memory = files_->in_memory();
    e.grid = L.grid;
    e.model = [this](int t, int p) -> const Dict& { return files_->Model(t, p); };
    e.path = [this](const std::string& rel) { return files_->Path(rel); };
    e.recorded = manifest_ && manifest_->model ? &*manifest_->model : nullptr;
    e.recorded_stages = manifest_ && manifest_->layout ? &manifest_->layout->stages : nullptr;
    e.user_content = [this] { return files_->UserContent(); };
    ModelDescription d = DescribeModel(e, hints_);
    L.stage_bounds = std::move(d.stage_bounds), L.virtual_stages = d.virtual_stages;
    L.format = d.format;
    L.format_from_manifest = d.from_manifest;
    L.tied_naming = d.tied_naming;
    t_->params_ = std::move(d.params);
    t_->format_notes_ = std::move(d.notes);
  }

  // Every model file holds exactly its stage's parameters, shaped by the
  // rules. Under expert parallelism each ep rank's files hold its experts and
  // a copy of every other tensor, compared as replicas (ExtentIndex::HolderId).
  void CheckModelFiles() {
    const TagDescription& L = t_->layout_;
    ExtentIndex::Holders owner;
    for (int e = 0; e < L.grid.ep; ++e)
      for (int p = 0; p < L.grid.pp; ++p) {
        const auto stage = StageParameters(t_->params_, L.stage_bounds, p, L.tied_naming, L.virtual_stages);
        for (int t = 0; t < L.grid.tp; ++t) CheckModelFile(stage, t, p, e, owner);
      }
  }

  void CheckModelFile(const std::vector<StageParam>& stage, int t, int p, int e, ExtentIndex::Holders& owner) {
    const TagDescription& L = t_->layout_;
    RankCoord c{0, t, p};
    if (L.grid.ep > 1) c.ep = e;
    const std::string rel = RankFilePath(RankFileKind::kModel, c), where = files_->Path(rel);
    AxisCoords at = AxisCoords::Tp(L.grid.tp, t);
    at[Axis::kEp] = {L.grid.ep, e};
    std::map<std::string, size_t> place;  // the stage's parameters, by name: NxD loads by name, so any key order
    for (size_t i = 0; i < stage.size(); ++i) place[stage[i].name] = i;
    std::map<std::string, std::vector<int64_t>> spmd;  // the SPMDRank tensors of the stage's MoE layers (ep > 1)
    for (int64_t l = 0; l < L.format.layers; ++l)
      if (RankHoldsLayer(L.stage_bounds, L.virtual_stages, p, l))
        for (const auto& s : SpmdRankTensors(L.format, static_cast<int>(l), L.grid.ep)) spmd[s.name] = s.shape;
    std::vector<bool> seen(stage.size());
    std::string prev;
    for (const auto& [k, v] : files_->Model(t, p, e).items) {
      if (!k.is_str()) throw Error(where + ": holds a key that is not a string");
      const std::string& name = k.as_str();
      if (auto it = place.find(name); it != place.end()) {
        if (seen[it->second]) throw Error(where + ": '" + name + "' appears twice");
        seen[it->second] = true;
        const StageParam& sp = stage[it->second];
        const Tensor& x = IndexableTensor(v, where + ": '" + name + "'");
        const auto want = LocalShape(*sp.rule, at);
        if (x.shape() != want)
          throw Error(where + ": '" + name + "' has shape " + ShapeString(x.shape()) + " but " + L.format.Describe() + " at tp " +
                      std::to_string(L.grid.tp) + (L.grid.ep > 1 ? ", ep " + std::to_string(L.grid.ep) : "") + " gives tp rank " +
                      std::to_string(t) + (L.grid.ep > 1 ? ", ep rank " + std::to_string(e) : "") + " " + ShapeString(want));
        if (!sp.tied_copy()) {
          t_->index_.AddBoxes(*sp.rule, at, StateField::kParam, x, files_->FileOf(x, rel), 0, want[0], owner, x.dtype(), where + ": '" + name + "'");
        } else if (const Value* emb = files_->Model(t, 0, e).Find(sp.rule->name); !emb || !emb->is_tensor() || !SameBytes(x, emb->as_tensor())) {
          // A tied copy is read from the embedding; one that differs would be lost silently.
          throw Error(where + ": '" + name + "' is GPT's tied output layer (share_embeddings_and_output_weights), but it differs from " +
                      files_->Path(RankFilePath(RankFileKind::kModel, {0, t, 0})) + "'s '" + sp.rule->name + "'");
        }
        prev = name;
        continue;
      }
      if (name == kLoraConfigKey && L.format.lora.on()) {
        // LoRA's metadata (validated when the model was described): carried into every
        // stage's file, at its front (NxD saves it last; its loads go by name).
        if (t == 0 && p == 0 && e == 0) t_->buffers_.push_back({name, "", kEveryStageLayer, v});
        continue;
      }
      if (auto it = spmd.find(name); it != spmd.end()) {
        CheckSpmdRank(where + ": '" + name + "'", v, it->second);
        continue;
      }
      CheckOtherEntry(where, name, p);
      if (t == 0 && e == 0) t_->buffers_.push_back({name, prev, LayerOfName(name), v});
      prev = name;
    }
    for (size_t i = 0; i < stage.size(); ++i)
      if (!seen[i]) throw Error(where + ": has no '" + stage[i].name + "'");
  }

  // An SPMDRank tensor (SpmdRankTensors) is dropped, the writer making it for
  // its own ep: so it must be what NxD's training saves, int32 zeros of its
  // shape; other values (inference's create_spmd_ranks) are refused, not lost.
  static void CheckSpmdRank(const std::string& where, const Value& v, const std::vector<int64_t>& shape) {
    const Tensor& x = IndexableTensor(v, where);
    const Tensor c = x.Contiguous();
    if (x.dtype() != DType::kInt32 || x.shape() != shape || !std::all_of(c.data(), c.data() + c.nbytes(), [](uint8_t b) { return b == 0; }))
      throw Error(where + " is " + std::string(DTypeName(x.dtype())) + " " + ShapeString(x.shape()) + ", not NxD's SPMDRank as training saves it (int32 zeros " +
                  ShapeString(shape) + ", parallel_layers/layers.py SPMDRank), which the target ep's files are given anew");
  }

  // A model-file entry that is no parameter of its stage: a buffer (a layer's
  // inv_freq or _extra_state) is kept; anything else is refused, saying why.
  void CheckOtherEntry(const std::string& where, const std::string& name, int p) const {
    const TagDescription& L = t_->layout_;
    const int layer = LayerOfName(name);
    const bool known = std::any_of(t_->params_.begin(), t_->params_.end(), [&](const ParamRule& r) { return r.name == name; });
    if (known || name == kMegatronLmTiedCopy)
      throw Error(where + ": '" + name + "' belongs to another pipeline stage: stage " + std::to_string(p) + " holds layers " +
                  LayerRangesString(RankLayerRanges(L.stage_bounds, L.virtual_stages, p)) +
                  (L.virtual_stages > 1 ? " (" + std::to_string(L.virtual_stages) + " virtual pipeline stages)" : "") +
                  (p == 0 ? " and the embedding" : "") + (p + 1 == L.grid.pp ? " and the final norm and output layer" : ""));
    if (layer < 0 || !(name.ends_with(".inv_freq") || name.ends_with("._extra_state"))) {
      if (const auto other = FamilyOfName(name); other && *other != L.format.family)
        throw Error(where + ": '" + name + "' is a " + FamilyName(*other) + " name, but the tag's model is " + FamilyName(L.format.family) +
                    ": a tag mixing model families is refused");
      throw Error(where + ": '" + name + "' is not a parameter of " + L.format.Describe() + " that ckpt-reshard knows how to split");
    }
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
    // What the tag records wins over its name, as resume decides (PositionFromContent):
    // a name is a label, and a lying one would otherwise pass into the new tag's manifest.
    // NxD saves whatever user content its caller passes: a dict without NxDT's step
    // entries leaves the step to the name (NxD's llama example names tags step_<N>).
    const std::string name = std::filesystem::path(dir()).filename().string();
    std::optional<UserContent> uc;
    if (const Value* v = files_->UserContent()) {
      try {
        uc = UserContent::FromValue(*v, files_->Path(kUserContentFile));
      } catch (const Error&) {
      }
    }
    const RecordedPosition pos = PositionFromContent(uc ? &*uc : nullptr, name, SamplesFromName::kTagName);
    t_->step_ = pos.step.value_or(0);
    if (pos.consumed_samples) t_->consumed_ = *pos.consumed_samples;
    else t_->consumed_known_ = false;
    if (const std::optional<TagName> tn = ParseTagName(name); tn && pos.step_from_content && tn->step != t_->step_)
      t_->format_notes_.push_back("the tag's name says step " + std::to_string(tn->step) + " but its " + std::string(kUserContentFile) +
                                  " records step " + std::to_string(t_->step_) + ", which is taken");
  }

  FormatHints hints_;
  TagReadOptions opts_;
  std::unique_ptr<ShardedTag> t_;
  TagFiles* files_;
  std::optional<Manifest> manifest_;
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

std::optional<Value> ShardedTag::TagFile(const std::string& name) const { return files_->TagFile(name); }

DType ShardedTag::dtype(const std::string& name, StateField f) const {
  DType d;
  if (!index_.FindDType(name, f, &d)) throw Error(dir_ + ": holds no " + FieldName(f) + " of " + name);
  return d;
}

const Value& ShardedTag::Step(const std::string& name) const {
  auto it = optimizer_.steps.find(name);
  if (it == optimizer_.steps.end()) throw Error(dir_ + ": holds no optimizer step of " + name);
  return it->second;
}

void ShardedTag::Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const {
  index_.Read(name, f, begin, out, touched);
}

}  // namespace ckpt

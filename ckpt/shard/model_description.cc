#include "ckpt/shard/model_description.h"

#include <algorithm>
#include <map>
#include <cstring>
#include <set>
#include <type_traits>

#include "ckpt/shard/extent_index.h"
#include "ckpt/spec/lora.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/training_state.h"

namespace ckpt {
namespace {

std::string StageFile(const ModelEvidence& e, int p) { return e.path(RankFilePath(RankFileKind::kModel, {0, 0, p})); }

// What the families share: the model files, hints (which the job config a tag
// records completes), and the notes said.
class Describer {
 public:
  Describer(const ModelEvidence& e, FormatHints hints, std::vector<std::string>* notes) : e_(e), hints_(std::move(hints)), notes_(notes) {}

  ModelFormat Recorded();
  ModelFormat Megatron(const std::vector<int64_t>& bounds);
  ModelFormat HfLlama(const std::vector<int64_t>& bounds);
  ModelFormat HfLlamaAdapters(const std::vector<int64_t>& bounds, const LoraFormat& lora);

 private:
  const Tensor* FindTensor(const std::string& suffix, int t = 0) const;
  void MegatronHeads(ModelFormat& f, const std::string& why);
  void MegatronVocabulary(ModelFormat& f, int64_t padded);
  void HfCheckSizes(const ModelFormat& f, const std::string& k_leaf, const std::string& why);
  void HfHeads(ModelFormat& f, const std::vector<int64_t>& bounds, const std::string& k_leaf);
  void HfKvHeads(ModelFormat& f, const std::vector<int64_t>& bounds, const std::string& k_leaf);
  void HfKvReplication(ModelFormat& f, int layer, const Tensor& kv, int64_t n, int64_t k_row);
  void TakeForwardHints(ModelFormat& f, const std::string& eps_name, const std::string& flags);
  void CheckHintsAgree(const ModelFormat& f) const;
  void RefineVocabulary(ModelFormat& f, int tp);
  void TakeRecordedConfig();
  const Value* RecordedConfig() const {
    const Value* uc = e_.user_content ? e_.user_content() : nullptr;
    return uc ? RecordedJobConfig(*uc) : nullptr;
  }
  std::string JobConfigContradiction(const std::string& flag, const std::string& hint, const std::string& key, const std::string& recorded) const;
  std::optional<int64_t> RecordedConfigInt(const char* key, int64_t max) const;
  std::optional<int64_t> PaddingRule(int64_t rows, int tp);
  std::string RecordedWhere() const { return e_.in_memory ? e_.dir : e_.path(kManifestFile); }
  // Mixtral (MoE, issue #38).
  const Tensor* MoeExpertsOut(ModelFamily family) const;
  void Moe(ModelFormat& f);
  void TakeRecordedMoeConfig();
  int64_t MoeFrequency(const ModelFormat& f, const std::set<int64_t>& moe_layers) const;

  const ModelEvidence& e_;
  FormatHints hints_;
  std::vector<std::string>* notes_;
};

const Tensor* Describer::FindTensor(const std::string& suffix, int t) const {
  for (int p = 0; p < e_.grid.pp; ++p)
    for (const auto& [k, v] : e_.model(t, p).items)
      if (k.as_str().ends_with(suffix) && v.is_tensor()) return &v.as_tensor();
  return nullptr;
}

// Every key of tp rank 0's model files, over the stages.
std::vector<std::string> ModelNames(const ModelEvidence& e) {
  std::vector<std::string> names;
  for (int p = 0; p < e.grid.pp; ++p)
    for (const auto& [k, v] : e.model(0, p).items)
      if (k.is_str()) names.push_back(k.as_str());
  return names;
}

// --- Mixtral (MoE) (issue #38) ---
// A tag without a manifest holding MoE tensors: every MoE tensor is one the
// family table holds (not shared experts, biases or spmd ranks), and the
// first MoE layer holds its router, gate_up_proj and down_proj. Throws naming
// the tensor, so a partial MoE layer is told before any Llama inference asks
// for its MLP.
void RequireMoeModule(const ModelEvidence& e, const std::vector<std::string>& names, const std::string& first) {
  // SPMDRank tensors of an ep > 1 tag are NxD's; their values are checked with the model files.
  std::vector<std::string> parts;
  for (const std::string& n : names)
    if (!(e.grid.ep > 1 && IsSpmdRankName(n))) parts.push_back(n);
  if (const auto unheld = FirstUnheldMoeName(parts)) throw Error(e.dir + ": " + MoeRefusal(*unheld));
  ModelFormat named;  // names only
  named.family = *FamilyOfName(first), named.experts = 1;
  const int l = LayerOfName(first);
  for (const Module m : {Module::kRouter, Module::kExpertsIn, Module::kExpertsOut})
    if (const std::string want = ParamName(named, m, l); std::find(names.begin(), names.end(), want) == names.end())
      throw Error(e.dir + ": " + MoeModelOf(first) + ": layer " + std::to_string(l) + " holds '" + first + "' but not '" + want +
                  "' (NxD's MoE layer as shardkit's Mixtral family holds it: router, expert_mlps.mlp_op.gate_up_proj and down_proj)");
}

// Each pp rank's layers, as the names in its tp rank 0 file give them, in maximal ranges of consecutive layers.
StageMap LayersOfFiles(const ModelEvidence& e) {
  StageMap held(e.grid.pp);
  for (int p = 0; p < e.grid.pp; ++p) {
    std::set<int64_t> layers;
    for (const auto& [k, v] : e.model(0, p).items) {
      if (!k.is_str()) throw Error(StageFile(e, p) + ": holds a key that is not a string");
      if (const int l = LayerOfName(k.as_str()); l >= 0) layers.insert(l);
    }
    if (layers.empty()) throw Error(StageFile(e, p) + ": holds no decoder layer; every pipeline stage holds at least one");
    for (int64_t l : layers)
      if (held[p].empty() || held[p].back().second != l) held[p].push_back({l, l + 1});
      else ++held[p].back().second;
  }
  return held;
}

// One stage per pp rank: from its lowest to its highest layer (a gap inside is the model files' check's).
std::vector<int64_t> PlainStageBounds(const ModelEvidence& e, const StageMap& held) {
  std::vector<int64_t> bounds{0};
  for (int p = 0; p < e.grid.pp; ++p) {
    if (held[p].front().first != bounds.back())
      throw Error(StageFile(e, p) + ": starts at layer " + std::to_string(held[p].front().first) + " but the stage before ends at layer " +
                  std::to_string(bounds.back() - 1) + "; stages must hold consecutive layers");
    bounds.push_back(held[p].back().second);
  }
  return bounds;
}

// The split the names give: one stage per pp rank when each rank's lowest
// layer follows the rank before's highest (a gap inside a rank is the model
// files' check's, as before), else NxD's virtual pipeline stages.
StageSplit SplitOfNames(const ModelEvidence& e, const StageMap& held) {
  const bool one_range_each = std::all_of(held.begin(), held.end(), [](const auto& r) { return r.size() == 1; });
  try {
    return {PlainStageBounds(e, held), 1};
  } catch (const Error&) {
    if (one_range_each) throw;
  }
  if (std::optional<StageSplit> split = StageSplitOf(held)) return *split;
  std::string ranks;
  for (int p = 0; p < e.grid.pp; ++p) ranks += (p ? "; pp rank " : "pp rank ") + std::to_string(p) + ": " + LayerRangesString(held[p]);
  throw Error(e.path("model") + ": its pp ranks hold layers " + ranks + ", which are neither consecutive stages nor NxD's virtual " +
              "pipeline stages (pp rank p holding stages p, p + pp, ..., as many on every rank, each starting where the stage before ends)");
}

// The recorded stage map when it is the split the names give or, at pp = 1
// (where names cannot tell stages apart), one over the same layers; refused otherwise.
StageSplit WithRecordedSplit(const ModelEvidence& e, const StageSplit& names) {
  const std::string where = e.in_memory ? e.dir : e.path(kManifestFile);
  const std::optional<StageSplit> recorded = StageSplitOf(*e.recorded_stages);
  if (!recorded) throw Error(where + ": 'layout' 'stages' is no pipeline split (consecutive stages, or NxD's virtual pipeline stages)");
  if (*recorded == names || (e.grid.pp == 1 && recorded->bounds.back() == names.bounds.back())) return *recorded;
  const StageMap want = StageMapOf(recorded->bounds, recorded->virtual_stages), have = StageMapOf(names.bounds, names.virtual_stages);
  int p = 0;
  while (p + 1 < e.grid.pp && want[p] == have[p]) ++p;
  throw Error(where + ": 'layout' 'stages' records layers " + LayerRangesString(want[p]) + " for pp rank " + std::to_string(p) + ", but " +
              StageFile(e, p) + " holds layers " + LayerRangesString(have[p]));
}

}  // namespace

StageSplit StageSplitOfFiles(const ModelEvidence& e) {
  const StageSplit names = SplitOfNames(e, LayersOfFiles(e));
  return e.recorded_stages ? WithRecordedSplit(e, names) : names;
}

std::vector<int64_t> StageBoundsOfFiles(const ModelEvidence& e) { return StageSplitOfFiles(e).bounds; }

ModelFormat Describer::Recorded() {
  ModelFormat f = *e_.recorded;
  CheckHintsAgree(f);
  RefineVocabulary(f, e_.grid.tp);
  return f;
}

ModelFormat Describer::Megatron(const std::vector<int64_t>& bounds) {
  const int tp = e_.grid.tp;
  const std::string why = e_.dir + (e_.in_memory ? " does not record its model format (no hyper_parameters.cfg), "
                                                 : " has no manifest recording its model format (NxD writes none), ");
  ModelFormat f;
  const Tensor* norm = FindTensor("final_layernorm.weight");
  const Tensor* emb = FindTensor("embedding.word_embeddings.weight");
  const Tensor* fc2 = FindTensor("mlp.dense_4h_to_h.weight");
  const Tensor* fc1 = FindTensor("mlp.dense_h_to_4h.weight");
  // Every layer MoE (NxDT's Mixtral): the experts' down_proj (experts, ffn / tp, hidden) gives ffn on dim 1, as fc2 does.
  const bool moe_only = !fc2 && !fc1 && (fc2 = fc1 = MoeExpertsOut(ModelFamily::kMegatron)) != nullptr;
  if (!norm || !emb || !fc2 || !fc1 || norm->shape().size() != 1 || emb->shape().size() != 2 || fc2->shape().size() != (moe_only ? 3u : 2u) ||
      fc1->shape().size() != (moe_only ? 3u : 2u))
    throw Error(why + "and its model files do not hold a Megatron decoder's word_embeddings, final_layernorm and mlp weights");
  f.hidden = norm->shape()[0];
  f.layers = bounds.back();
  f.ffn = fc2->shape()[1] * tp;
  f.gelu = !moe_only && fc1->shape()[0] * tp == f.ffn;
  f.layernorm = FindTensor("input_layernorm.bias") != nullptr;
  f.bias = FindTensor("self_attention.dense.bias") != nullptr;
  if (const Tensor* pos = FindTensor("position_embeddings.weight")) f.learned_positions = true, f.max_positions = pos->shape()[0];
  // Tied: no output layer (Megatron-LM's naming), or one equal to the embedding (NxDT's).
  const Tensor* out = FindTensor("output_layer.weight");
  f.tied_output = out == nullptr || SameBytes(*out, *emb);
  TakeRecordedConfig();
  Moe(f);
  // With rope no tensor holds it; the job config does (the longest sequence the rotary table covers).
  if (!f.learned_positions) f.max_positions = hints_.max_positions.value_or(RecordedConfigInt("max_position_embeddings", ModelFormat::kMaxPositions).value_or(0));
  MegatronHeads(f, why);
  const int64_t padded = emb->shape()[0] * tp;
  MegatronVocabulary(f, padded);
  // Not in the tensors: the job config an NxDT tag records, hints, else the defaults (said so).
  TakeForwardHints(f, "layernorm_epsilon", "--rope_theta, --layernorm_epsilon");
  if (f.vocab_size < 1 || f.make_vocab_size_divisible_by < 1 || f.PaddedVocab(tp) != padded)
    throw Error(e_.dir + ": its word_embeddings hold " + std::to_string(padded) + " rows over tp " + std::to_string(tp) +
                ", not vocab_size " + std::to_string(f.vocab_size) + " padded to a multiple of " +
                std::to_string(f.make_vocab_size_divisible_by) + " x " + std::to_string(tp));
  return f;
}

// Heads from a hint (or the job config); KV heads from the key_value rows when each rank holds more than one group.
void Describer::MegatronHeads(ModelFormat& f, const std::string& why) {
  const int tp = e_.grid.tp;
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
}

// The vocabulary of word_embeddings of `padded` rows: the true size a hint
// gives with the padding rule that gives those rows, else every row.
void Describer::MegatronVocabulary(ModelFormat& f, int64_t padded) {
  const int tp = e_.grid.tp;
  std::optional<int64_t> rule = PaddingRule(padded, tp);
  if (hints_.vocab_size) {
    if (!rule) {
      // A vocabulary without a rule (--model_config's vocab_size on NNM's HF -> NNM converter's output, which
      // records no hyper_parameters): the rule that gives the rows read, said so.
      rule = ModelFormat::PaddingRuleGiving(*hints_.vocab_size, padded, tp);
      if (!rule)
        throw Error(e_.dir + ": its word_embeddings hold " + std::to_string(padded) + " rows over tp " + std::to_string(tp) +
                    ", which no make_vocab_size_divisible_by gives from vocab_size " + std::to_string(*hints_.vocab_size));
      notes_->push_back("make_vocab_size_divisible_by " + std::to_string(*rule) + " inferred: it pads vocab_size " +
                        std::to_string(*hints_.vocab_size) + " to the " + std::to_string(padded) + " word_embeddings rows at tp " +
                        std::to_string(tp) + (*rule == ModelFormat::kNnmDefaultPaddingRule ? " (NNM's default)" : "") +
                        "; give --make_vocab_size_divisible_by if the job used another");
    }
    f.vocab_size = *hints_.vocab_size, f.make_vocab_size_divisible_by = *rule;
  } else {
    f.vocab_size = padded;  // every row is kept as vocabulary
    f.make_vocab_size_divisible_by = rule.value_or(1);
    if (rule && !hints_.make_vocab_size_divisible_by)
      notes_->push_back("vocabulary padded to a multiple of " + std::to_string(*rule) + " x tp (make_vocab_size_divisible_by in the job config in " +
                        "user_content.pt); its true size is not recorded, so all " + std::to_string(padded) + " rows are taken as vocabulary: " +
                        "at a tp that is not a multiple of " + std::to_string(tp) + ", give --vocab_size");
  }
}

ModelFormat Describer::HfLlama(const std::vector<int64_t>& bounds) {
  const int tp = e_.grid.tp;
  // A Mixtral tag says so (what is asked for next may be a Llama's hint; the MoE is no longer what stops it).
  const std::string why = e_.dir + (FirstMoeName(ModelNames(e_)) ? " holds an MoE (Mixtral) model but" : "") +
                          " has no manifest recording its model format (NxD writes none), ";
  ModelFormat f;
  f.family = ModelFamily::kHfLlama;
  const Tensor* norm = FindTensor(ParamName(f, Module::kFinalNorm));
  const Tensor* emb = FindTensor(ParamName(f, Module::kEmbedding));
  const Tensor* down = FindTensor(ParamName(f, Module::kMlpOut, static_cast<int>(bounds[0])));
  // An MoE first layer (NxDT's Mixtral's always is): its experts' down_proj (experts, ffn / tp, hidden) gives ffn on dim 1.
  const bool moe_first = !down && (down = MoeExpertsOut(ModelFamily::kHfLlama)) != nullptr;
  if (!norm || !emb || !down || norm->shape().size() != 1 || emb->shape().size() != 2 || down->shape().size() != (moe_first ? 3u : 2u))
    throw Error(why + "and its model files do not hold an HF-style Llama's model.embed_tokens, model.norm and mlp.down_proj weights");
  f.hidden = norm->shape()[0];
  f.layers = bounds.back();
  f.ffn = down->shape()[1] * tp;
  Moe(f);
  f.vocab_size = emb->shape()[0] * tp;
  f.make_vocab_size_divisible_by = 1;
  f.tied_output = FindTensor(ParamName(f, Module::kOutput)) == nullptr;
  // The attention tensors name the layout (NxDT's model.qkv_linear and model.fuse_qkv).
  const auto k_leaf = HfAttentionOfNames(ModelNames(e_), f);
  if (!k_leaf)
    throw Error(why + "and its model files hold no attention weights of NxDT's HF-style Llama (qkv_proj.weight_qkv, qkv_proj.weight_q/_k/_v, qkv_proj.weight or q_proj/k_proj/v_proj)");
  HfCheckSizes(f, *k_leaf, why);
  HfHeads(f, bounds, *k_leaf);
  return f;
}

// An adapter-only LoRA tag without a manifest (NxD's save_lora_base False):
// what the base's weights would tell, from the adapters' shapes (lora.h:
// qkv_proj's and gate_up_proj's lora_A whole [rank, hidden], o_proj's and
// down_proj's lora_B whole [hidden, rank], down_proj's lora_A [rank, ffn / tp],
// gate_up_proj's lora_B [2 ffn / tp, rank]), the job config or the hints;
// refused naming the size none of them gives. The evidence shows qkv_proj's
// lora_B also under its base's names (AdapterRowsAsBase), whose rows tell the
// KV heads and their replication as the base's would.
ModelFormat Describer::HfLlamaAdapters(const std::vector<int64_t>& bounds, const LoraFormat& lora) {
  const int tp = e_.grid.tp;
  const std::string why = e_.dir + " is an adapter-only LoRA tag (NxD's save_lora_base False: " + DescribeLora(lora) + ") with no base weights, ";
  ModelFormat f;
  f.family = ModelFamily::kHfLlama, f.layers = bounds.back(), f.make_vocab_size_divisible_by = 1;
  TakeRecordedConfig();
  auto dim = [&](const char* suffix, size_t d, int64_t times) -> std::optional<int64_t> {
    const Tensor* x = FindTensor(suffix);
    return x && x->shape().size() == 2 ? std::optional<int64_t>(x->shape()[d] * times) : std::nullopt;
  };
  std::optional<int64_t> hidden = dim(".qkv_proj.lora_A.weight", 1, 1), ffn = dim(".down_proj.lora_A.weight", 1, tp);
  for (const auto& other : {dim(".gate_up_proj.lora_A.weight", 1, 1), dim(".o_proj.lora_B.weight", 0, 1), dim(".down_proj.lora_B.weight", 0, 1)})
    if (!hidden) hidden = other;
  if (const auto gate_up = dim(".gate_up_proj.lora_B.weight", 0, tp); !ffn && gate_up) ffn = *gate_up / 2;
  auto size = [&](const std::optional<int64_t>& seen, const std::optional<int64_t>& hint, const std::string& what, const char* flag) {
    if (seen || hint) return seen ? *seen : *hint;  // a hint the adapters contradict is refused below (HfCheckSizes)
    throw FormatUnknown(why + "and neither its adapters nor a hint give " + what + ": give --model_config with the base model's HF config.json" + flag);
  };
  f.hidden = size(hidden, hints_.hidden, "the hidden size", "");
  f.ffn = size(ffn, hints_.ffn, "the FFN width (intermediate_size)", "");
  f.vocab_size = size(std::nullopt, hints_.vocab_size, "the vocabulary size", ", or --vocab_size");
  // NxDT's HF Llama unties lm_head unless config.json ties it (tie_word_embeddings), which no hint gives.
  f.tied_output = false;
  notes_->push_back("lm_head untied (tie_word_embeddings false) assumed: an adapter-only tag holds no base weights to tell");
  const auto k_leaf = HfAttentionOfNames(ModelNames(e_), f);
  if (!k_leaf || !f.qkv_linear)
    throw Error(why + "and no qkv_proj adapter of NxD's qkv_linear attention: the KV heads and their replication are read from "
                      "qkv_proj's lora_B, and shardkit does not read an adapter-only tag without one");
  HfCheckSizes(f, *k_leaf, why);
  HfHeads(f, bounds, *k_leaf);
  return f;
}

// Heads from a hint (HfCheckSizes asks for one), KV heads and their replication from the K rows, the forward hints.
void Describer::HfHeads(ModelFormat& f, const std::vector<int64_t>& bounds, const std::string& k_leaf) {
  const int tp = e_.grid.tp;
  f.heads = *hints_.heads;
  if (f.heads < 1 || f.hidden % f.heads) throw Error("--heads " + std::to_string(f.heads) + " does not divide the hidden size " + std::to_string(f.hidden));
  if (f.heads % tp) throw Error(e_.dir + ": tp " + std::to_string(tp) + " does not divide the " + std::to_string(f.heads) + " heads");
  HfKvHeads(f, bounds, k_leaf);
  f.max_positions = hints_.max_positions.value_or(0);
  TakeForwardHints(f, "rms_norm_eps", "--model_config, or --rope_theta and --layernorm_epsilon,");
}

// A job config's attention flags must name these tensors (LlamaAttention.__init__'s choice); sizes
// an HF config.json states must be the tensors'; heads must be given.
void Describer::HfCheckSizes(const ModelFormat& f, const std::string& k_leaf, const std::string& why) {
  const bool fuse_shows = f.qkv_linear || f.fuse_qkv;  // plain q/k/v say nothing of fuse_qkv (it is ignored with GQA)
  if ((hints_.qkv_linear && *hints_.qkv_linear != f.qkv_linear) || (hints_.fuse_qkv && fuse_shows && *hints_.fuse_qkv != f.fuse_qkv))
    throw Error(e_.dir + ": the job config says model.qkv_linear " + (hints_.qkv_linear && *hints_.qkv_linear ? "True" : "False") +
                ", model.fuse_qkv " + (hints_.fuse_qkv.value_or(true) ? "True" : "False") + ", but the tag holds '" + k_leaf + "'");
  auto against = [&](const std::optional<int64_t>& hint, int64_t seen, const char* what) {
    if (hint && *hint != seen)
      throw Error(e_.dir + ": the given " + what + " is " + std::to_string(*hint) + ", but the tensors give " + std::to_string(seen));
  };
  against(hints_.hidden, f.hidden, "hidden size");
  against(hints_.ffn, f.ffn, "FFN width (intermediate_size)");
  against(hints_.layers, f.layers, "layer count");
  against(hints_.vocab_size, f.vocab_size, "vocabulary (the HF-style family does not pad it)");
  if (!hints_.heads) throw FormatUnknown(why + "so give --heads, or --model_config with the model's HF config.json");
}

// KV heads per rank, from the local rows of K; NxD's replication of them from the data.
void Describer::HfKvHeads(ModelFormat& f, const std::vector<int64_t>& bounds, const std::string& k_leaf) {
  const int tp = e_.grid.tp;
  const int64_t hd = f.head_dim(), qn = f.heads / tp;
  const Tensor* kv = FindTensor("." + k_leaf);
  const int64_t rows = kv->shape().at(0);
  int64_t n = 0, k_row = 0;  // KV heads per rank; K's first local row
  if (f.qkv_linear && f.fuse_qkv) n = (rows / hd - qn) / 2, k_row = qn * hd;
  else if (f.fuse_qkv) n = qn, k_row = qn * hd;
  else n = rows / hd;
  const int64_t want_rows = f.fuse_qkv ? (qn + 2 * n) * hd : n * hd;
  if (n < 1 || rows != want_rows)
    throw Error(e_.dir + ": '" + k_leaf + "' has " + std::to_string(rows) + " rows per tp rank, which no whole " +
                "number of KV heads of head_dim " + std::to_string(hd) + " gives with " + std::to_string(qn) + " query heads per rank");
  if (f.qkv_linear) {
    HfKvReplication(f, static_cast<int>(bounds[0]), *kv, n, k_row);
  } else if (hints_.kv_size_multiplier && *hints_.kv_size_multiplier != 1) {
    throw Error(e_.dir + ": --kv_size_multiplier " + std::to_string(*hints_.kv_size_multiplier) + " contradicts the tag: it has no qkv_linear " +
                "attention (qkv_proj.weight_*), so NxD replicates no KV heads");
  } else if (hints_.hw_backend) {
    f.hw_backend = *hints_.hw_backend;
  }
  if ((n * tp) % f.kv_size_multiplier) throw Error(e_.dir + ": " + std::to_string(n) + " KV heads per tp rank do not fit kv_size_multiplier " + std::to_string(f.kv_size_multiplier));
  f.kv_heads = n * tp / f.kv_size_multiplier;
  if (hints_.kv_heads && *hints_.kv_heads != f.kv_heads)
    throw Error(e_.dir + ": the given number of KV heads is " + std::to_string(*hints_.kv_heads) + ", but the tensors give " + std::to_string(f.kv_heads));
  if (f.heads % f.kv_heads) throw Error(e_.dir + ": the " + std::to_string(f.kv_heads) + " KV heads do not divide the " + std::to_string(f.heads) + " heads");
}

// Tp ranks whose K and V rows of the first layer are equal (stage 0's files hold `layer`): a fused
// weight_qkv holds them as rows [k_row, k_row + 2 n hd), weight_k and weight_v whole (InferKvReplication).
void Describer::HfKvReplication(ModelFormat& f, int layer, const Tensor& kv, int64_t n, int64_t k_row) {
  const int tp = e_.grid.tp;
  const int64_t hd = f.head_dim();
  std::vector<std::pair<std::string, int64_t>> pieces;  // tensor, first row
  if (f.fuse_qkv) pieces = {{ParamName(f, Module::kQkv, layer), k_row}};
  else pieces = {{ParamName(f, Module::kKey, layer), 0}, {ParamName(f, Module::kValue, layer), 0}};
  const int64_t piece_rows = f.fuse_qkv ? 2 * n * hd : n * hd;
  auto kv_rows = [&](int t, const std::pair<std::string, int64_t>& piece) -> std::optional<Tensor> {
    const Value* v = e_.model(t, 0).Find(piece.first);
    if (!v || !v->is_tensor() || v->as_tensor().shape() != kv.shape()) return std::nullopt;
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
    throw Error(e_.dir + ": --kv_size_multiplier " + std::to_string(*hints_.kv_size_multiplier) + " contradicts the data: " + data +
                ", so kv_size_multiplier is " + std::to_string(seen.multiplier));
  f.kv_size_multiplier = seen.multiplier;
  f.hw_backend = seen.backend;
  if (hints_.hw_backend) {
    if (seen.backend != HwBackend::kUnknown && *hints_.hw_backend != seen.backend)
      throw Error(e_.dir + ": --hw_backend " + BackendName(*hints_.hw_backend) + " contradicts the data: " + data + ", which is " +
                  BackendName(seen.backend) + "'s " + (seen.backend == HwBackend::kTrn1 ? "interleaved" : "consecutive") +
                  " KV replication" +
                  (*hints_.hw_backend == HwBackend::kTrn2
                       ? ". NxD's checkpoint_converter.py writes Trn2 tags with the Trn1 rule (its K/V branch has no hw_backend check), "
                         "so such a tag pairs some ranks' queries with the wrong KV head; convert it again from the full state"
                       : ""));
    f.hw_backend = *hints_.hw_backend;
  }
  notes_->push_back("kv_size_multiplier " + std::to_string(seen.multiplier) + (seen.multiplier > 1 && seen.multiplier < tp ? std::string(" and ") + BackendName(seen.backend) : "") +
                    " inferred from the data: " + data +
                    (seen.backend == HwBackend::kUnknown && !hints_.hw_backend ? " (the backend does not matter for this layout)" : ""));
}

// What the forward pass needs beyond the tensors, for a tag without a manifest: the hints
// (or the job config an NxDT tag records), else the defaults, said so.
void Describer::TakeForwardHints(ModelFormat& f, const std::string& eps_name, const std::string& flags) {
  const bool rope = !f.learned_positions;  // GPT's learned positions have no rotary base to assume
  if ((rope && !hints_.rope_theta) || !hints_.norm_eps)
    notes_->push_back((rope ? std::string("rope_theta ") + (hints_.rope_theta ? "given" : "10000 assumed") + ", " : std::string()) +
                      eps_name + " " + (hints_.norm_eps ? "given" : "1e-05 assumed") + ": the tag does not record " +
                      (rope ? "them" : "it") + " (" + flags + " give them)");
  f.rope_theta = hints_.rope_theta.value_or(f.rope_theta);
  f.norm_eps = hints_.norm_eps.value_or(f.norm_eps);
  f.rotary_percentage = hints_.rotary_percentage.value_or(f.rotary_percentage);
  if (const std::string bad = f.CheckSizes(); !bad.empty()) throw Error(e_.dir + ": " + bad);
}

// A hint that contradicts the model format a manifest records is refused,
// naming both. Not the vocabulary: a writer that could not tell the padding
// records every row as vocabulary, which a true size may refine
// (RefineVocabulary decides).
void Describer::CheckHintsAgree(const ModelFormat& f) const {
  const std::string where = RecordedWhere();
  auto check = [&]<typename T>(const std::optional<T>& hint, T recorded, const char* flag) {
    if (hint && *hint != recorded)
      throw Error(std::string(flag) + " " + std::to_string(*hint) + " contradicts " + where + ", which records " + std::to_string(recorded));
  };
  check(hints_.heads, f.heads, "--heads"), check(hints_.kv_heads, f.kv_heads, "--kv_heads");
  check(hints_.rope_theta, f.rope_theta, "--rope_theta"), check(hints_.norm_eps, f.norm_eps, "--layernorm_epsilon");
  check(hints_.rotary_percentage, f.rotary_percentage, "--rotary_percentage");
  check(hints_.kv_size_multiplier, f.kv_size_multiplier, "--kv_size_multiplier");
  check(hints_.hidden, f.hidden, "the hidden size"), check(hints_.ffn, f.ffn, "the ffn size"), check(hints_.layers, f.layers, "num_layers");
  check(hints_.experts, f.experts, "num_experts"), check(hints_.moe_top_k, f.moe_top_k, "--moe_top_k");
  if (f.moe()) check(hints_.moe_frequency, f.moe_frequency, "--moe_frequency");
  if (hints_.hw_backend && f.hw_backend != HwBackend::kUnknown && *hints_.hw_backend != f.hw_backend)
    throw Error(std::string("--hw_backend ") + BackendName(*hints_.hw_backend) + " contradicts " + where + ", which records " +
                BackendName(f.hw_backend));
}

// A manifest records the vocabulary its writer knew, which for a tag that
// recorded none (NxD's, NNM's) is every row. --vocab_size (and
// --make_vocab_size_divisible_by) refine it when they give the rows the
// tag holds at its tp, so a later tp pads the true size as NxDT does; hints
// that give other rows are refused. The HF-style family pads nothing: its
// vocabulary is the rows, and a rule given for it is ignored (HfLlama).
void Describer::RefineVocabulary(ModelFormat& f, int tp) {
  const std::string where = RecordedWhere();
  if (f.family != ModelFamily::kMegatron) {  // as HfLlama: no padding rule to refine, the vocabulary is the rows
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
  notes_->push_back("vocab_size " + std::to_string(refined.vocab_size) + ", make_vocab_size_divisible_by " +
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
void Describer::TakeRecordedConfig() {
  const Value* cfg = RecordedConfig();
  if (!cfg) return;
  // The first of `keys` the config holds as a number gives `hint` (an int hint takes integers only).
  auto take = [&]<typename T>(std::initializer_list<const char*> keys, std::optional<T>& hint, const char* flag, bool note) {
    for (const char* key : keys) {
      const Value* v = ConfigEntry(*cfg, key);
      if (!v || !(v->is_int() || (std::is_floating_point_v<T> && v->is_float()))) continue;
      const T x = v->is_int() ? static_cast<T>(v->as_int()) : static_cast<T>(v->as_float());
      if (hint && *hint != x) throw Error(JobConfigContradiction(flag, std::to_string(*hint), key, std::to_string(x)));
      if (!hint && note) notes_->push_back(std::string(key) + " " + std::to_string(x) + " from the job config in user_content.pt");
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

// "<flag> <hint> contradicts .../user_content.pt, whose job config (hyper_parameters.cfg.<key>) is <recorded>"
std::string Describer::JobConfigContradiction(const std::string& flag, const std::string& hint, const std::string& key,
                                              const std::string& recorded) const {
  return flag + " " + hint + " contradicts " + e_.path(kUserContentFile) + ", whose job config (hyper_parameters.cfg." + key + ") is " + recorded;
}

// An integer in [1, max] the job config a tag records (NxDT's, or NNM's
// that nnm2nxdt-ckpt carries) holds under `key`, or none.
std::optional<int64_t> Describer::RecordedConfigInt(const char* key, int64_t max) const {
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
std::optional<int64_t> Describer::PaddingRule(int64_t rows, int tp) {
  std::optional<int64_t> recorded = RecordedConfigInt("make_vocab_size_divisible_by", ModelFormat::kMaxPaddingRule);
  if (recorded && rows % (*recorded * tp) != 0) {
    notes_->push_back("make_vocab_size_divisible_by " + std::to_string(*recorded) + " in the job config in user_content.pt does not give its " +
                      std::to_string(rows) + " word_embeddings rows at tp " + std::to_string(tp) + "; it is ignored");
    recorded.reset();
  }
  const std::optional<int64_t>& hint = hints_.make_vocab_size_divisible_by;
  if (hint && recorded && *hint != *recorded)
    throw Error(JobConfigContradiction("--make_vocab_size_divisible_by", std::to_string(*hint), "make_vocab_size_divisible_by",
                                       std::to_string(*recorded)));
  return hint ? hint : recorded;
}

// --- Mixtral (MoE) (issue #38) ---

// The experts' down_proj of the first MoE layer a file holds (any stage), or null.
const Tensor* Describer::MoeExpertsOut(ModelFamily family) const { return FindTensor("." + MoeLeaves(family).at(2)); }

// An MoE tag without a manifest: the experts from the router's rows, the MoE
// layers from the names (MoeFrequency), top_k from the job config or a hint
// (no tensor holds it). The first MoE layer must hold NxD's MoE as the table
// describes it (router, gate_up_proj and down_proj), of whole experts (ep 1).
void Describer::Moe(ModelFormat& f) {
  std::set<int64_t> moe_layers;
  for (const std::string& n : ModelNames(e_))
    if (FirstMoeName({n})) moe_layers.insert(LayerOfName(n));
  if (moe_layers.empty()) return;
  const int l = static_cast<int>(*moe_layers.begin());
  ModelFormat named = f;
  named.experts = 1;
  const std::string router_name = ParamName(named, Module::kRouter, l), in_name = ParamName(named, Module::kExpertsIn, l),
                    out_name = ParamName(named, Module::kExpertsOut, l);
  const Tensor *router = FindTensor(router_name), *in = FindTensor(in_name), *out = FindTensor(out_name);
  if (!router || !in || !out) throw Error(e_.dir + ": " + MoeModelOf(router_name) + ": layer " + std::to_string(l) + " lacks its router or experts");
  const auto &rs = router->shape(), &is = in->shape(), &os = out->shape();
  const std::string kind = e_.dir + ": " + MoeModelOf(router_name) + ": ";
  const int tp = e_.grid.tp;
  const int ep = e_.grid.ep;  // each ep rank holds experts / ep whole experts
  if (rs.size() != 2 || rs[1] != f.hidden || is.size() != 3 || os.size() != 3 || is[0] * ep != rs[0] || os[0] * ep != rs[0] || is[1] != f.hidden ||
      is[2] * tp != 2 * f.ffn || os[1] * tp != f.ffn || os[2] != f.hidden)
    throw Error(kind + "'" + router_name + "' " + ShapeString(rs) + ", '" + in_name + "' " + ShapeString(is) + " and '" + out_name + "' " +
                ShapeString(os) + " are not a router (experts, hidden " + std::to_string(f.hidden) + ") and experts' (experts / ep " +
                std::to_string(ep) + ", hidden, 2 x ffn " + std::to_string(f.ffn) + " / tp " + std::to_string(tp) +
                ") and (experts / ep, ffn / tp, hidden)");
  f.experts = rs[0];
  TakeRecordedMoeConfig();
  if (hints_.experts && *hints_.experts != f.experts)
    throw Error(e_.dir + ": num_experts " + std::to_string(*hints_.experts) + " (given, or the job config's model.moe.num_experts) contradicts '" +
                router_name + "', whose " + std::to_string(f.experts) + " rows are the experts");
  if (!hints_.moe_top_k)
    throw FormatUnknown(e_.dir + " has no manifest recording its model format, and no tensor of its MoE (Mixtral) layers holds how many experts each token is routed to, "
                                 "so give --moe_top_k (model.moe.top_k, config.json's num_experts_per_tok)");
  f.moe_top_k = *hints_.moe_top_k;
  if (f.moe_top_k > f.experts) throw Error(e_.dir + ": moe top_k " + std::to_string(f.moe_top_k) + " exceeds the " + std::to_string(f.experts) + " experts");
  f.moe_frequency = MoeFrequency(f, moe_layers);
}

// The moe_frequency that makes exactly `moe_layers` MoE (IsMoeLayer): the
// given one (or the job config's), refused naming the key when it does not;
// else the smallest that does (any other that does describes the same tag).
int64_t Describer::MoeFrequency(const ModelFormat& f, const std::set<int64_t>& moe_layers) const {
  auto gives = [&](int64_t frequency) {
    ModelFormat g = f;
    g.moe_frequency = frequency;
    for (int64_t l = 0; l < f.layers; ++l)
      if (IsMoeLayer(g, l) != (moe_layers.count(l) > 0)) return false;
    return true;
  };
  std::string held;
  for (int64_t l : moe_layers) held += (held.empty() ? "" : ", ") + std::to_string(l);
  const std::string rule = f.family == ModelFamily::kHfLlama ? "0-based layer_index % frequency == 0 (NxDT modeling_mixtral.py)"
                                                             : "1-based layer_number % frequency == 0 (NxDT transformer.py)";
  if (hints_.moe_frequency) {
    if (!gives(*hints_.moe_frequency))
      throw Error(e_.dir + ": moe frequency " + std::to_string(*hints_.moe_frequency) + " (given, or the job config's model.moe.frequency) contradicts " +
                  "the model files, whose MoE layers are " + held + " (" + rule + ")");
    return *hints_.moe_frequency;
  }
  for (int64_t frequency = 1; frequency <= f.layers; ++frequency)
    if (gives(frequency)) return frequency;
  throw Error(e_.dir + ": its MoE layers " + held + " follow no moe frequency (" + rule + ")");
}

// NxDT's job config (user_content.pt hyper_parameters.cfg.moe: num_experts,
// top_k, frequency; both styles read them, mixtral_model.py and
// megatron_gpt_model.py) gives the MoE hints; a hint it contradicts is refused.
void Describer::TakeRecordedMoeConfig() {
  const Value* cfg = RecordedConfig();
  const Value* moe = cfg ? ConfigEntry(*cfg, "moe") : nullptr;
  if (!moe || !(moe->is_dict() || moe->is_object())) return;
  auto take = [&](const char* key, std::optional<int64_t>& hint, const char* flag) {
    const Value* v = ConfigEntry(*moe, key);
    if (!v || !v->is_int()) return;
    if (hint && *hint != v->as_int())
      throw Error(JobConfigContradiction(flag, std::to_string(*hint), std::string("moe.") + key, std::to_string(v->as_int())));
    if (!hint) notes_->push_back(std::string("moe.") + key + " " + std::to_string(v->as_int()) + " from the job config in user_content.pt");
    hint = v->as_int();
  };
  take("num_experts", hints_.experts, "--num_experts");
  take("top_k", hints_.moe_top_k, "--moe_top_k");
  take("frequency", hints_.moe_frequency, "--moe_frequency");
}

ModelFormat DescribeRecordedModel(const ModelEvidence& e, const FormatHints& hints, std::vector<std::string>* notes) {
  return Describer(e, hints, notes).Recorded();
}

ModelFormat DescribeMegatronModel(const ModelEvidence& e, const std::vector<int64_t>& stage_bounds, FormatHints hints,
                                  std::vector<std::string>* notes) {
  return Describer(e, std::move(hints), notes).Megatron(stage_bounds);
}

ModelFormat DescribeHfLlamaModel(const ModelEvidence& e, const std::vector<int64_t>& stage_bounds, const FormatHints& hints,
                                 std::vector<std::string>* notes) {
  return Describer(e, hints, notes).HfLlama(stage_bounds);
}

namespace {

// The lora_config entry of the model files (ckpt/spec/lora.h): validated, the
// same in every file (NxD saves it in each); nullopt when none holds one.
std::optional<LoraFormat> LoraOfFiles(const ModelEvidence& e) {
  std::optional<LoraFormat> seen;
  std::string first, missing;
  for (int p = 0; p < e.grid.pp; ++p)
    for (int t = 0; t < e.grid.tp; ++t) {
      const std::string where = e.path(RankFilePath(RankFileKind::kModel, {0, t, p}));
      const Value* v = e.model(t, p).Find(kLoraConfigKey);
      if (!v) {
        missing = where;
        continue;
      }
      const LoraFormat l = LoraFormatOfConfig(*v, where);
      if (!seen) seen = l, first = where;
      else if (!(l == *seen)) throw Error(where + ": its '" + kLoraConfigKey + "' differs from " + first + "'s");
    }
  if (seen && !missing.empty()) throw Error(missing + ": has no '" + kLoraConfigKey + "', which " + first + " holds (NxD saves it in every model file)");
  return seen;
}

// A model file as the family's describer reads it: base weights under their
// base names, adapters and lora_config left out.
Dict BaseOf(const Dict& d) {
  Dict out;
  out.ordered = d.ordered;
  for (const auto& [k, v] : d.items) {
    if (k.is_str() && (k.as_str() == kLoraConfigKey || IsLoraAdapterName(k.as_str()))) continue;
    out.items.emplace_back(k.is_str() ? Value(WithoutBaseLayer(k.as_str())) : k, v);
  }
  return out;
}

// An adapter-only tag's model files with qkv_proj's lora_B also under its
// base's names (lora.h: its rows are cut as the base's), for the HF-style
// describer's KV inference; lora_config left out.
Dict AdapterRowsAsBase(const Dict& d) {
  static const std::string kQkvB = ".qkv_proj.lora_B.";
  Dict out;
  out.ordered = d.ordered;
  for (const auto& [k, v] : d.items) {
    if (!k.is_str() || k.as_str() == kLoraConfigKey) continue;
    out.items.emplace_back(k, v);
    if (const std::string& n = k.as_str(); n.find(kQkvB) != std::string::npos)
      out.items.emplace_back(Value(n.substr(0, n.find(kQkvB)) + ".qkv_proj." + n.substr(n.find(kQkvB) + kQkvB.size())), v);
  }
  return out;
}

// An adapter-only tag (NxD's save_lora_base False): its stages from the
// adapters' layers, its format recorded or learned from the adapters
// (Describer::HfLlamaAdapters), its parameters the adapters alone.
ModelDescription DescribeAdapterOnlyModel(const ModelEvidence& e, const FormatHints& hints, const LoraFormat& lora) {
  ModelDescription d;
  StageSplit split = StageSplitOfFiles(e);
  d.stage_bounds = std::move(split.bounds), d.virtual_stages = split.virtual_stages;
  if (e.recorded) {
    d.format = DescribeRecordedModel(e, hints, &d.notes);
    d.from_manifest = true;
  } else {
    std::map<std::pair<int, int>, Dict> shown;
    for (int p = 0; p < e.grid.pp; ++p)
      for (int t = 0; t < e.grid.tp; ++t) shown[{t, p}] = AdapterRowsAsBase(e.model(t, p));
    ModelEvidence adapters = e;
    adapters.model = [&shown](int t, int p) -> const Dict& { return shown.at({t, p}); };
    d.format = Describer(adapters, hints, &d.notes).HfLlamaAdapters(d.stage_bounds, lora);
  }
  d.format.lora = lora;
  if (const std::string why = d.format.CheckTensorParallel(e.grid.tp); !why.empty()) throw Error(e.dir + ": " + why);
  d.params = LogicalParameters(d.format, e.grid.tp);
  d.notes.push_back(DescribeLora(lora) + ", from the model files' '" + kLoraConfigKey + "'");
  return d;
}

// A LoRA tag: the base model described from the base weights (those of the
// merged mode are the base's names already), then the adapters added by the
// LoRA table; an adapter-only tag from its adapters.
ModelDescription DescribeLoraModel(const ModelEvidence& e, const FormatHints& hints, const LoraFormat& lora) {
  if (e.recorded && !(e.recorded->lora == lora))
    throw Error(e.dir + ": its model files' '" + kLoraConfigKey + "' (" + DescribeLora(lora) + ") is not what its manifest records" +
                (e.recorded->lora.on() ? " (" + DescribeLora(e.recorded->lora) + ")" : " (no LoRA)"));
  if (lora.saved == LoraSaved::kAdapterOnly) return DescribeAdapterOnlyModel(e, hints, lora);
  std::map<std::pair<int, int>, Dict> base;
  for (int p = 0; p < e.grid.pp; ++p)
    for (int t = 0; t < e.grid.tp; ++t) base[{t, p}] = BaseOf(e.model(t, p));
  ModelEvidence plain = e;
  plain.model = [&base](int t, int p) -> const Dict& { return base.at({t, p}); };
  ModelFormat recorded_base;
  if (e.recorded) recorded_base = *e.recorded, recorded_base.lora = {}, plain.recorded = &recorded_base;
  ModelDescription d = DescribeModel(plain, hints);
  d.format.lora = lora;
  if (const std::string why = d.format.CheckTensorParallel(e.grid.tp); !why.empty()) throw Error(e.dir + ": " + why);
  d.params = LogicalParameters(d.format, e.grid.tp);
  d.notes.push_back(DescribeLora(lora) + ", from the model files' '" + kLoraConfigKey + "'");
  return d;
}

}  // namespace

ModelDescription DescribeModel(const ModelEvidence& e, const FormatHints& hints) {
  if (const auto lora = LoraOfFiles(e)) return DescribeLoraModel(e, hints, *lora);
  if (e.recorded && e.recorded->lora.on())
    throw Error(e.dir + ": its manifest records " + DescribeLora(e.recorded->lora) + ", but its model files hold no '" + kLoraConfigKey + "'");
  ModelDescription d;
  StageSplit split = StageSplitOfFiles(e);
  d.stage_bounds = std::move(split.bounds), d.virtual_stages = split.virtual_stages;
  const int tp = e.grid.tp;
  // A Mixtral tag (NxDT's layer 0 is always an MoE layer) is read at any tp and ep in either style (the engine cuts
  // expert boxes; issue #38's mixtral_reshard, mixtral_ep1, mixtral_ep, mixtral_megatron_ep); an MoE part the family
  // does not hold is refused for what it is, not for lacking a Llama's MLP.
  if (const auto moe = FirstMoeName(ModelNames(e)); moe && !e.recorded) RequireMoeModule(e, ModelNames(e), *moe);
  if (e.recorded) {
    d.format = DescribeRecordedModel(e, hints, &d.notes);
    d.from_manifest = true;
  } else if (FamilyOfNames(ModelNames(e), e.path("model")) == ModelFamily::kHfLlama) {
    d.format = DescribeHfLlamaModel(e, d.stage_bounds, hints, &d.notes);
  } else {
    d.format = DescribeMegatronModel(e, d.stage_bounds, hints, &d.notes);
  }
  if (const std::string why = d.format.CheckTensorParallel(tp); !why.empty()) throw Error(e.dir + ": " + why);
  if (const std::string why = d.format.CheckExpertParallel(e.grid.ep); !why.empty()) throw Error(e.dir + ": " + why);
  d.params = LogicalParameters(d.format, tp);
  // GPT's tied output copy: NxDT's language_model.output_layer.weight on the last stage, or
  // Megatron-LM's word_embeddings.weight there (pp > 1) and nothing at pp = 1.
  if (d.format.tied_output) {
    const Dict& last = e.model(0, e.grid.pp - 1);
    d.tied_naming = last.Find(kMegatronLmTiedCopy) || (e.grid.pp == 1 && !last.Find(kTiedOutputCopy)) ? TiedCopyNaming::kMegatronLm
                                                                                                     : TiedCopyNaming::kNxdt;
  }
  return d;
}

}  // namespace ckpt

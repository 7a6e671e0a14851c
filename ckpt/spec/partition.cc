#include "ckpt/spec/partition.h"

#include "ckpt/util/error.h"
#include "ckpt/spec/tag_paths.h"
#include <algorithm>
#include <stdexcept>

#include "ckpt/spec/lora.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/pt/tensor.h"

namespace ckpt {
namespace {

std::string LayerName(int l, const std::string& leaf) {
  return "language_model.encoder.layers." + std::to_string(l) + "." + leaf;
}

int64_t FieldInt(const nlohmann::json& j, const char* key, int64_t lo, int64_t hi, const std::string& where) {
  if (!j.contains(key)) throw Error(where + ": model format has no '" + key + "'");
  const auto& v = j.at(key);
  if (!v.is_number_integer()) throw Error(where + ": model format '" + key + "' is not an integer");
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw Error(where + ": model format '" + key + "' is " + std::to_string(x) + ", outside " + std::to_string(lo) + ".." + std::to_string(hi));
  return x;
}

std::string FieldChoice(const nlohmann::json& j, const char* key, std::initializer_list<const char*> choices, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_string()) throw Error(where + ": model format has no string '" + key + "'");
  const std::string v = j.at(key).get<std::string>();
  std::string all;
  for (const char* c : choices) {
    if (v == c) return v;
    all += (all.empty() ? "" : ", ") + std::string(c);
  }
  throw Error(where + ": model format '" + key + "' is '" + v + "', not one of " + all);
}

bool FieldBool(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_boolean()) throw Error(where + ": model format has no boolean '" + key + "'");
  return j.at(key).get<bool>();
}

}  // namespace

int64_t ModelFormat::PaddedVocab(int tp) const {
  const int64_t multiple = make_vocab_size_divisible_by * tp;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

std::optional<int64_t> ModelFormat::PaddingRuleGiving(int64_t vocab, int64_t rows, int tp) {
  if (tp < 1 || vocab < 1 || vocab > rows || rows > kMaxVocab || rows % tp) return std::nullopt;
  ModelFormat f;
  f.vocab_size = vocab;
  const auto gives = [&](int64_t rule) {
    f.make_vocab_size_divisible_by = rule;
    return f.PaddedVocab(tp) == rows;
  };
  if (gives(kNnmDefaultPaddingRule)) return kNnmDefaultPaddingRule;
  // A rule that fits divides rows / tp, and exceeds (rows - vocab) / tp.
  for (int64_t rule = (rows - vocab) / tp + 1; rule <= std::min(rows / tp, kMaxPaddingRule); ++rule)
    if ((rows / tp) % rule == 0 && gives(rule)) return rule;
  return std::nullopt;
}

std::string ModelFormat::Describe() const {
  std::string s = std::string(family == ModelFamily::kHfLlama ? "HF-style llama" : layernorm ? "gpt-style" : "llama-style") + ", " + std::to_string(layers) + " layers, hidden " +
                  std::to_string(hidden) + ", ffn " + std::to_string(ffn) + ", " + std::to_string(heads) + " heads";
  if (kv_heads != heads) s += " (" + std::to_string(kv_heads) + " KV)";
  if (kv_size_multiplier > 1) s += std::string(", KV replicated x") + std::to_string(kv_size_multiplier) + " (" + BackendName(hw_backend) + ")";
  if (moe())
    s += ", MoE: " + std::to_string(experts) + " experts, top " + std::to_string(moe_top_k) + ", every " + std::to_string(moe_frequency) +
         (moe_frequency == 1 ? "st" : "th") + " layer";
  s += ", vocab " + std::to_string(vocab_size);
  return lora.on() ? s + ", " + DescribeLora(lora) : s;
}

std::string ModelFormat::CheckTensorParallel(int tp) const {
  auto no = [&](const std::string& what, int64_t n) {
    return "tensor parallel degree " + std::to_string(tp) + " does not divide the " + what + " (" + std::to_string(n) + ")";
  };
  if (tp < 1 || tp > kMaxRanks) return "tensor parallel degree " + std::to_string(tp) + " is out of range";
  if (std::string why = MoeUnsupported(*this); !why.empty()) return why;
  if (heads % tp) return no("attention heads", heads);
  if (family == ModelFamily::kHfLlama) {
    if (ffn % tp) return no("FFN width", ffn);
    // NxD's ParallelEmbedding and the converter split the vocabulary evenly, with no padding.
    if (vocab_size % tp) return no("vocabulary", vocab_size) + " (the HF-style family does not pad it)";
    if (tied_output) return "the HF-style family with tied embeddings (no lm_head.weight) is not supported";
    if (const std::string why = LoraProblem(*this); !why.empty()) return why;
    return KvReplicationProblem(*this, tp);
  }
  if (kv_heads % tp && tp % kv_heads)
    return no("KV heads", kv_heads) + ", and is not a multiple of them (NxD replicates KV heads only by a whole kv_size_multiplier)";
  if (ffn % tp) return no("FFN width", ffn);
  return "";
}

std::string ModelFormat::CheckExpertParallel(int ep) const {
  if (ep < 1 || ep > kMaxRanks) return "expert parallel degree " + std::to_string(ep) + " is out of range";
  if (!moe()) return ep == 1 ? "" : "expert parallel degree " + std::to_string(ep) + " needs an MoE model (Mixtral); this one is dense";
  if (experts % ep)
    return "expert parallel degree " + std::to_string(ep) + " does not divide the " + std::to_string(experts) +
           " MoE experts (NxD gives each ep rank experts / ep whole experts)";
  return "";
}

std::string ModelFormat::CheckSizes() const {
  auto over = [](const char* what, int64_t v, int64_t max) {
    return std::string(what) + " " + std::to_string(v) + " is beyond any model (at most " + std::to_string(max) + ")";
  };
  if (layers < 1 || layers > kMaxLayers) return over("the layer count", layers, kMaxLayers);
  if (hidden < 1 || hidden > (1 << 20)) return over("the hidden size", hidden, 1 << 20);
  if (ffn < 1 || ffn > (1 << 20)) return over("the FFN width", ffn, 1 << 20);
  if (vocab_size < 1 || vocab_size > kMaxVocab) return over("the vocabulary", vocab_size, kMaxVocab);
  if (max_positions < 0 || max_positions > kMaxPositions) return over("max_position_embeddings", max_positions, kMaxPositions);
  if (!(rope_theta > 0 && rope_theta <= 1e12)) return "rope_theta " + std::to_string(rope_theta) + " is not in (0, 1e12]";
  if (!(norm_eps > 0 && norm_eps < 1)) return "the norm epsilon " + std::to_string(norm_eps) + " is not in (0, 1)";
  if (!(rotary_percentage > 0 && rotary_percentage <= 1)) return "rotary_percentage " + std::to_string(rotary_percentage) + " is not in (0, 1]";
  if (experts < 0 || experts > (1 << 16)) return over("the MoE expert count", experts, 1 << 16);
  if (moe() && (moe_top_k < 1 || moe_top_k > experts))
    return "MoE top_k " + std::to_string(moe_top_k) + " is not between 1 and the " + std::to_string(experts) + " experts";
  if (moe_frequency < 1 || moe_frequency > kMaxLayers) return over("moe_frequency", moe_frequency, kMaxLayers);
  return "";
}

nlohmann::ordered_json ModelFormat::ToJson() const {
  nlohmann::ordered_json j = {{"num_layers", layers},
          {"hidden_size", hidden},
          {"ffn_hidden_size", ffn},
          {"num_attention_heads", heads},
          {"num_kv_heads", kv_heads},
          {"vocab_size", vocab_size},
          {"make_vocab_size_divisible_by", make_vocab_size_divisible_by},
          {"normalization", layernorm ? "layernorm" : "rmsnorm"},
          {"activation", gelu ? "gelu" : "swiglu"},
          {"has_bias", bias},
          {"position_embedding_type", learned_positions ? "learned_absolute" : "rope"},
          {"max_position_embeddings", max_positions},
          {"share_embeddings_and_output_weights", tied_output},
          {"rope_theta", rope_theta},
          {"layernorm_epsilon", norm_eps},
          {"rotary_percentage", rotary_percentage},
          {"model_family", FamilyName(family)},
          {"fuse_qkv", fuse_qkv},
          {"qkv_linear", qkv_linear},
          {"kv_size_multiplier", kv_size_multiplier},
          {"hw_backend", BackendName(hw_backend)}};
  // Dense models' manifests stay as they were.
  if (moe()) j["num_experts"] = experts, j["moe_top_k"] = moe_top_k, j["moe_frequency"] = moe_frequency;
  // Models without LoRA keep their manifests as they were.
  if (lora.on()) j["lora"] = LoraToJson(lora);
  return j;
}

ModelFormat ModelFormat::FromJson(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw Error(where + ": model format is not an object");
  constexpr int64_t kBig = int64_t{1} << 40;
  ModelFormat f;
  f.layers = FieldInt(j, "num_layers", 1, 1 << 20, where);
  f.hidden = FieldInt(j, "hidden_size", 1, kBig, where);
  f.ffn = FieldInt(j, "ffn_hidden_size", 1, kBig, where);
  f.heads = FieldInt(j, "num_attention_heads", 1, f.hidden, where);
  f.kv_heads = FieldInt(j, "num_kv_heads", 1, f.heads, where);
  f.vocab_size = FieldInt(j, "vocab_size", 1, kBig, where);
  f.make_vocab_size_divisible_by = FieldInt(j, "make_vocab_size_divisible_by", 1, kMaxPaddingRule, where);
  f.layernorm = FieldChoice(j, "normalization", {"rmsnorm", "layernorm"}, where) == "layernorm";
  f.gelu = FieldChoice(j, "activation", {"swiglu", "gelu"}, where) == "gelu";
  f.bias = FieldBool(j, "has_bias", where);
  f.learned_positions = FieldChoice(j, "position_embedding_type", {"rope", "learned_absolute"}, where) == "learned_absolute";
  f.max_positions = FieldInt(j, "max_position_embeddings", 0, kBig, where);
  f.tied_output = FieldBool(j, "share_embeddings_and_output_weights", where);
  // Absent from manifests written before they were recorded: the values those were trained with.
  auto number = [&](const char* key, double dflt) {
    if (!j.contains(key)) return dflt;
    if (!j.at(key).is_number()) throw Error(where + ": model format '" + key + "' is not a number");
    return j.at(key).get<double>();
  };
  f.rope_theta = number("rope_theta", f.rope_theta);
  f.norm_eps = number("layernorm_epsilon", f.norm_eps);
  f.rotary_percentage = number("rotary_percentage", f.rotary_percentage);
  // Absent from manifests written before families were recorded: Megatron-style.
  if (j.contains("model_family")) {
    const std::string fam = FieldChoice(j, "model_family", {"megatron", "hf_llama"}, where);
    f.family = *ParseFamily(fam);
    f.fuse_qkv = FieldBool(j, "fuse_qkv", where);
    f.qkv_linear = FieldBool(j, "qkv_linear", where);
    f.kv_size_multiplier = FieldInt(j, "kv_size_multiplier", 1, 1 << 20, where);
    const std::string hw = FieldChoice(j, "hw_backend", {"trn1", "trn2", "unknown"}, where);
    f.hw_backend = ParseBackend(hw).value_or(HwBackend::kUnknown);
  }
  if (j.contains("num_experts")) {
    f.experts = FieldInt(j, "num_experts", 1, 1 << 16, where);
    f.moe_top_k = FieldInt(j, "moe_top_k", 1, f.experts, where);
    f.moe_frequency = FieldInt(j, "moe_frequency", 1, kMaxLayers, where);
  }
  if (j.contains("lora")) f.lora = LoraFormatOfJson(j.at("lora"), where);
  if (f.hidden % f.heads) throw Error(where + ": model format hidden_size " + std::to_string(f.hidden) + " is not a multiple of num_attention_heads");
  if (f.heads % f.kv_heads) throw Error(where + ": model format num_attention_heads is not a multiple of num_kv_heads");
  if (const std::string why = f.CheckSizes(); !why.empty()) throw Error(where + ": model format: " + why);
  return f;
}

std::vector<ParamRule> OptimizerParameters(const ModelFormat& f, int tp) {
  if (!f.lora.on() || f.lora.saved != LoraSaved::kAdapterOnly) return LogicalParameters(f, tp);
  ModelFormat trained = f;
  trained.lora.saved = LoraSaved::kBaseAndAdapter;
  return LogicalParameters(trained, tp);
}

std::vector<ParamRule> LogicalParameters(const ModelFormat& f, int tp) {
  if (f.family == ModelFamily::kHfLlama) return WithLora(f, HfLlamaParameters(f, tp));
  const int64_t H = f.hidden, F = f.ffn, hd = f.head_dim(), V = f.PaddedVocab(tp);
  std::vector<ParamRule> p;
  int layer = -1;
  auto add = [&](std::string name, std::vector<int64_t> shape, SplitDim split, FusedRows fused = FusedRows::kPlain) {
    ParamRule r{std::move(name), std::move(shape), split, fused};
    r.spec = TensorParallelSpec(r.shape, split, fused, f);
    r.layer = layer;
    p.push_back(std::move(r));
  };
  // Column-parallel linears split their rows and biases alike; row-parallel
  // ones split their columns and keep their biases whole.
  auto column = [&](const std::string& name, int64_t out, FusedRows fused) {
    add(name + ".weight", {out, H}, SplitDim::kRows, fused);
    if (f.bias) add(name + ".bias", {out}, SplitDim::kRows, fused);
  };
  auto row = [&](const std::string& name, int64_t in) {
    add(name + ".weight", {H, in}, SplitDim::kColumns);
    if (f.bias) add(name + ".bias", {H}, SplitDim::kReplicated);
  };
  auto norm = [&](const std::string& name) {
    add(name + ".weight", {H}, SplitDim::kReplicated);
    p.back().norm = true;
    if (f.layernorm) add(name + ".bias", {H}, SplitDim::kReplicated), p.back().norm = true;
  };
  add("language_model.embedding.word_embeddings.weight", {V, H}, SplitDim::kRows);
  p.back().vocab = true;
  p.back().place = StagePlace::kFirst;
  if (f.learned_positions) {
    add("language_model.embedding.position_embeddings.weight", {f.max_positions, H}, SplitDim::kReplicated);
    p.back().place = StagePlace::kFirst;
  }
  for (layer = 0; layer < f.layers; ++layer) {
    norm(LayerName(layer, "input_layernorm"));
    if (f.kv_heads != f.heads) {
      column(LayerName(layer, "self_attention.query"), H, FusedRows::kPlain);
      column(LayerName(layer, "self_attention.key_value"), 2 * f.kv_heads * hd, FusedRows::kPerGroupKv);
    } else {
      column(LayerName(layer, "self_attention.query_key_value"), 3 * H, FusedRows::kPerHeadQkv);
    }
    row(LayerName(layer, "self_attention.dense"), H);
    norm(LayerName(layer, "post_attention_layernorm"));
    // NxDT models/megatron/transformer.py ParallelTransformerLayer: NeuronSwitchMLP in MoE layers.
    if (IsMoeLayer(f, layer)) {
      AppendMoeParameters(f, layer, p);
      continue;
    }
    column(LayerName(layer, "mlp.dense_h_to_4h"), f.gelu ? F : 2 * F, f.gelu ? FusedRows::kPlain : FusedRows::kGateUp);
    row(LayerName(layer, "mlp.dense_4h_to_h"), F);
  }
  layer = -1;
  const size_t last = p.size();
  norm("language_model.encoder.final_layernorm");
  if (!f.tied_output) {
    add("language_model.output_layer.weight", {V, H}, SplitDim::kRows);
    p.back().vocab = true;
  }
  for (size_t i = last; i < p.size(); ++i) p[i].place = StagePlace::kLast;
  return p;
}

ShardSpec ExpertSpec(const std::vector<int64_t>& shape, ExpertWeight which) {
  if (shape.size() != 3) throw Error("an expert weight is 3-D (experts, in, out), not " + ShapeString(shape));
  ShardSpec s = ShardSpec::Whole(shape, {Axis::kDp}).Split(0, {Axis::kEp, SplitKind::kContiguous});
  if (which == ExpertWeight::kGateUp) return s.Split(2, {Axis::kTp, SplitKind::kStrided, 2});
  return s.Split(1, {Axis::kTp, SplitKind::kContiguous});
}

HeadSplit KvReplicationOf(const ModelFormat& f) {
  HeadSplit h;
  h.kv_heads = f.kv_heads, h.kv_multiplier = f.kv_size_multiplier;
  h.order = f.hw_backend == HwBackend::kTrn2 ? KvOrder::kConsecutive : KvOrder::kInterleaved;
  return h;
}

ShardSpec TensorParallelSpec(const std::vector<int64_t>& shape, SplitDim split, FusedRows fused, const ModelFormat& f) {
  if (split == SplitDim::kReplicated) return ShardSpec::Whole(shape, {Axis::kTp, Axis::kDp});
  const int dim = split == SplitDim::kRows ? 0 : 1;
  const int64_t hd = f.heads > 0 ? f.head_dim() : 0;  // head splits only; a plain cut needs no heads
  DimSplit cut;
  HeadSplit& heads = cut.heads;
  heads = KvReplicationOf(f);
  switch (fused) {
    case FusedRows::kPlain:
    case FusedRows::kPerHeadQkv: break;  // whole heads, tp divides them: contiguous
    case FusedRows::kGateUp: cut.kind = SplitKind::kStrided, cut.parts = 2; break;
    case FusedRows::kPerGroupKv:  // shardkit's rule: groups replicated over consecutive ranks (KvReplicasOf)
      cut.kind = SplitKind::kHeads;
      heads = {{{f.kv_heads, shape.at(dim) / f.kv_heads, true}}, f.kv_heads, 0, KvOrder::kConsecutive};
      break;
    case FusedRows::kQueryHeads: cut.kind = SplitKind::kHeads, heads.regions = {{f.heads, hd, false}}; break;
    case FusedRows::kKvHeads: cut.kind = SplitKind::kHeads, heads.regions = {{f.kv_heads, hd, true}}; break;
    case FusedRows::kQkvHeads: cut.kind = SplitKind::kHeads, heads.regions = {{f.heads, hd, false}, {f.kv_heads, hd, true}, {f.kv_heads, hd, true}}; break;
  }
  return ShardSpec::Whole(shape, {Axis::kDp}).Split(dim, cut);
}

namespace {
// A rule made by hand without its spec would index boxes of no dimensions.
const ShardSpec& SpecOf(const ParamRule& p) {
  if (p.spec.global_shape != p.shape)
    throw Error("parameter " + p.name + " of shape " + ShapeString(p.shape) + " has no shard spec of that shape");
  return p.spec;
}
}  // namespace

std::vector<Run> LocalRuns(const ParamRule& p, const ModelFormat&, int tp, int rank) {
  // An expert weight is cut on two dims (ep on 0, tp on 2): no runs along one dim describe it.
  if (p.split == SplitDim::kExperts) throw std::logic_error("LocalRuns: " + p.name + " is an expert weight; ask LocalBoxes");
  const int dim = p.split == SplitDim::kColumns ? 1 : 0;
  std::vector<Run> runs;
  for (const Box& b : BoxesOf(SpecOf(p), AxisCoords::Tp(tp, rank))) runs.push_back({b.local.at(dim), b.offset.at(dim), b.size.at(dim)});
  return runs;
}

std::vector<Box> LocalBoxes(const ParamRule& p, const AxisCoords& at) { return BoxesOf(SpecOf(p), at); }

KvReplicas KvReplicasOf(int64_t kv_heads, int tp, int rank) {
  const int sharing = tp / static_cast<int>(kv_heads);
  return {rank / sharing, rank / sharing * sharing, sharing};
}

std::vector<int64_t> LocalShape(const ParamRule& p, const ModelFormat&, int tp, int rank) {
  return LocalShapeOf(SpecOf(p), AxisCoords::Tp(tp, rank));
}

std::vector<int64_t> LocalShape(const ParamRule& p, const AxisCoords& at) { return LocalShapeOf(SpecOf(p), at); }

std::vector<int64_t> StageBounds(int64_t layers, int pp, const std::vector<int64_t>& cuts) {
  if (pp < 1 || pp > kMaxRanks) throw Error("pipeline parallel degree " + std::to_string(pp) + " is out of range");
  if (pp > layers)
    throw Error("pipeline parallel degree " + std::to_string(pp) + " exceeds the " + std::to_string(layers) +
                " layers: every stage needs at least one layer");
  std::vector<int64_t> b{0};
  if (cuts.empty()) {
    const int64_t base = layers / pp, rem = layers % pp;
    for (int s = 0; s < pp; ++s) b.push_back(b.back() + base + (s >= pp - rem ? 1 : 0));
    return b;
  }
  if (static_cast<int>(cuts.size()) != pp - 1)
    throw Error("the pipeline cuts list " + std::to_string(cuts.size()) + " cuts; " + std::to_string(pp) + " stages need " +
                std::to_string(pp - 1));
  for (int64_t c : cuts) {
    if (c <= b.back() || c >= layers)
      throw Error("pipeline cuts must be ascending layer numbers between 1 and " + std::to_string(layers - 1) + " (got " +
                  std::to_string(c) + ")");
    b.push_back(c);
  }
  b.push_back(layers);
  return b;
}

std::vector<int64_t> CutsOf(const std::vector<int64_t>& bounds) {
  if (bounds.size() <= 2) return {};
  return {bounds.begin() + 1, bounds.end() - 1};
}

std::vector<int64_t> VirtualStageBounds(int64_t layers, int pp, int virtual_stages, const std::vector<int64_t>& cuts) {
  if (virtual_stages < 1 || virtual_stages > kMaxRanks)
    throw Error("virtual_pipeline_size " + std::to_string(virtual_stages) + " is out of range");
  if (virtual_stages == 1) return StageBounds(layers, pp, cuts);
  const int64_t stages = int64_t{pp} * virtual_stages;
  if (stages > layers)
    throw Error("virtual_pipeline_size " + std::to_string(virtual_stages) + " at pp " + std::to_string(pp) + " cuts the " + std::to_string(layers) +
                " layers in " + std::to_string(stages) + " virtual pipeline stages: every stage needs at least one layer");
  if (!cuts.empty() && static_cast<int64_t>(cuts.size()) != stages - 1)
    throw Error("the pipeline cuts list " + std::to_string(cuts.size()) + " cuts; " + std::to_string(stages) + " virtual pipeline stages (pp " +
                std::to_string(pp) + " x virtual_pipeline_size " + std::to_string(virtual_stages) + ") need " + std::to_string(stages - 1));
  return StageBounds(layers, static_cast<int>(stages), cuts);
}

std::vector<std::pair<int64_t, int64_t>> RankLayerRanges(const std::vector<int64_t>& bounds, int virtual_stages, int rank) {
  const int pp = static_cast<int>(bounds.size() - 1) / virtual_stages;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int s = rank; s + 1 < static_cast<int>(bounds.size()); s += pp) out.push_back({bounds[s], bounds[s + 1]});
  return out;
}

bool RankHoldsLayer(const std::vector<int64_t>& bounds, int virtual_stages, int rank, int64_t layer) {
  if (layer == kEveryStageLayer) return true;
  for (const auto& [first, end] : RankLayerRanges(bounds, virtual_stages, rank))
    if (layer >= first && layer < end) return true;
  return false;
}

std::string LayerRangesString(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  std::string s;
  for (const auto& [first, end] : ranges) s += (s.empty() ? "" : ", ") + std::to_string(first) + ".." + std::to_string(end - 1);
  return s;
}

std::vector<StageParam> StageParameters(const std::vector<ParamRule>& logical, const std::vector<int64_t>& bounds, int stage,
                                        TiedCopyNaming naming, int virtual_stages) {
  const int last = static_cast<int>(bounds.size() - 1) / virtual_stages - 1;
  std::vector<StageParam> out;
  const ParamRule* embedding = nullptr;
  bool output = false;
  for (const ParamRule& p : logical) {
    if (p.vocab && p.place == StagePlace::kFirst) embedding = &p;
    if (p.vocab && p.place == StagePlace::kLast) output = true;
    bool mine;
    if (p.place == StagePlace::kLayer) mine = RankHoldsLayer(bounds, virtual_stages, stage, p.layer);
    else mine = stage == (p.place == StagePlace::kFirst ? 0 : last);
    if (mine) out.push_back({p.name, &p});
  }
  // GPT's tied output copy on the last stage (TiedCopyNaming); the HF-style family is never tied here.
  if (embedding && !output && stage == last) {
    if (naming == TiedCopyNaming::kNxdt) out.push_back({kTiedOutputCopy, embedding});
    else if (last > 0) out.push_back({kMegatronLmTiedCopy, embedding});
  }
  return out;
}

std::string SameStageTiedCopy(const std::vector<StageParam>& stage) {
  for (const StageParam& copy : stage)
    if (copy.tied_copy())
      for (const StageParam& p : stage)
        if (p.name == copy.rule->name) return copy.name;
  return "";
}

int LayerOfName(const std::string& name) {
  static const std::string kLayers = ".layers.";
  const size_t at = name.find(kLayers);
  if (at == std::string::npos) return -1;
  size_t i = at + kLayers.size();
  int64_t v = 0;
  size_t digits = 0;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && digits < 9; ++i, ++digits) v = v * 10 + (name[i] - '0');
  return digits > 0 && i < name.size() && name[i] == '.' ? static_cast<int>(v) : -1;
}

int64_t Zero1ShardRows(int64_t rows, int dp) { return (rows + dp - 1) / dp; }

}  // namespace ckpt

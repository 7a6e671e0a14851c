#include "ckpt/spec/model_family.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>

#include "ckpt/util/error.h"
#include "ckpt/spec/rank_grid.h"

namespace ckpt {
namespace {

int64_t ConfigInt(const nlohmann::json& j, const char* key, const std::string& where, std::optional<int64_t> fallback = std::nullopt) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback) return *fallback;
    throw Error(where + ": has no '" + key + "'");
  }
  if (!j[key].is_number_integer() || j[key].get<int64_t>() < 1 || j[key].get<int64_t>() > (int64_t{1} << 40))
    throw Error(where + ": '" + key + "' is " + j[key].dump() + ", not a positive whole number");
  return j[key].get<int64_t>();
}

// A positive number config.json may leave out (`fallback`: transformers' default).
double ConfigNumber(const nlohmann::json& j, const char* key, const std::string& where, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number() || !(j[key].get<double>() > 0)) throw Error(where + ": '" + key + "' is " + j[key].dump() + ", not a positive number");
  return j[key].get<double>();
}

// The HF-style family's attention tensors (LlamaAttention.__init__).
enum class HfAttention { kQkvFused, kQkvSplit, kStride3, kPlain };
HfAttention AttentionOf(const ModelFormat& f) {
  if (f.qkv_linear) return f.fuse_qkv ? HfAttention::kQkvFused : HfAttention::kQkvSplit;
  return f.fuse_qkv && f.kv_heads == f.heads ? HfAttention::kStride3 : HfAttention::kPlain;
}

std::string HfLayer(int64_t l, const std::string& rest) { return "model.layers." + std::to_string(l) + "." + rest; }

// --- Mixtral (MoE): HF's MixtralSparseMoeBlock from NxD's MoE tensors (issue #38) ---
// transformers' modeling_mixtral.py MixtralSparseMoeBlock: `gate` (E, H), then
// per expert MixtralBlockSparseTop2MLP's w1, w2, w3. NxD keeps them fused and
// input-major (moe_parallel_layers.py ExpertFusedColumnParallelLinear:
// gate_up_proj (E, H, 2I), last dim [gate || up]; ExpertFusedRowParallelLinear:
// down_proj (E, I, H)), so w1[e] = gate_up_proj[e][:, :I].T, w3[e] =
// gate_up_proj[e][:, I:].T, w2[e] = down_proj[e].T (as NxD's inference converter
// examples/inference/mixtral/neuron_modeling_mixtral.py
// convert_mixtral_to_neuron_state_dict maps them; tests/data/upstream/nxd_mixtral
// hf_reference.py ran it). Seen as rows of I elements, gate_up_proj[e]'s gate
// half is every other row from 2eH, its up half every other row from 2eH + 1.
void AppendHfMoeTensors(const ModelFormat& f, int64_t layer, DType dt, std::vector<HfTensorSpec>& out) {
  const int64_t E = f.experts, H = f.hidden, I = f.ffn;
  const std::string p = HfLayer(layer, "block_sparse_moe."), gate_up = ParamName(f, Module::kExpertsIn, static_cast<int>(layer)),
                    down = ParamName(f, Module::kExpertsOut, static_cast<int>(layer));
  out.push_back({p + "gate.weight", {E, H}, dt, {{ParamName(f, Module::kRouter, static_cast<int>(layer)), 0, E}}, H, false});
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = p + "experts." + std::to_string(e) + ".";
    out.push_back({x + "w1.weight", {I, H}, dt, {{gate_up, 2 * e * H, H, 2}}, I, true});
    out.push_back({x + "w2.weight", {H, I}, dt, {{down, e * I, I}}, H, true});
    out.push_back({x + "w3.weight", {I, H}, dt, {{gate_up, 2 * e * H + 1, H, 2}}, I, true});
  }
}

// HF's tensors of the HF-style family: names are HF's already; fused tensors are split by rows.
std::vector<HfTensorSpec> HfLlamaTensors(const ModelFormat& f, DType dt) {
  const int64_t H = f.hidden, F = f.ffn, hd = f.head_dim(), Q = f.heads * hd, K = f.kv_heads * hd, V = f.vocab_size;
  std::vector<HfTensorSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<HfRowBlock> blocks) {
    const int64_t width = shape.size() > 1 ? shape[1] : 1;
    out.push_back({std::move(name), std::move(shape), dt, std::move(blocks), width, false});
  };
  auto same = [&](const std::string& name, std::vector<int64_t> shape) { add(name, shape, {{name, 0, shape[0]}}); };
  same("model.embed_tokens.weight", {V, H});
  // transformers' LlamaDecoderLayer module order: self_attn, mlp, input_layernorm, post_attention_layernorm.
  for (int64_t i = 0; i < f.layers; ++i) {
    const std::string q = HfLayer(i, "self_attn.q_proj.weight"), k = HfLayer(i, "self_attn.k_proj.weight"), v = HfLayer(i, "self_attn.v_proj.weight");
    switch (AttentionOf(f)) {
      case HfAttention::kQkvFused:
      case HfAttention::kStride3: {
        const std::string qkv = HfLayer(i, AttentionOf(f) == HfAttention::kQkvFused ? "self_attn.qkv_proj.weight_qkv" : "self_attn.qkv_proj.weight");
        add(q, {Q, H}, {{qkv, 0, Q}}), add(k, {K, H}, {{qkv, Q, K}}), add(v, {K, H}, {{qkv, Q + K, K}});
        break;
      }
      case HfAttention::kQkvSplit:
        add(q, {Q, H}, {{HfLayer(i, "self_attn.qkv_proj.weight_q"), 0, Q}});
        add(k, {K, H}, {{HfLayer(i, "self_attn.qkv_proj.weight_k"), 0, K}});
        add(v, {K, H}, {{HfLayer(i, "self_attn.qkv_proj.weight_v"), 0, K}});
        break;
      case HfAttention::kPlain: same(q, {Q, H}), same(k, {K, H}), same(v, {K, H}); break;
    }
    same(HfLayer(i, "self_attn.o_proj.weight"), {H, Q});
    if (IsMoeLayer(f, i)) {
      AppendHfMoeTensors(f, i, dt, out);
    } else {
      const std::string gu = HfLayer(i, "mlp.gate_up_proj.weight");
      add(HfLayer(i, "mlp.gate_proj.weight"), {F, H}, {{gu, 0, F}});
      add(HfLayer(i, "mlp.up_proj.weight"), {F, H}, {{gu, F, F}});
      same(HfLayer(i, "mlp.down_proj.weight"), {H, F});
    }
    same(HfLayer(i, "input_layernorm.weight"), {H});
    same(HfLayer(i, "post_attention_layernorm.weight"), {H});
  }
  same("model.norm.weight", {H});
  if (!f.tied_output) same("lm_head.weight", {V, H});
  return out;
}

std::string L(int64_t layer, const std::string& rest) { return "language_model.encoder.layers." + std::to_string(layer) + "." + rest; }

std::vector<HfTensorSpec> LlamaTensors(const ckpt::ModelFormat& f, DType dt) {
  const int64_t H = f.hidden, F = f.ffn, hd = f.head_dim(), nh = f.heads, G = f.kv_heads, V = f.vocab_size;
  std::vector<HfTensorSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<HfRowBlock> blocks) {
    const int64_t width = shape.size() > 1 ? shape[1] : 1;
    out.push_back({std::move(name), std::move(shape), dt, std::move(blocks), width, false});
  };
  add("model.embed_tokens.weight", {V, H}, {{"language_model.embedding.word_embeddings.weight", 0, V}});
  for (int64_t i = 0; i < f.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, {{L(i, "input_layernorm.weight"), 0, H}});
    std::vector<HfRowBlock> q, k, v;
    if (G == nh) {  // per head [q_h; k_h; v_h]
      const std::string qkv = L(i, "self_attention.query_key_value.weight");
      for (int64_t h = 0; h < nh; ++h)
        q.push_back({qkv, h * 3 * hd, hd}), k.push_back({qkv, h * 3 * hd + hd, hd}), v.push_back({qkv, h * 3 * hd + 2 * hd, hd});
    } else {  // query, and per group [k_g; v_g]
      q.push_back({L(i, "self_attention.query.weight"), 0, H});
      const std::string kv = L(i, "self_attention.key_value.weight");
      for (int64_t g = 0; g < G; ++g) k.push_back({kv, g * 2 * hd, hd}), v.push_back({kv, g * 2 * hd + hd, hd});
    }
    add(p + "self_attn.q_proj.weight", {H, H}, q);
    add(p + "self_attn.k_proj.weight", {G * hd, H}, k);
    add(p + "self_attn.v_proj.weight", {G * hd, H}, v);
    add(p + "self_attn.o_proj.weight", {H, H}, {{L(i, "self_attention.dense.weight"), 0, H}});
    add(p + "post_attention_layernorm.weight", {H}, {{L(i, "post_attention_layernorm.weight"), 0, H}});
    if (IsMoeLayer(f, i)) {
      AppendHfMoeTensors(f, i, dt, out);
      continue;
    }
    const std::string fc = L(i, "mlp.dense_h_to_4h.weight");
    add(p + "mlp.gate_proj.weight", {F, H}, {{fc, 0, F}});
    add(p + "mlp.up_proj.weight", {F, H}, {{fc, F, F}});
    add(p + "mlp.down_proj.weight", {H, F}, {{L(i, "mlp.dense_4h_to_h.weight"), 0, H}});
  }
  add("model.norm.weight", {H}, {{"language_model.encoder.final_layernorm.weight", 0, H}});
  if (!f.tied_output) add("lm_head.weight", {V, H}, {{"language_model.output_layer.weight", 0, V}});
  return out;
}

std::vector<HfTensorSpec> Gpt2Tensors(const ckpt::ModelFormat& f, DType dt) {
  const int64_t H = f.hidden, F = f.ffn, hd = f.head_dim(), nh = f.heads, V = f.vocab_size;
  std::vector<HfTensorSpec> out;
  // `shape` is HF's; a transposed tensor's blocks have rows of shape[0] elements.
  auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<HfRowBlock> blocks, bool transpose = false) {
    const int64_t width = transpose ? shape[0] : (shape.size() > 1 ? shape[1] : 1);
    out.push_back({std::move(name), std::move(shape), dt, std::move(blocks), width, transpose});
  };
  auto one = [](const std::string& name, int64_t rows) { return std::vector<HfRowBlock>{{name, 0, rows}}; };
  add("transformer.wte.weight", {V, H}, one("language_model.embedding.word_embeddings.weight", V));
  add("transformer.wpe.weight", {f.max_positions, H}, one("language_model.embedding.position_embeddings.weight", f.max_positions));
  for (int64_t i = 0; i < f.layers; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    for (const char* part : {"weight", "bias"}) add(p + "ln_1." + part, {H}, one(L(i, std::string("input_layernorm.") + part), H));
    // c_attn: [q; k; v] over all heads, from per-head [q_h; k_h; v_h].
    for (const char* part : {"weight", "bias"}) {
      const std::string qkv = L(i, std::string("self_attention.query_key_value.") + part);
      std::vector<HfRowBlock> b;
      for (int64_t which = 0; which < 3; ++which)
        for (int64_t h = 0; h < nh; ++h) b.push_back({qkv, h * 3 * hd + which * hd, hd});
      if (std::string(part) == "weight") add(p + "attn.c_attn.weight", {H, 3 * H}, b, true);
      else add(p + "attn.c_attn.bias", {3 * H}, b);
    }
    add(p + "attn.c_proj.weight", {H, H}, one(L(i, "self_attention.dense.weight"), H), true);
    add(p + "attn.c_proj.bias", {H}, one(L(i, "self_attention.dense.bias"), H));
    for (const char* part : {"weight", "bias"}) add(p + "ln_2." + part, {H}, one(L(i, std::string("post_attention_layernorm.") + part), H));
    add(p + "mlp.c_fc.weight", {H, F}, one(L(i, "mlp.dense_h_to_4h.weight"), F), true);
    add(p + "mlp.c_fc.bias", {F}, one(L(i, "mlp.dense_h_to_4h.bias"), F));
    add(p + "mlp.c_proj.weight", {F, H}, one(L(i, "mlp.dense_4h_to_h.weight"), H), true);
    add(p + "mlp.c_proj.bias", {H}, one(L(i, "mlp.dense_4h_to_h.bias"), H));
  }
  for (const char* part : {"weight", "bias"}) add(std::string("transformer.ln_f.") + part, {H}, one(std::string("language_model.encoder.final_layernorm.") + part, H));
  if (!f.tied_output) add("lm_head.weight", {V, H}, one("language_model.output_layer.weight", V));
  return out;
}

}  // namespace

std::vector<HfTensorSpec> HfTensorsFor(const ModelFormat& f, DType dtype) {
  if (const std::string why = MoeHfUnsupported(f); !why.empty()) throw Error("the Hugging Face tensors of this MoE (Mixtral) model are not mapped: " + why);
  if (f.family == ModelFamily::kHfLlama) return HfLlamaTensors(f, dtype);
  return f.gelu ? Gpt2Tensors(f, dtype) : LlamaTensors(f, dtype);
}

std::string HfUnsupported(const ModelFormat& f) {
  if (const std::string why = MoeHfUnsupported(f); !why.empty()) return why;
  const bool llama = f.family == ModelFamily::kHfLlama || (!f.layernorm && !f.gelu && !f.bias && !f.learned_positions);
  const bool gpt2 = f.layernorm && f.gelu && f.bias && f.learned_positions && f.kv_heads == f.heads;
  // transformers' LlamaForCausalLM rotates every dimension of a head (LlamaRotaryEmbedding).
  if (llama && f.rotary_percentage != 1.0)
    return "rotary_percentage is " + std::to_string(f.rotary_percentage) +
           ": only part of each head is rotated, which LlamaForCausalLM cannot express (it rotates the whole head)";
  if (llama || gpt2) return "";
  return "the model format (" + f.Describe() +
         ") is neither llama-style (RMSNorm, SwiGLU, RoPE, no biases: LlamaForCausalLM) nor GPT-2-style (LayerNorm, GeLU, biases, "
         "learned positions, no GQA: GPT2LMHeadModel), so no Hugging Face architecture takes its weights";
}

Grouping FamilyGrouping(const ModelFormat& f, const std::vector<std::string>& params, GroupingRule rule) {
  if (rule == GroupingRule::kNameSplit) return NameSplit(params);
  const bool flag = rule == GroupingRule::kNxdtLayerNormDecay;
  return f.family == ModelFamily::kHfLlama ? NxdtHfGrouping(params, flag) : NxdtGrouping(params, flag);
}

namespace {
// The architecture a config.json names. Without `architectures`,
// transformers' AutoConfig dispatches on model_type (configuration_auto.py
// CONFIG_MAPPING), and AutoModelForCausalLM takes the causal-LM class of that
// type: so does this.
std::string ArchitectureOf(const nlohmann::json& c, const std::string& cpath) {
  std::string arch = c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty() &&
                             c["architectures"][0].is_string()
                         ? c["architectures"][0].get<std::string>()
                         : "";
  if (arch.empty() && c.contains("model_type") && c["model_type"].is_string()) {
    const std::string type = c["model_type"].get<std::string>();
    if (type == "llama") arch = "LlamaForCausalLM";
    else if (type == "mixtral") arch = "MixtralForCausalLM";
    else if (type == "gpt2") arch = "GPT2LMHeadModel";
    else throw Error(cpath + ": model_type '" + type + "' (and no architectures) is not one this import knows (llama, mixtral, gpt2)");
  }
  if (arch.empty()) throw Error(cpath + ": names neither architectures nor model_type, so the model it describes is unknown");
  return arch;
}

bool ConfigFlag(const nlohmann::json& c, const char* key, const std::string& cpath, bool fallback) {
  if (!c.contains(key)) return fallback;
  if (!c[key].is_boolean()) throw Error(cpath + ": '" + key + "' is not true or false");
  return c[key].get<bool>();
}

// transformers' defaults for what a config.json leaves out, where LlamaConfig
// (configuration_llama.py) and MixtralConfig (configuration_mixtral.py, at the
// 4.52.4 NxDT's requirements.txt pins) differ.
struct HfDefaults {
  double rope_theta, norm_eps;
  int64_t max_positions;
};
constexpr HfDefaults kLlamaDefaults{10000.0, 1e-6, 2048};
constexpr HfDefaults kMixtralDefaults{1e6, 1e-5, 4096 * 32};

// LlamaConfig's fields, which MixtralConfig shares (with `d` for what it leaves out).
void ReadLlamaFields(const nlohmann::json& c, const std::string& cpath, const HfDefaults& d, ModelFormat& f) {
  f.hidden = ConfigInt(c, "hidden_size", cpath), f.ffn = ConfigInt(c, "intermediate_size", cpath);
  f.heads = ConfigInt(c, "num_attention_heads", cpath), f.kv_heads = ConfigInt(c, "num_key_value_heads", cpath, f.heads);
  f.layers = ConfigInt(c, "num_hidden_layers", cpath), f.vocab_size = ConfigInt(c, "vocab_size", cpath);
  f.tied_output = ConfigFlag(c, "tie_word_embeddings", cpath, false);
  if (ConfigFlag(c, "attention_bias", cpath, false) || ConfigFlag(c, "mlp_bias", cpath, false))
    throw Error(cpath + ": a Llama with biases, which NxDT's Llama has not");
  f.rope_theta = ConfigNumber(c, "rope_theta", cpath, d.rope_theta), f.norm_eps = ConfigNumber(c, "rms_norm_eps", cpath, d.norm_eps);
  f.max_positions = ConfigInt(c, "max_position_embeddings", cpath, d.max_positions);
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
    throw Error(cpath + ": rope_scaling is set; the training core's rope has no scaling, so this model would compute otherwise");
}

// --- Mixtral (MoE): config.json (issue #38) ---
// MixtralForCausalLM's config past Llama's keys (transformers'
// configuration_mixtral.py MixtralConfig; its defaults for what is left out):
// num_local_experts (8) and num_experts_per_tok (2); every layer is MoE
// (MixtralDecoderLayer always builds block_sparse_moe). What both the
// import and the trainer (FormatOfHfMixtralConfig) read.
void ReadMixtralConfig(const nlohmann::json& c, const std::string& cpath, ModelFormat& f) {
  f.experts = ConfigInt(c, "num_local_experts", cpath, 8);
  f.moe_top_k = ConfigInt(c, "num_experts_per_tok", cpath, 2);
  f.moe_frequency = 1;
  if (f.moe_top_k > f.experts)
    throw Error(cpath + ": 'num_experts_per_tok' " + std::to_string(f.moe_top_k) + " exceeds 'num_local_experts' " + std::to_string(f.experts));
  const std::string act = c.value("hidden_act", std::string("silu"));
  if (act != "silu") throw Error(cpath + ": 'hidden_act' is '" + act + "': NxD's experts here are SwiGLU (silu), so this model would compute otherwise");
  if (c.contains("router_jitter_noise") && !(c["router_jitter_noise"].is_number() && c["router_jitter_noise"].get<double>() == 0))
    throw Error(cpath + ": router_jitter_noise is set; NxD's RouterTopK adds no jitter, so this model would compute otherwise");
}

// NxDT's attention masks by config.sliding_window (hf_models/modeling_mixtral.py
// CoreAttention), but a model format carries no window, so the import refuses a
// window shorter than the positions: an export would describe another model.
// (The trainer checks the window against its sequence length instead.)
void RequireNoSlidingWindow(const nlohmann::json& c, const std::string& cpath, const ModelFormat& f) {
  if (c.contains("sliding_window") && !c["sliding_window"].is_null() &&
      (!c["sliding_window"].is_number_integer() || c["sliding_window"].get<int64_t>() < f.max_positions))
    throw Error(cpath + ": 'sliding_window' is " + c["sliding_window"].dump() + ", shorter than the " + std::to_string(f.max_positions) +
                " positions, and the model format carries no sliding window: a model written from it would attend to every earlier position");
}

ModelFormat Checked(ModelFormat f, const std::string& cpath) {
  if (f.hidden % f.heads || f.heads % f.kv_heads) throw Error(cpath + ": the head counts do not divide the hidden size");
  if (const std::string why = f.CheckSizes(); !why.empty()) throw Error(cpath + ": " + why);
  return f;
}
}  // namespace

ModelFormat FormatOfHfConfig(const nlohmann::json& c, const std::string& cpath) {
  const std::string arch = ArchitectureOf(c, cpath);
  ModelFormat f;
  if (arch == "LlamaForCausalLM") {
    ReadLlamaFields(c, cpath, kLlamaDefaults, f);
  } else if (arch == "MixtralForCausalLM") {
    f = FormatOfHfMixtralConfig(c, cpath);
    RequireNoSlidingWindow(c, cpath, f);
  } else if (arch == "GPT2LMHeadModel") {
    f.hidden = ConfigInt(c, "n_embd", cpath), f.heads = ConfigInt(c, "n_head", cpath), f.kv_heads = f.heads;
    f.ffn = ConfigInt(c, "n_inner", cpath, 4 * f.hidden), f.layers = ConfigInt(c, "n_layer", cpath);
    f.vocab_size = ConfigInt(c, "vocab_size", cpath), f.max_positions = ConfigInt(c, "n_positions", cpath);
    f.tied_output = ConfigFlag(c, "tie_word_embeddings", cpath, true);
    f.layernorm = f.gelu = f.bias = f.learned_positions = true;
    f.norm_eps = ConfigNumber(c, "layer_norm_epsilon", cpath, 1e-5);  // GPT2Config's default
    const std::string act = c.value("activation_function", std::string("gelu_new"));
    if (act != "gelu")
      throw Error(cpath + ": activation_function '" + act + "': the training core's GeLU is erf's ('gelu'), so this model would compute otherwise");
  } else {
    throw Error(cpath + ": architecture '" + arch + "' is not one this import knows (LlamaForCausalLM, MixtralForCausalLM, GPT2LMHeadModel)");
  }
  return Checked(f, cpath);
}

ModelFormat FormatOfHfMixtralConfig(const nlohmann::json& c, const std::string& cpath) {
  const std::string arch = ArchitectureOf(c, cpath);
  if (arch != "MixtralForCausalLM") throw Error(cpath + ": architecture '" + arch + "' is not MixtralForCausalLM");
  ModelFormat f;
  ReadLlamaFields(c, cpath, kMixtralDefaults, f);
  ReadMixtralConfig(c, cpath, f);
  return Checked(f, cpath);
}

std::string ParamName(const ModelFormat& f, Module m, int layer) {
  const bool hf = f.family == ModelFamily::kHfLlama;
  auto at = [&](const char* megatron, const char* hf_name) {
    return hf ? HfLayer(layer, hf_name) : "language_model.encoder.layers." + std::to_string(layer) + "." + megatron;
  };
  switch (m) {
    case Module::kEmbedding: return hf ? "model.embed_tokens.weight" : "language_model.embedding.word_embeddings.weight";
    case Module::kPositionEmbedding: return "language_model.embedding.position_embeddings.weight";
    case Module::kFinalNorm: return hf ? "model.norm.weight" : "language_model.encoder.final_layernorm.weight";
    case Module::kOutput: return hf ? "lm_head.weight" : "language_model.output_layer.weight";
    case Module::kInputNorm: return at("input_layernorm.weight", "input_layernorm.weight");
    case Module::kPostAttentionNorm: return at("post_attention_layernorm.weight", "post_attention_layernorm.weight");
    case Module::kAttentionOut: return at("self_attention.dense.weight", "self_attn.o_proj.weight");
    case Module::kMlpIn: return at("mlp.dense_h_to_4h.weight", "mlp.gate_up_proj.weight");
    case Module::kMlpOut: return at("mlp.dense_4h_to_h.weight", "mlp.down_proj.weight");
    case Module::kQkv:
      if (!hf) return at("self_attention.query_key_value.weight", "");
      return HfLayer(layer, AttentionOf(f) == HfAttention::kQkvFused ? "self_attn.qkv_proj.weight_qkv" : "self_attn.qkv_proj.weight");
    case Module::kQuery: return hf ? HfLayer(layer, f.qkv_linear ? "self_attn.qkv_proj.weight_q" : "self_attn.q_proj.weight") : at("self_attention.query.weight", "");
    case Module::kKey: return HfLayer(layer, f.qkv_linear ? "self_attn.qkv_proj.weight_k" : "self_attn.k_proj.weight");
    case Module::kValue: return HfLayer(layer, f.qkv_linear ? "self_attn.qkv_proj.weight_v" : "self_attn.v_proj.weight");
    case Module::kKeyValue: return at("self_attention.key_value.weight", "");
    case Module::kRouter: return at("mlp.moe.router.linear_router.weight", "mlp.router.linear_router.weight");
    case Module::kExpertsIn: return at("mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight", "mlp.expert_mlps.mlp_op.gate_up_proj.weight");
    case Module::kExpertsOut: return at("mlp.moe.expert_mlps.mlp_op.down_proj.weight", "mlp.expert_mlps.mlp_op.down_proj.weight");
  }
  return "";
}

bool IsMoeLayer(const ModelFormat& f, int64_t layer) {
  if (!f.moe()) return false;
  if (f.family == ModelFamily::kHfLlama) return layer % f.moe_frequency == 0;
  return f.experts > 1 && (layer + 1) % f.moe_frequency == 0;
}

std::vector<SpmdRankTensor> SpmdRankTensors(const ModelFormat& f, int layer, int ep) {
  if (ep <= 1 || !IsMoeLayer(f, layer)) return {};
  const std::string in = ParamName(f, Module::kExpertsIn, layer), prefix = in.substr(0, in.rfind("mlp_op.")) + "spmd_rank.";
  return {{prefix + "rank", {1}}, {prefix + "local_expert_indices", {1, f.experts / ep}}};
}

void SetSpmdRanksAfter(const ModelFormat& f, int ep, const std::string& key, Dict& d) {
  const int layer = LayerOfName(key);
  if (layer < 0 || key != ParamName(f, Module::kRouter, layer)) return;
  for (const auto& t : SpmdRankTensors(f, layer, ep)) d.Set(t.name, Value(Tensor::Zeros(DType::kInt32, t.shape)));
}

bool IsSpmdRankName(const std::string& name) {
  const auto family = FamilyOfName(name);
  const int layer = LayerOfName(name);
  if (!family || layer < 0) return false;
  ModelFormat every;  // an MoE layer at every layer, ep 2: the names alone
  every.family = *family, every.experts = 2, every.moe_frequency = 1;
  const auto spmd = SpmdRankTensors(every, layer, 2);
  return std::any_of(spmd.begin(), spmd.end(), [&](const SpmdRankTensor& s) { return s.name == name; });
}

bool IsExpertWeight(const ModelFormat& f, const std::string& name) {
  const int layer = LayerOfName(name);
  return IsMoeLayer(f, layer) && (name == ParamName(f, Module::kExpertsIn, layer) || name == ParamName(f, Module::kExpertsOut, layer));
}

namespace {
// A layer's name past "<layer prefix>." (ParamName of layer 0 less its prefix).
std::string LeafOf(const ModelFormat& f, Module m) {
  const std::string name = ParamName(f, m, 0), prefix = f.family == ModelFamily::kHfLlama ? "model.layers.0." : "language_model.encoder.layers.0.";
  return name.substr(prefix.size());
}
}  // namespace

namespace {
// A layer parameter's name past "layers.N." (FirstMoeName's names hold a layer).
std::string LeafOfLayerName(const std::string& n) { return n.substr(n.find('.', n.find(".layers.") + 8) + 1); }
}  // namespace

std::vector<std::string> MoeLeaves(ModelFamily family) {
  ModelFormat f;
  f.family = family;
  return {LeafOf(f, Module::kRouter), LeafOf(f, Module::kExpertsIn), LeafOf(f, Module::kExpertsOut)};
}

std::optional<std::string> FirstMoeName(const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    const auto family = FamilyOfName(n);
    if (!family || LayerOfName(n) < 0) continue;
    const std::string leaf = LeafOfLayerName(n);
    // The MoE module's own prefix: "mlp.moe." (Megatron-style) or the router's and experts' under "mlp." (HF-style).
    const std::string module = family == ModelFamily::kHfLlama ? "mlp." : "mlp.moe.";
    for (const std::string& part : {std::string("router."), std::string("expert_mlps."), std::string("shared_experts.")})
      if (leaf.starts_with(module + part)) return n;
  }
  return std::nullopt;
}

std::optional<std::string> FirstUnheldMoeName(const std::vector<std::string>& names) {
  for (const std::string& n : names) {
    if (!FirstMoeName({n})) continue;
    const auto known = MoeLeaves(*FamilyOfName(n));
    if (std::find(known.begin(), known.end(), LeafOfLayerName(n)) == known.end()) return n;
  }
  return std::nullopt;
}

std::string MoeModelOf(const std::string& moe_name) {
  const bool hf = FamilyOfName(moe_name) == ModelFamily::kHfLlama;
  return std::string("an MoE (Mixtral) model, ") + (hf ? "HF-style (NxDT modeling_mixtral.py)" : "Megatron-style (NxDT NeuronSwitchMLP)");
}

std::string MoeRefusal(const std::string& moe_name) {
  std::string what = MoeModelOf(moe_name) + ": it holds '" + moe_name + "'";
  if (FirstUnheldMoeName({moe_name}))
    return what + ", a part of NxD's MoE layer (shared experts, router or expert biases, spmd ranks) shardkit's Mixtral family does not hold, "
                  "so it refuses rather than drop it";
  return what + "; shardkit reads MoE tags of either style at any tp and ep, with their ZeRO-1 optimizer state (NxD's "
                "NeuronEPZero1Optimizer at ep > 1)";
}

std::string MoeFileProblem(const std::vector<std::string>& names) {
  if (const auto unheld = FirstUnheldMoeName(names)) return MoeRefusal(*unheld);
  const std::set<std::string> have(names.begin(), names.end());
  for (const std::string& n : names) {
    if (!FirstMoeName({n})) continue;
    const std::string layer = n.substr(0, n.size() - LeafOfLayerName(n).size());
    for (const std::string& leaf : MoeLeaves(*FamilyOfName(n)))
      if (!have.count(layer + leaf))
        return MoeModelOf(n) + ": it holds '" + n + "' but not '" + layer + leaf +
               "' (NxD's MoE layer as shardkit's Mixtral family holds it: router, expert_mlps.mlp_op.gate_up_proj and down_proj)";
  }
  return "";
}

std::string FamilyLabel(const ModelFormat& f) {
  if (!f.moe()) return FamilyName(f.family);
  return f.family == ModelFamily::kHfLlama ? "hf_mixtral" : "megatron_mixtral";
}

// --- Mixtral (MoE): what the family table does not describe (issue #38) ---
std::string MoeUnsupported(const ModelFormat& f) {
  if (!f.moe()) return "";
  if (f.gelu || f.bias || f.layernorm || f.learned_positions)
    return "an MoE (Mixtral) model with " + std::string(f.gelu ? "GeLU" : f.bias ? "biases" : f.layernorm ? "LayerNorm" : "learned positions") +
           ": NxD's experts here are SwiGLU without biases (glu_mlp, NxDT NeuronSwitchMLP asserts activation swiglu and no bias), in a Llama";
  if (f.family == ModelFamily::kMegatron && f.experts < 2)
    return "a Megatron-style MoE model with one expert: NxDT's ParallelTransformerLayer builds NeuronSwitchMLP only for num_moe_experts > 1";
  return "";
}

std::string MoeHfUnsupported(const ModelFormat& f) {
  if (!f.moe()) return "";
  if (const std::string why = MoeUnsupported(f); !why.empty()) return why;
  for (int64_t l = 0; l < f.layers; ++l)
    if (!IsMoeLayer(f, l))
      return "layer " + std::to_string(l) + " of this MoE (Mixtral) model is dense (moe_frequency " + std::to_string(f.moe_frequency) + ", " +
             FamilyLabel(f) + "), and Hugging Face's MixtralForCausalLM makes every layer MoE";
  return "";
}

const char* HfArchitecture(const ModelFormat& f) {
  return f.moe() ? "MixtralForCausalLM" : f.gelu ? "GPT2LMHeadModel" : "LlamaForCausalLM";
}

AttentionTensors AttentionTensorsOf(const ModelFormat& f) {
  if (f.family != ModelFamily::kHfLlama) return f.kv_heads == f.heads ? AttentionTensors::kFused : AttentionTensors::kQueryAndKeyValue;
  const HfAttention a = AttentionOf(f);
  return a == HfAttention::kQkvFused || a == HfAttention::kStride3 ? AttentionTensors::kFused : AttentionTensors::kSeparate;
}

std::string RotaryBufferName(const ModelFormat& f, int layer) {
  if (f.family == ModelFamily::kHfLlama || f.learned_positions) return "";
  return "language_model.encoder.layers." + std::to_string(layer) + ".self_attention.core_attention.rotary_emb.inv_freq";
}

std::vector<float> RotaryInvFreq(const ModelFormat& f) {
  const int64_t rot = static_cast<int64_t>(static_cast<double>(f.head_dim()) * f.rotary_percentage);
  std::vector<float> out;
  for (int64_t i = 0; i < rot; i += 2)
    out.push_back(1.0f / std::pow(static_cast<float>(f.rope_theta), static_cast<float>(i) / static_cast<float>(rot)));
  return out;
}

std::string BiasOf(const std::string& weight) { return weight.substr(0, weight.size() - std::string("weight").size()) + "bias"; }

const char* FamilyName(ModelFamily f) { return f == ModelFamily::kHfLlama ? "hf_llama" : "megatron"; }

std::optional<ModelFamily> ParseFamily(const std::string& s) {
  if (s == "megatron") return ModelFamily::kMegatron;
  if (s == "hf_llama") return ModelFamily::kHfLlama;
  return std::nullopt;
}

const char* BackendName(HwBackend b) { return b == HwBackend::kTrn1 ? "trn1" : b == HwBackend::kTrn2 ? "trn2" : "unknown"; }

std::optional<HwBackend> ParseBackend(const std::string& s) {
  if (s == "trn1") return HwBackend::kTrn1;
  if (s == "trn2") return HwBackend::kTrn2;
  return std::nullopt;
}

std::optional<ModelFamily> FamilyOfName(const std::string& name) {
  if (name.starts_with("language_model.")) return ModelFamily::kMegatron;
  if (name.starts_with("model.") || name.starts_with("lm_head.")) return ModelFamily::kHfLlama;
  return std::nullopt;
}

ModelFamily FamilyOfNames(const std::vector<std::string>& names, const std::string& where) {
  const std::string* megatron = nullptr;
  const std::string* hf = nullptr;
  for (const std::string& n : names) {
    const auto family = FamilyOfName(n);
    if (family == ModelFamily::kMegatron) megatron = megatron ? megatron : &n;
    else if (family == ModelFamily::kHfLlama) hf = hf ? hf : &n;
  }
  if (megatron && hf)
    throw Error(where + ": mixes model families: '" + *megatron + "' is Megatron-style and '" + *hf + "' HF-style");
  if (!megatron && !hf)
    throw Error(where + ": holds no parameter of a known model family (Megatron-style language_model.*, HF-style model.* and lm_head.*)");
  return hf ? ModelFamily::kHfLlama : ModelFamily::kMegatron;
}

// The router (fp32, RouterTopK's dtype default) is replicated on every rank,
// so a reader compares its copies as it does a norm's (by its spec); not a
// norm (weight decay applies). The experts 3-D.
void AppendMoeParameters(const ModelFormat& f, int layer, std::vector<ParamRule>& p) {
  const int64_t E = f.experts, H = f.hidden, F = f.ffn;
  ParamRule router{ParamName(f, Module::kRouter, layer), {E, H}, SplitDim::kReplicated};
  router.spec = TensorParallelSpec(router.shape, SplitDim::kReplicated, FusedRows::kPlain, f);
  ParamRule in{ParamName(f, Module::kExpertsIn, layer), {E, H, 2 * F}, SplitDim::kExperts, FusedRows::kGateUp};
  in.spec = ExpertSpec(in.shape, ExpertWeight::kGateUp);
  ParamRule out{ParamName(f, Module::kExpertsOut, layer), {E, F, H}, SplitDim::kExperts};
  out.spec = ExpertSpec(out.shape, ExpertWeight::kDown);
  for (ParamRule* r : {&router, &in, &out}) r->layer = layer, r->place = StagePlace::kLayer, p.push_back(std::move(*r));
}

std::vector<ParamRule> HfLlamaParameters(const ModelFormat& f, int tp) {
  const int64_t H = f.hidden, F = f.ffn, hd = f.head_dim(), Q = f.heads * hd, K = f.kv_heads * hd, V = f.PaddedVocab(tp);
  std::vector<ParamRule> p;
  int layer = -1;
  StagePlace place = StagePlace::kFirst;
  auto add = [&](std::string name, std::vector<int64_t> shape, SplitDim split, FusedRows fused = FusedRows::kPlain) {
    ParamRule r{std::move(name), std::move(shape), split, fused};
    r.spec = TensorParallelSpec(r.shape, split, fused, f);
    r.layer = layer, r.place = place;
    p.push_back(std::move(r));
  };
  add("model.embed_tokens.weight", {V, H}, SplitDim::kRows);
  p.back().vocab = true;
  place = StagePlace::kLayer;
  for (layer = 0; layer < f.layers; ++layer) {
    switch (AttentionOf(f)) {
      case HfAttention::kQkvFused: add(HfLayer(layer, "self_attn.qkv_proj.weight_qkv"), {Q + 2 * K, H}, SplitDim::kRows, FusedRows::kQkvHeads); break;
      case HfAttention::kStride3: add(HfLayer(layer, "self_attn.qkv_proj.weight"), {Q + 2 * K, H}, SplitDim::kRows, FusedRows::kQkvHeads); break;
      case HfAttention::kQkvSplit:
        add(HfLayer(layer, "self_attn.qkv_proj.weight_q"), {Q, H}, SplitDim::kRows, FusedRows::kQueryHeads);
        add(HfLayer(layer, "self_attn.qkv_proj.weight_k"), {K, H}, SplitDim::kRows, FusedRows::kKvHeads);
        add(HfLayer(layer, "self_attn.qkv_proj.weight_v"), {K, H}, SplitDim::kRows, FusedRows::kKvHeads);
        break;
      case HfAttention::kPlain:
        add(HfLayer(layer, "self_attn.q_proj.weight"), {Q, H}, SplitDim::kRows, FusedRows::kQueryHeads);
        add(HfLayer(layer, "self_attn.k_proj.weight"), {K, H}, SplitDim::kRows, FusedRows::kKvHeads);
        add(HfLayer(layer, "self_attn.v_proj.weight"), {K, H}, SplitDim::kRows, FusedRows::kKvHeads);
        break;
    }
    add(HfLayer(layer, "self_attn.o_proj.weight"), {H, Q}, SplitDim::kColumns, FusedRows::kQueryHeads);
    if (IsMoeLayer(f, layer)) {
      AppendMoeParameters(f, layer, p);
    } else {
      add(HfLayer(layer, "mlp.gate_up_proj.weight"), {2 * F, H}, SplitDim::kRows, FusedRows::kGateUp);
      add(HfLayer(layer, "mlp.down_proj.weight"), {H, F}, SplitDim::kColumns);
    }
    add(HfLayer(layer, "input_layernorm.weight"), {H}, SplitDim::kReplicated);
    p.back().norm = true;
    add(HfLayer(layer, "post_attention_layernorm.weight"), {H}, SplitDim::kReplicated);
    p.back().norm = true;
  }
  layer = -1, place = StagePlace::kLast;
  add("model.norm.weight", {H}, SplitDim::kReplicated);
  p.back().norm = true;
  if (!f.tied_output) {
    add("lm_head.weight", {V, H}, SplitDim::kRows);
    p.back().vocab = true;
  }
  return p;
}

std::string KvReplicationProblem(const ModelFormat& f, int tp) {
  const int64_t m = f.kv_size_multiplier, kv = f.kv_heads;
  if (m < 1 || m > kMaxRanks) return "kv_size_multiplier " + std::to_string(m) + " is out of range";
  if (f.family != ModelFamily::kHfLlama) return m == 1 ? "" : "kv_size_multiplier applies to the HF-style family only";
  if ((kv * m) % tp)
    return "the " + std::to_string(kv) + " KV heads times kv_size_multiplier " + std::to_string(m) + " is not a multiple of tp " +
           std::to_string(tp) + ": NxD splits the replicated KV heads evenly over tp ranks (kv_size_multiplier " +
           (tp % kv == 0 ? std::to_string(tp / kv) + " fits" : "cannot fit") + ")";
  if (m > 1 && !f.qkv_linear)
    return "kv_size_multiplier " + std::to_string(m) + " needs model.qkv_linear: NxD replicates KV heads only in GQAQKVColumnParallelLinear";
  if (m > 1 && kv * m != tp)
    return "kv_size_multiplier " + std::to_string(m) + " leaves " + std::to_string(kv * m / tp) + " KV heads on each of the " +
           std::to_string(tp) + " tp ranks" + ": NxD lays replicated KV heads out consistently only with one per rank "
           "(checkpoint_converter.py's query reordering and qkv_linear.py's Trn2 init assume it); use kv_size_multiplier " +
           std::to_string(tp / kv);
  if (AttentionOf(f) == HfAttention::kStride3 && f.kv_heads != f.heads) return "the stride-3 qkv_proj.weight needs as many KV heads as heads";
  return "";
}

std::string MegatronKvReplicationNote(const ModelFormat& f, int tp) {
  if (f.family != ModelFamily::kMegatron || f.kv_heads == f.heads || f.kv_heads >= tp) return "";
  return std::to_string(f.kv_heads) + " KV heads over tp " + std::to_string(tp) +
         " are replicated by shardkit's rule: NNM's and NxDT's megatron models require tp to divide the KV heads, so this tag loads "
         "in shardkit only (reshard it to a tp that divides them for NxDT)";
}

bool BackendMatters(const ModelFormat& f, int tp) { return f.kv_size_multiplier > 1 && f.kv_size_multiplier < tp; }

std::vector<int64_t> KvHeadsOfRank(const ModelFormat& f, int tp, int rank) {
  return KvHeadsOf(KvReplicationOf(f), tp, rank);
}

std::vector<int64_t> QueryHeadsOfRank(const ModelFormat& f, int tp, int rank) {
  return QueryHeadsOf(KvReplicationOf(f), f.heads, tp, rank);
}

ModelFormat LayoutFree(const ModelFormat& f) {
  ModelFormat m = f;
  m.family = ModelFamily::kMegatron, m.fuse_qkv = true, m.qkv_linear = false, m.kv_size_multiplier = 1;
  m.hw_backend = HwBackend::kUnknown, m.make_vocab_size_divisible_by = 1;
  return m;
}

bool SameLogicalNames(const ModelFormat& a, const ModelFormat& b) {
  if (a.family != b.family) return false;
  return a.family != ModelFamily::kHfLlama || (a.fuse_qkv == b.fuse_qkv && a.qkv_linear == b.qkv_linear);
}

std::optional<std::string> HfAttentionOfNames(const std::vector<std::string>& names, ModelFormat& f) {
  // LlamaAttention.__init__'s tensors: qkv_linear (weight_qkv, or weight_q/_k/_v), the stride-3 weight, or q/k/v_proj.
  auto has = [&](const char* suffix) { return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.ends_with(suffix); }); };
  if (has(".self_attn.qkv_proj.weight_qkv")) f.qkv_linear = true, f.fuse_qkv = true;
  else if (has(".self_attn.qkv_proj.weight_k")) f.qkv_linear = true, f.fuse_qkv = false;
  else if (has(".self_attn.qkv_proj.weight")) f.qkv_linear = false, f.fuse_qkv = true;
  else if (has(".self_attn.k_proj.weight")) f.qkv_linear = false, f.fuse_qkv = false;
  else return std::nullopt;
  const std::string leaf = ParamName(f, f.fuse_qkv ? Module::kQkv : Module::kKey, 0);
  return leaf.substr(leaf.find(".self_attn.") + 1);
}

std::map<std::string, std::vector<RowsFrom>> LogicalRowsIn(const ModelFormat& from, const ModelFormat& to) {
  if (from.moe() || to.moe()) throw Error("re-laying MoE (Mixtral) tensors under another family's names is not supported");
  if (from.gelu || to.gelu) throw Error("re-laying GPT-style tensors under other names is not supported (their HF tensors are transposed)");
  if (!(LayoutFree(from) == LayoutFree(to))) throw Error("the two layouts are of different models: " + from.Describe() + " and " + to.Describe());
  std::map<std::string, const HfTensorSpec*> hf_from;
  const auto specs_from = HfTensorsFor(from, DType::kFloat32), specs_to = HfTensorsFor(to, DType::kFloat32);
  for (const auto& s : specs_from) hf_from[s.name] = &s;
  std::map<std::string, std::vector<RowsFrom>> out;
  for (const auto& s : specs_to) {
    const HfTensorSpec* src = hf_from.at(s.name);
    int64_t hf_row = 0;
    for (const HfRowBlock& b : s.blocks) {
      // HF rows [hf_row, hf_row + b.rows) of the tensor, through its blocks in `from`.
      int64_t at = 0;
      for (const HfRowBlock& f : src->blocks) {
        const int64_t lo = std::max(at, hf_row), hi = std::min(at + f.rows, hf_row + b.rows);
        if (lo < hi) out[b.name].push_back({b.row + (lo - hf_row), {f.name, f.row + (lo - at), hi - lo}});
        at += f.rows;
      }
      hf_row += b.rows;
    }
  }
  for (auto& [name, pieces] : out) std::sort(pieces.begin(), pieces.end(), [](const RowsFrom& x, const RowsFrom& y) { return x.row < y.row; });
  return out;
}

KvReplicationSeen InferKvReplication(int tp, const std::function<bool(int, int)>& same) {
  std::vector<std::vector<int>> groups;
  std::vector<int> group_of(tp, -1);
  for (int r = 0; r < tp; ++r) {
    for (size_t g = 0; g < groups.size() && group_of[r] < 0; ++g)
      if (same(groups[g][0], r)) group_of[r] = static_cast<int>(g), groups[g].push_back(r);
    if (group_of[r] < 0) group_of[r] = static_cast<int>(groups.size()), groups.push_back({r});
  }
  KvReplicationSeen seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    seen.groups += g ? ", [" : "[";
    for (size_t i = 0; i < groups[g].size(); ++i) seen.groups += (i ? ", " : "") + std::to_string(groups[g][i]);
    seen.groups += "]";
  }
  seen.groups = "[" + seen.groups + "]";
  const int m = static_cast<int>(groups[0].size());
  bool trn1 = tp % m == 0, trn2 = tp % m == 0;
  for (int r = 0; r < tp; ++r) {
    if (static_cast<int>(groups[group_of[r]].size()) != m) trn1 = trn2 = false;
    if (trn1 && group_of[r] != group_of[r % (tp / m)]) trn1 = false;
    if (trn2 && group_of[r] != group_of[r / m * m]) trn2 = false;
  }
  if (!trn1 && !trn2)
    throw Error("the tp ranks holding equal KV rows form the groups " + seen.groups +
                ", which fit neither NxD's Trn1 replication (interleaved: ranks r, r + tp/m, ...) nor Trn2's (consecutive ranks)");
  seen.multiplier = m;
  seen.backend = trn1 && trn2 ? HwBackend::kUnknown : trn1 ? HwBackend::kTrn1 : HwBackend::kTrn2;
  return seen;
}

}  // namespace ckpt

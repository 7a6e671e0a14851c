#include "libtrain/train_config.h"

#include "ckpt/util/env.h"

#include "ckpt/pt/value_json.h"

#include "ckpt/spec/model_family.h"

#include <filesystem>

#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "ckpt/util/error.h"
#include "ckpt/spec/tag_paths.h"
#include "libtrain/config_keys.h"
#include "libtrain/pipeline_schedule.h"
#include "libtrain/tokenizer_vocab.h"
#include "migrate/interpolation.h"
#include "migrate/overrides.h"
#include "migrate/yaml_tree.h"

namespace train {
namespace {

using migrate::Find;

// A whole-string number; nullopt for anything else.
std::optional<double> ParseNumber(const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

class Reader {
 public:
  Reader(YAML::Node root, std::string source) : root_(std::move(root)), source_(std::move(source)) {}

  [[noreturn]] void Fail(const std::string& key, const std::string& what) const {
    throw ConfigError(source_ + ": " + key + ": " + what);
  }
  // The value at `key`; only keys config_keys.cc's table says are read, so the
  // table stays the one list of what is taken.
  YAML::Node At(const std::string& key) const {
    const KeyRule* rule = FindKeyRule(key);
    if (!rule || rule->use != KeyUse::kRead) throw std::logic_error("train_config.cc reads " + key + ", which config_keys.cc does not list as read");
    return Find(root_, key);
  }
  bool Has(const std::string& key) const {
    const YAML::Node n = At(key);
    return n.IsDefined() && !n.IsNull();
  }
  int64_t Int(const std::string& key, int64_t dflt, int64_t min = INT64_MIN, int64_t max = INT64_MAX) const {
    if (!Has(key)) return dflt;
    const YAML::Node n = At(key);
    if (!n.IsScalar() || !migrate::IsIntegerText(n.Scalar())) Fail(key, migrate::Describe(n) + " is not an integer");
    int64_t v = 0;
    try {
      v = std::stoll(n.Scalar());
    } catch (const std::out_of_range&) {
      Fail(key, n.Scalar() + " is out of range");
    }
    if (v < min) Fail(key, std::to_string(v) + " must be at least " + std::to_string(min));
    if (v > max) Fail(key, std::to_string(v) + " must be at most " + std::to_string(max));
    return v;
  }
  double Number(const std::string& key, double dflt) const {
    if (!Has(key)) return dflt;
    const YAML::Node n = At(key);
    const std::optional<double> v = n.IsScalar() ? ParseNumber(n.Scalar()) : std::nullopt;
    if (!v) Fail(key, migrate::Describe(n) + " is not a number");
    return *v;
  }
  bool Bool(const std::string& key, bool dflt) const {
    if (!Has(key)) return dflt;
    const std::string s = At(key).Scalar();
    if (s == "True" || s == "true" || s == "TRUE") return true;
    if (s == "False" || s == "false" || s == "FALSE") return false;
    Fail(key, s + " is not a boolean");
  }
  std::string Str(const std::string& key, const std::string& dflt) const {
    if (!Has(key)) return dflt;
    const YAML::Node n = At(key);
    if (!n.IsScalar()) Fail(key, "must be a string");
    if (n.Scalar() == "???") Fail(key, "is ??? (mandatory, must be set)");
    return n.Scalar();
  }

 private:
  YAML::Node root_;
  std::string source_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw ConfigError(path + ": cannot open config");
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

std::string TrainConfig::RunDir() const {
  if (!explicit_log_dir.empty()) return explicit_log_dir;
  return exp_dir + "/" + (exp_name.empty() ? name : exp_name) + "/" + version;
}

TrainConfig LoadTrainConfig(const std::string& path, const std::vector<std::string>& overrides) {
  return ParseTrainConfig(ReadFile(path), path, overrides);
}

namespace {

// The interleaved schedule's virtual stages per pp rank, V (NxDT's
// distributed_strategy.virtual_pipeline_model_parallel_size, passed to NxD's
// NxDPPModel as virtual_pipeline_size by lightning_modules/model/base.py; NNM's
// spelling sits under model). V > 1 needs pp > 1 (config_keys.cc's rule)
// and micro-batches per data-parallel rank in groups of pp (NxD's
// TrainInterleavedSchedule.get_step_schedule, pipeline/scheduler.py).
void ReadVirtualPipeline(const Reader& r, TrainConfig& c) {
  const char* keys[] = {"distributed_strategy.virtual_pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size"};
  for (const char* key : keys) {
    if (!r.Has(key)) continue;
    const int v = static_cast<int>(r.Int(key, 1, 1, ckpt::kMaxRanks));
    if (!c.virtual_pipeline_key.empty() && v != c.virtual_pipeline)
      r.Fail(key, std::to_string(v) + " disagrees with " + c.virtual_pipeline_key + " (" + std::to_string(c.virtual_pipeline) + ")");
    c.virtual_pipeline = v, c.virtual_pipeline_key = key;
  }
  if (c.virtual_pipeline == 1) return;  // (config_keys.cc refused V > 1 at pp 1 already)
  const int64_t per_rank = c.global_batch_size / (c.micro_batch_size * c.grid.dp);
  if (const std::string why = InterleavedMicroBatchProblem(per_rank, c.grid.pp); !why.empty())
    r.Fail("data.global_batch_size", why + " (" + c.virtual_pipeline_key + " is " + std::to_string(c.virtual_pipeline) + ")");
}

// model.moe as NxDT's two Mixtral styles read it. HF-style (lightning_modules/model/hf_models/
// mixtral_model.py _get_model): defaults num_experts 1, frequency 1, capacity_factor 1.0, top_k 1,
// output_router_logits True, router_aux_loss_coef 0.02, normalize_top_k_affinities True.
// Megatron-style (lightning_modules/model/megatron/megatron_gpt_model.py model_provider_func):
// capacity_factor num_experts / top_k, output_router_logits False, router_aux_loss_coef 0.0,
// normalize_top_k_affinities top_k > 1. Both build NxD's RouterTopK and ExpertMLPs alike
// (modeling_mixtral.py initialize_mixtral_moe_layer; models/megatron/transformer.py
// NeuronSwitchMLP, float32, NxD's defaults): the same layer, libtrain/moe_layer.h.
void ReadMoeSettings(const Reader& r, TrainConfig& c, bool megatron) {
  ModelConfig& m = c.model;
  m.experts = r.Int("model.moe.num_experts", 1, 1, 1 << 16);
  m.moe_frequency = r.Int("model.moe.frequency", 1, 1, 1 << 16);
  m.moe_top_k = r.Int("model.moe.top_k", 1, 1, m.experts);
  m.capacity_factor = r.Number("model.moe.capacity_factor", megatron ? static_cast<double>(m.experts) / m.moe_top_k : 1.0);
  m.normalize_top_k_affinities = r.Bool("model.moe.normalize_top_k_affinities", megatron ? m.moe_top_k > 1 : true);
  const bool aux = r.Bool("model.moe.output_router_logits", !megatron);
  m.router_aux_loss_coef = aux ? r.Number("model.moe.router_aux_loss_coef", megatron ? 0.0 : 0.02) : 0.0;
  if (!aux && r.Has("model.moe.router_aux_loss_coef"))
    c.ignored.push_back("model.moe.router_aux_loss_coef (no auxiliary loss: output_router_logits is False)");
  if (!(m.router_aux_loss_coef >= 0) || !std::isfinite(m.router_aux_loss_coef))
    r.Fail("model.moe.router_aux_loss_coef", "must be a number >= 0");
  if (m.normalize_top_k_affinities && m.moe_top_k == 1)
    r.Fail("model.moe.normalize_top_k_affinities", "needs top_k > 1 (NxD's ExpertMLPs refuses it with top_k 1)");
  const std::string routing = r.Str("model.moe.routing_algorithm", "top_k");
  if (!megatron && routing != "top_k")
    c.ignored.push_back("model.moe.routing_algorithm (NxDT's HF Mixtral builds RouterTopK whatever it says)");
  if (megatron && routing == "sinkhorn")
    r.Fail("model.moe.routing_algorithm", "'sinkhorn': Sinkhorn routing (NxD's RouterSinkhorn); shardkit does not implement it");
  if (megatron && routing != "top_k")
    r.Fail("model.moe.routing_algorithm", "'" + routing + "' is neither top_k nor sinkhorn (NeuronSwitchMLP raises ValueError)");
}

// NxDT's HF Mixtral: model.moe (ReadMoeSettings), whatever config.json says; moe.dropout becomes
// the attention dropout. config.json's sliding_window masks the attention (modeling_mixtral.py CoreAttention).
void ReadHfMixtral(const Reader& r, TrainConfig& c, const nlohmann::json& j, const std::string& cpath) {
  if (!r.Has("model.moe.num_experts") && !r.Has("model.moe.top_k"))
    r.Fail("model.moe", "NxDT's HF Mixtral (a run named '" + c.name + "') reads its experts from model.moe (num_experts, top_k); set them");
  ReadMoeSettings(r, c, false);
  if (r.Number("model.moe.dropout", 0.0) != 0)
    r.Fail("model.moe.dropout", "becomes the attention dropout of NxDT's HF Mixtral; shardkit does not implement it");
  const nlohmann::json window = j.contains("sliding_window") ? j["sliding_window"] : nlohmann::json(4096);  // MixtralConfig's default
  if (!window.is_null() && (!window.is_number_integer() || window.get<int64_t>() < c.seq_length))
    r.Fail("model.model_config", cpath + ": sliding_window " + window.dump() + " masks attention within data.seq_length (" +
                                     std::to_string(c.seq_length) + "); shardkit does not implement it");
}

// NxDT's Megatron-style model: ParallelTransformerLayer (models/megatron/transformer.py) builds
// NeuronSwitchMLP in place of ParallelMLP when num_experts > 1 and its 1-based layer_number %
// frequency == 0 (ckpt::IsMoeLayer); one expert is a dense model. NeuronSwitchMLP takes
// moe_dropout and uses it nowhere.
void ReadMegatronMoe(const Reader& r, TrainConfig& c) {
  if (r.Int("model.moe.num_experts", 1, 1, 1 << 16) == 1) {
    for (const char* k : {"model.moe.top_k", "model.moe.frequency", "model.moe.capacity_factor", "model.moe.router_aux_loss_coef"})
      if (r.Has(k)) c.ignored.push_back(std::string(k) + " (model.moe.num_experts is 1: NxDT's Megatron-style model is dense)");
    return;
  }
  ReadMoeSettings(r, c, true);
  if (r.Number("model.moe.dropout", 0.0) != 0)
    c.ignored.push_back("model.moe.dropout (NxDT's NeuronSwitchMLP takes it and does not use it)");
}

TrainConfig Parse(const std::string& text, const std::string& path, const std::vector<std::string>& overrides) {
  YAML::Node raw = migrate::LoadYaml(text, path);
  std::vector<migrate::Override> ovs;
  for (const auto& o : overrides) ovs.push_back(migrate::ParseOverride(o));
  migrate::ApplyOverrides(raw, ovs);
  YAML::Node resolved;
  try {
    resolved = migrate::ResolveInterpolations(raw);
  } catch (const migrate::InputError& e) {
    throw migrate::InputError(path + ": " + e.what());
  }
  TrainConfig c;
  // Every key against the table, before any is read: all that shardkit does not implement, named at once.
  const KeyCheck keys = CheckConfigKeys(resolved);
  if (!keys.refused.empty()) {
    std::string what;
    for (const auto& k : keys.refused) what += (what.empty() ? "" : "\n") + path + ": " + k;
    throw ConfigError(what);
  }
  c.ignored = keys.ignored;
  const Reader r(resolved, path);
  c.source = path;
  c.name = r.Str("name", c.name);
  c.seed = static_cast<uint64_t>(r.Int("seed", 1234, 0));

  c.max_steps = r.Int("trainer.max_steps", 1, 1, int64_t{1} << 40);
  c.log_every_n_steps = r.Int("trainer.log_every_n_steps", 1, 1);
  c.gradient_clip_val = r.Number("trainer.gradient_clip_val", 0.0);
  const int64_t world = r.Int("trainer.devices", 1, 1, ckpt::kMaxRanks) * r.Int("trainer.num_nodes", 1, 1, ckpt::kMaxRanks);

  c.explicit_log_dir = r.Str("exp_manager.explicit_log_dir", "");
  c.exp_dir = r.Str("exp_manager.exp_dir", c.exp_dir);
  c.exp_name = r.Str("exp_manager.name", "");
  c.version = r.Str("exp_manager.version", c.version);
  c.resume_if_exists = r.Bool("exp_manager.resume_if_exists", false);
  c.resume_ignore_no_checkpoint = r.Bool("exp_manager.resume_ignore_no_checkpoint", false);
  c.resume_from_checkpoint = r.Str("exp_manager.resume_from_checkpoint", "");
  // shardkit's own: start from scratch when every complete checkpoint is damaged (they are kept).
  c.resume_past_damaged_checkpoints = r.Bool("exp_manager.resume_past_damaged_checkpoints", false);
  c.resume_reshard = r.Bool("exp_manager.resume_reshard", false);
  c.create_checkpoint_callback = r.Bool("exp_manager.create_checkpoint_callback", true);
  c.async_checkpointing = r.Bool("exp_manager.async_checkpointing", false);
  c.save_xser = r.Bool("exp_manager.save_xser", false);
  c.weight_init_only = r.Bool("model.weight_init_only", false);
  r.Bool("exp_manager.load_xser", false);  // checked, then read as NxD reads tags: each as it is
  c.save_top_k = r.Int("exp_manager.checkpoint_callback_params.save_top_k", -1, -1);
  c.every_n_train_steps = r.Int("exp_manager.checkpoint_callback_params.every_n_train_steps", 0, 0);
  c.log_parameter_norm = r.Bool("exp_manager.log_parameter_norm", true);
  c.log_gradient_norm = r.Bool("exp_manager.log_gradient_norm", true);

  const int64_t tp = r.Int("distributed_strategy.tensor_model_parallel_size", 1, 1, ckpt::kMaxRanks);
  const int64_t pp = r.Int("distributed_strategy.pipeline_model_parallel_size", 1, 1, ckpt::kMaxRanks);
  // NxDT's default; it decides the optimizer files' layout even with one data-parallel rank.
  c.optim.zero1 = r.Bool("distributed_strategy.zero1", true);
  c.grid = ckpt::RankGrid::ForWorld(world, tp, pp, c.optim.zero1, path + ": distributed_strategy", "trainer.devices * trainer.num_nodes");
  // Expert parallelism lies inside dp (ckpt::RankGrid::ep).
  const int64_t ep = r.Int("distributed_strategy.expert_model_parallel_size", 1, 1, ckpt::kMaxRanks);
  if (c.grid.dp % ep)
    r.Fail("distributed_strategy.expert_model_parallel_size", std::to_string(ep) + " does not divide the data-parallel size " +
                                                                  std::to_string(c.grid.dp) + " (NxD lays expert parallelism inside data parallelism)");
  c.grid.ep = static_cast<int>(ep);
  // At ep > 1 a tag holds NxD's NeuronEPZero1Optimizer state (ckpt/spec/ep_zero1_state.h), which is ZeRO-1's.
  if (ep > 1 && !c.optim.zero1 && c.create_checkpoint_callback)
    r.Fail("distributed_strategy.zero1", "checkpoints at distributed_strategy.expert_model_parallel_size > 1 need ZeRO-1 (NxD's "
                                         "NeuronEPZero1Optimizer); without it NxD's save loses the optimizer state; set it True or "
                                         "exp_manager.create_checkpoint_callback False");
  c.micro_batch_size = r.Int("data.micro_batch_size", 1, 1, 1 << 24);
  c.global_batch_size = r.Int("data.global_batch_size", 1, 1, 1 << 30);
  if (c.global_batch_size % (c.micro_batch_size * c.grid.dp))
    r.Fail("data.global_batch_size", std::to_string(c.global_batch_size) + " is not a multiple of data.micro_batch_size (" +
                                         std::to_string(c.micro_batch_size) + ") * data-parallel size (" + std::to_string(c.grid.dp) + ")");
  ReadVirtualPipeline(r, c);
  c.seq_length = r.Int("data.seq_length", r.Int("model.encoder_seq_length", 128, 1, 1 << 24), 1, 1 << 24);
  c.data_impl = r.Str("data.data_impl", "mmap");
  if (c.data_impl != "mmap" && c.data_impl != "hdf5")
    r.Fail("data.data_impl", "'" + c.data_impl + "' is not supported (mmap: Megatron indexed datasets; hdf5: one token dataset per file)");
  const YAML::Node prefix = r.At("data.data_prefix");
  if (!prefix.IsDefined() || prefix.IsNull() || (prefix.IsScalar() && prefix.Scalar() == "???"))
    r.Fail("data.data_prefix", "must name the training data ([weight, prefix, ...] or a prefix)");
  if (prefix.IsScalar()) {
    c.data_prefix.push_back({1.0, prefix.Scalar()});
  } else if (prefix.IsSequence()) {
    if (prefix.size() % 2) r.Fail("data.data_prefix", "must alternate weights and prefixes");
    for (size_t i = 0; i < prefix.size(); i += 2) {
      const std::string at = "data.data_prefix[" + std::to_string(i) + "]";
      if (!prefix[i].IsScalar() || !prefix[i + 1].IsScalar()) r.Fail(at, "must alternate weights and prefixes (plain values)");
      const double w = ParseNumber(prefix[i].Scalar()).value_or(NAN);
      if (!(w >= 0) || !std::isfinite(w)) r.Fail(at, "weight '" + prefix[i].Scalar() + "' is not a number >= 0");
      c.data_prefix.push_back({w, prefix[i + 1].Scalar()});
    }
  } else {
    r.Fail("data.data_prefix", "a mapping of splits is not supported yet; give [weight, prefix, ...]");
  }

  ModelConfig& m = c.model;
  // model_source: hf (NxDT examples/training.py builds HFLLamaModule): the model is
  // model.model_config's HF config.json, with what NxDT's llama_model.py _get_model
  // lets the YAML override (num_layers, hidden_size, rope_theta, max_position_embeddings).
  const std::string source = r.Str("model_source", "megatron");
  if (source != "megatron" && source != "hf") r.Fail("model_source", "'" + source + "' is not megatron or hf");
  std::optional<ckpt::ModelFormat> hf;
  if (source == "hf") {
    const std::string given = r.Str("model.model_config", "");
    nlohmann::json config_json;
    if (given.empty()) r.Fail("model.model_config", "model_source: hf needs the model's HF config.json");
    // As given (NxDT opens it from the working folder), else beside this config file.
    std::string cpath = given;
    auto* env = ckpt::Env::Default();
    if (!env->Exists(cpath) && !std::filesystem::path(given).is_absolute())
      cpath = (std::filesystem::path(path).parent_path() / given).string();
    if (!env->Exists(cpath)) r.Fail("model.model_config", "'" + given + "' does not exist (looked in the working folder and beside " + path + ")");
    try {
      const auto mapped = env->MapFile(cpath);
      const nlohmann::json j = ckpt::ParseJsonBounded(reinterpret_cast<const char*>(mapped->data()),
                                                      reinterpret_cast<const char*>(mapped->data()) + mapped->size(), cpath);
      if (j.is_discarded() || !j.is_object()) throw ckpt::Error(cpath + ": is not a JSON object");
      // NxDT's examples/training.py builds HFMixtralModule when the run's name holds "mixtral", whose
      // MixtralConfig.from_pretrained takes a Mixtral's or a Llama's config.json (the same fields).
      const bool mixtral_json = j.value("architectures", nlohmann::json::array()).dump().find("Mixtral") != std::string::npos ||
                                j.value("model_type", std::string()) == "mixtral";
      hf = mixtral_json ? ckpt::FormatOfHfMixtralConfig(j, cpath) : ckpt::FormatOfHfConfig(j, cpath);
      config_json = j;
    } catch (const ckpt::Error& e) {
      r.Fail("model.model_config", e.what());
    }
    if (c.name.find("mixtral") != std::string::npos) {
      ReadHfMixtral(r, c, config_json, cpath);
    } else if (hf->moe()) {
      r.Fail("model.model_config", cpath + " is a Mixtral, but name '" + c.name + "' does not hold 'mixtral': NxDT's training.py "
                                   "builds its dense HFLLamaModule then; shardkit does not implement it");
    } else if (r.Has("model.moe.num_experts") || r.Has("model.moe.top_k")) {
      c.ignored.push_back("model.moe (NxDT's training.py builds its dense HFLLamaModule for a run whose name does not hold 'mixtral')");
    }
    if (hf->gelu) r.Fail("model.model_config", cpath + " is not a LlamaForCausalLM (NxDT's model_source: hf builds Llama)");
    m.family = ckpt::ModelFamily::kHfLlama;
    m.fuse_qkv = r.Bool("model.fuse_qkv", true), m.qkv_linear = r.Bool("model.qkv_linear", false);
    m.kv_size_multiplier = r.Int("distributed_strategy.kv_replicator", 1, 1, 1 << 16);
    // NxD picks the KV replication rule by the hardware it runs on; here the config says (Trn1's by default).
    const std::string backend = r.Str("shardkit.hw_backend", "trn1");
    if (backend != "trn1" && backend != "trn2") r.Fail("shardkit.hw_backend", "'" + backend + "' is not trn1 or trn2");
    m.hw_backend = *ckpt::ParseBackend(backend);
    for (const char* k : {"model.ffn_hidden_size", "model.num_attention_heads", "model.num_kv_heads", "model.normalization", "model.activation",
                          "model.vocab_size"})
      if (r.Has(k)) r.Fail(k, "model_source: hf takes it from model.model_config (" + cpath + ")");
  }
  if (!hf) ReadMegatronMoe(r, c);
  m.layers = r.Int("model.num_layers", hf ? hf->layers : 2, 1, 1 << 16);
  m.hidden = r.Int("model.hidden_size", hf ? hf->hidden : 64, 1, 1 << 20);
  m.ffn = hf ? hf->ffn : r.Int("model.ffn_hidden_size", m.hidden * 4, 1, 1 << 24);
  m.heads = hf ? hf->heads : r.Int("model.num_attention_heads", 4, 1, 1 << 16);
  m.kv_heads = hf ? hf->kv_heads : r.Int("model.num_kv_heads", m.heads, 1, 1 << 16);
  if (m.hidden % m.heads) r.Fail("model.hidden_size", "must be divisible by num_attention_heads (" + std::to_string(m.heads) + ")");
  if (m.heads % m.kv_heads) r.Fail("model.num_kv_heads", "must divide num_attention_heads (" + std::to_string(m.heads) + ")");
  // Keys one of NxDT's model families reads and the other does not: NxDT's HF models read
  // fuse_qkv, qkv_linear, kv_replicator and model_config (lightning_modules/model/hf_models/
  // llama_model.py), its megatron models kv_channels and sliding_window_size (megatron_gpt_model.py).
  for (const char* k : hf ? std::vector<const char*>{"model.kv_channels", "model.sliding_window_size"}
                          : std::vector<const char*>{"model.fuse_qkv", "model.qkv_linear", "distributed_strategy.kv_replicator",
                                                     "model.model_config"})
    if (r.Has(k)) c.ignored.push_back(std::string(k) + " (NxDT's model_source: " + source + " models do not read it)");
  if (!hf && r.Has("model.kv_channels") && r.Int("model.kv_channels", 0, 1, 1 << 20) != m.hidden / m.heads)
    r.Fail("model.kv_channels", r.Str("model.kv_channels", "") + " is an attention head width other than hidden_size / num_attention_heads (" +
                                    std::to_string(m.hidden / m.heads) + "); shardkit does not implement it");
  // NxDT's megatron attention masks keys `window` or more positions back (models/megatron/
  // transformer.py create_binary_sliding_window_attention_mask): no effect when the window covers the sequence.
  if (!hf && r.Has("model.sliding_window_size")) {
    const int64_t window = r.Int("model.sliding_window_size", 0, 1);
    if (window < c.seq_length)
      r.Fail("model.sliding_window_size", "sliding-window attention over " + std::to_string(window) + " tokens, fewer than data.seq_length (" +
                                              std::to_string(c.seq_length) + "); shardkit does not implement it");
    c.ignored.push_back("model.sliding_window_size (no effect: the window of " + std::to_string(window) + " covers data.seq_length " +
                        std::to_string(c.seq_length) + ")");
  }
  m.eps = static_cast<float>(r.Number("model.layernorm_epsilon", hf ? hf->norm_eps : 1e-5));
  // NxDT's megatron models and NNM call the rotary base position_freq_base (NxDT
  // megatron_gpt_model.py; NNM transformer.py), HF models rope_theta; either is taken.
  m.rope_theta = r.Number("model.rope_theta", r.Number("model.position_freq_base", hf ? hf->rope_theta : 10000.0));
  if (r.Has("model.rope_theta") && r.Has("model.position_freq_base") &&
      r.Number("model.rope_theta", 0) != r.Number("model.position_freq_base", 0))
    r.Fail("model.position_freq_base", "differs from model.rope_theta; they name the same rotary base");
  m.rotary_percentage = r.Number("model.rotary_percentage", 1.0);
  m.init_std = static_cast<float>(r.Number("model.init_method_std", 0.02));
  m.scaled_init = r.Bool("model.use_scaled_init_method", true);
  m.seed = c.seed;
  m.recompute = r.Str("model.activations_checkpoint_granularity", "");
  if (m.recompute != "" && m.recompute != "full" && m.recompute != "selective")
    r.Fail("model.activations_checkpoint_granularity", "'" + m.recompute + "' is not full, selective or null");
  auto choice = [&](const std::string& key, const std::string& dflt, std::initializer_list<const char*> allowed) {
    const std::string v = r.Str(key, dflt);
    std::string list;
    for (const char* a : allowed) {
      if (v == a) return v;
      list += (list.empty() ? "" : ", ") + std::string(a);
    }
    r.Fail(key, "'" + v + "' is not supported (supported: " + list + ")");
  };
  // A key left out means what NxDT's megatron models take for it (megatron_gpt_model.py
  // ModelModule.model_provider_func: layernorm, gelu, learned_absolute, has_bias True, hidden_dropout
  // 0.1); an HF-style model is a Llama.
  m.layernorm = choice("model.normalization", hf ? "rmsnorm" : "layernorm", {"rmsnorm", "layernorm"}) == "layernorm";
  m.gelu = choice("model.activation", hf ? "swiglu" : "gelu", {"swiglu", "gelu"}) == "gelu";
  m.learned_positions =
      choice("model.position_embedding_type", hf ? "rope" : "learned_absolute", {"rope", "learned_absolute"}) == "learned_absolute";
  choice("model.transformer_block_type", "pre_ln", {"pre_ln"});
  m.bias = r.Bool("model.has_bias", !hf);
  // NxDT's megatron models tie unless told not to (megatron_gpt_model.py ModelModule.model_provider_func:
  // share_embeddings_and_output_weights defaults to True); an HF-style model's config.json decides.
  m.tied_output = hf ? hf->tied_output : r.Bool("model.share_embeddings_and_output_weights", true);
  m.max_positions = r.Int("model.max_position_embeddings", hf ? hf->max_positions : c.seq_length, 1, 1 << 24);
  if (m.learned_positions && c.seq_length > m.max_positions)
    r.Fail("model.max_position_embeddings", std::to_string(m.max_positions) + " is shorter than data.seq_length (" +
                                                std::to_string(c.seq_length) + ")");
  for (auto [key, dst] : {std::pair{"model.hidden_dropout", &m.hidden_dropout}, std::pair{"model.attention_dropout", &m.attention_dropout},
                           std::pair{"model.ffn_dropout", &m.ffn_dropout}}) {
    const double v = r.Number(key, !hf && std::string(key) == "model.hidden_dropout" ? 0.1 : 0.0);
    if (!(v >= 0 && v < 1)) r.Fail(key, std::to_string(v) + " is not a probability in [0, 1)");
    *dst = static_cast<float>(v);
  }
  // Vocabulary: model.vocab_size when given, else what the tokenizer holds.
  int64_t vocab = 0;
  if (hf) {
    vocab = hf->vocab_size;
  } else if (r.Has("model.vocab_size")) {
    vocab = r.Int("model.vocab_size", 0, 1, int64_t{1} << 31);
  } else {
    TokenizerSpec t{r.Str("data.tokenizer.library", "byte"), r.Str("data.tokenizer.type", ""),
                    r.Str("data.tokenizer.vocab_file", ""), r.Str("data.tokenizer.model", "")};
    try {
      vocab = TokenizerVocabSize(t);
    } catch (const ckpt::Error& e) {
      r.Fail("data.tokenizer", e.what());
    }
  }
  int64_t divisible = r.Int("model.make_vocab_size_divisible_by", 8, 1, 1 << 20);
  if (hf) {  // NxD's ParallelEmbedding: the config's vocabulary, unpadded
    vocab = hf->vocab_size, divisible = 1;
    if (r.Has("model.make_vocab_size_divisible_by")) c.ignored.push_back("model.make_vocab_size_divisible_by (model_source: hf does not pad)");
  }
  m.vocab_size = vocab;
  m.make_vocab_size_divisible_by = divisible;
  // NxDT's form names the module that ends a stage: NxD's partition() keeps a cut node in its
  // stage and starts the next after it, and create_partitions() names model_layer_names[cut - 1]
  // (neuronx_distributed/pipeline/partition.py). The module is the HF model's model.layers.N or
  // the megatron model's language_model.encoder.layers.N. A number is shardkit's form: the first
  // layer of the next stage.
  const std::string layer_prefix = hf ? "model.layers." : "language_model.encoder.layers.";
  if (r.Has("model.pipeline_cuts")) {
    const YAML::Node cuts = r.At("model.pipeline_cuts");
    if (!cuts.IsSequence()) r.Fail("model.pipeline_cuts", "must be a list of layer numbers or of NxDT's layer names ('" + layer_prefix + "N')");
    for (const auto& v : cuts) {
      const std::string text = v.IsScalar() ? v.Scalar() : "";
      const bool named = text.rfind(layer_prefix, 0) == 0 && migrate::IsIntegerText(text.substr(layer_prefix.size()));
      if (!named && !migrate::IsIntegerText(text))
        r.Fail("model.pipeline_cuts", migrate::Describe(v) + " is neither a layer number nor '" + layer_prefix + "N' (NxDT's form)");
      try {
        c.pipeline_cuts.push_back(named ? std::stoll(text.substr(layer_prefix.size())) + 1 : std::stoll(text));
      } catch (const std::out_of_range&) {
        r.Fail("model.pipeline_cuts", text + " is out of range");
      }
    }
  }
  try {
    c.stage_bounds = ckpt::StageBounds(m.layers, c.grid.pp * c.virtual_pipeline, c.pipeline_cuts);
  } catch (const ckpt::Error& e) {
    const std::string virtual_stages = c.virtual_pipeline > 1 ? " (with virtual_pipeline_model_parallel_size " +
                                                                    std::to_string(c.virtual_pipeline) + ", the pipeline has pp * V stages)"
                                                              : "";
    r.Fail(c.pipeline_cuts.empty() ? (c.virtual_pipeline > 1 ? c.virtual_pipeline_key : "distributed_strategy.pipeline_model_parallel_size")
                                   : "model.pipeline_cuts",
           std::string(e.what()) + virtual_stages + " ('" + layer_prefix + "N', NxDT's form, ends a stage: it counts as N + 1 here)");
  }
  ckpt::ModelFormat unpadded;
  unpadded.vocab_size = vocab, unpadded.make_vocab_size_divisible_by = divisible;
  m.vocab = unpadded.PaddedVocab(c.grid.tp);  // Megatron's padding: a multiple of divisible * tp
  if (const std::string why = m.format(c.grid.tp).CheckTensorParallel(c.grid.tp); !why.empty())
    r.Fail("distributed_strategy.tensor_model_parallel_size", why);
  if (const std::string why = m.format(c.grid.tp).CheckExpertParallel(c.grid.ep); !why.empty())
    r.Fail("distributed_strategy.expert_model_parallel_size", why);

  c.optim.lr = r.Number("model.optim.lr", 3e-4);
  c.optim.weight_decay = r.Number("model.optim.weight_decay", 0.01);
  // NxDT's HF-style models decay their first group by 0.01 whatever the config says
  // (utils/model_utils.py get_param_groups_by_weight_decay hard-codes it).
  if (hf && c.optim.weight_decay != 0.01) {
    c.ignored.push_back("model.optim.weight_decay (model_source: hf decays by 0.01, as NxDT's get_param_groups_by_weight_decay does)");
    c.optim.weight_decay = 0.01;
  }
  c.optim.eps = r.Number("model.optim.eps", 1e-8);
  c.optim.do_layer_norm_weight_decay = r.Bool("model.do_layer_norm_weight_decay", false);
  const YAML::Node betas = r.At("model.optim.betas");
  if (betas.IsDefined() && (!betas.IsSequence() || betas.size() != 2)) r.Fail("model.optim.betas", "must be a list of two numbers");
  if (betas.IsDefined()) {
    const double b[2] = {betas[0].IsScalar() ? ParseNumber(betas[0].Scalar()).value_or(NAN) : NAN,
                         betas[1].IsScalar() ? ParseNumber(betas[1].Scalar()).value_or(NAN) : NAN};
    for (double x : b)
      if (!(x >= 0 && x < 1)) r.Fail("model.optim.betas", "must be two numbers in [0, 1)");
    c.optim.beta1 = b[0], c.optim.beta2 = b[1];
  }
  r.Str("model.optim.name", "adamw");  // config_keys.cc admits adamw only
  c.sched.name = r.Str("model.optim.sched.name", "CosineAnnealing");
  c.sched.warmup_steps = r.Int("model.optim.sched.warmup_steps", 0, 0, int64_t{1} << 40);
  c.sched.constant_steps = r.Int("model.optim.sched.constant_steps", 0, 0, int64_t{1} << 40);
  c.sched.max_steps = r.Int("model.optim.sched.max_steps", c.max_steps, 1, int64_t{1} << 40);
  c.sched.min_lr = r.Number("model.optim.sched.min_lr", 0.0);
  // Values that train nothing sensible: refused by name, before any work.
  auto require = [&](const char* key, double v, bool ok, const char* rule) {
    if (!ok || !std::isfinite(v)) r.Fail(key, std::to_string(v) + " " + rule);
  };
  require("model.optim.lr", c.optim.lr, c.optim.lr > 0, "must be a positive number");
  require("model.optim.weight_decay", c.optim.weight_decay, c.optim.weight_decay >= 0, "must not be negative");
  require("model.optim.eps", c.optim.eps, c.optim.eps > 0, "must be a positive number");
  require("model.optim.sched.min_lr", c.sched.min_lr, c.sched.min_lr >= 0 && c.sched.min_lr <= c.optim.lr,
          "must be from 0 to model.optim.lr");
  require("trainer.gradient_clip_val", c.gradient_clip_val, c.gradient_clip_val >= 0, "must not be negative");
  require("model.layernorm_epsilon", m.eps, m.eps > 0, "must be a positive number");
  require("model.rope_theta", m.rope_theta, m.rope_theta > 0, "must be a positive number");
  require("model.rotary_percentage", m.rotary_percentage, m.rotary_percentage > 0 && m.rotary_percentage <= 1, "must be in (0, 1]");
  require("model.init_method_std", m.init_std, m.init_std > 0, "must be a positive number");
  if (c.sched.name != "CosineAnnealing" && c.sched.name != "LinearAnnealingWithWarmUp")
    r.Fail("model.optim.sched.name", "'" + c.sched.name + "' is not supported (CosineAnnealing, LinearAnnealingWithWarmUp)");
  if (c.sched.name == "CosineAnnealing" && c.sched.min_lr > c.optim.lr)
    r.Fail("model.optim.sched.min_lr", "is above model.optim.lr");

  c.precision = r.Str("precision.type", "fp32");
  if (c.precision == "mixed_precision") {
    if (!c.optim.zero1)
      r.Fail("precision.type", "mixed_precision keeps float32 master weights only with distributed_strategy.zero1: True "
                               "(as NxDT does); set zero1 or use fp32");
    m.bf16_params = c.optim.master_weights = true;
    c.optim.master_weights_in_ckpt = r.Bool("exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt", false);
  }  // else fp32: config_keys.cc admits these two only
  // Splits along the sequence what tensor parallelism replicates (norms, dropout, the residual stream).
  c.sequence_parallel = r.Bool("distributed_strategy.sequence_parallel", false);
  if (c.sequence_parallel && tp == 1)
    c.ignored.push_back("distributed_strategy.sequence_parallel (no effect with tensor_model_parallel_size 1)");
  if (c.sequence_parallel && c.seq_length % tp)
    r.Fail("distributed_strategy.sequence_parallel", "splits data.seq_length (" + std::to_string(c.seq_length) +
                                                         ") over tensor_model_parallel_size (" + std::to_string(tp) +
                                                         "): it must divide evenly");
  // Megatron scales Q.K^T by 1/layer and the softmax input back up: a guard for fp16 softmax.
  if (r.Bool("model.apply_query_key_layer_scaling", false))
    c.ignored.push_back("model.apply_query_key_layer_scaling (no effect: softmax runs in float32 here)");
  return c;
}

}  // namespace

TrainConfig ParseTrainConfig(const std::string& text, const std::string& path, const std::vector<std::string>& overrides) {
  try {
    return Parse(text, path, overrides);
  } catch (const ConfigError&) {
    throw;
  } catch (const ckpt::Error& e) {  // a library's check of a config value (RankGrid::ForWorld, ...): still the config's error
    throw ConfigError(e.what());
  }
}

}  // namespace train

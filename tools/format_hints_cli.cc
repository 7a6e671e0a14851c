#include "tools/format_hints_cli.h"

#include <filesystem>

#include "ckpt/util/error.h"
#include "migrate/interpolation.h"
#include "migrate/yaml_tree.h"
#include "tools/hf_state.h"

namespace tools {
namespace {

// What an NxDT job config says of the model a tag holds (model_source: hf
// reads model.model_config, NxDT's llama_model.py _get_model; megatron keys
// are the model's own), as hints.
ckpt::FormatHints HintsOfJobConfig(const std::string& path, std::string& model_config) {
  ckpt::Env* env = ckpt::Env::Default();
  if (!env->Exists(path)) throw ckpt::Error(path + ": no such file (--config)");
  const auto m = env->MapFile(path);
  YAML::Node root;
  try {
    root = migrate::ResolveInterpolations(migrate::LoadYaml(std::string(reinterpret_cast<const char*>(m->data()), m->size()), path));
  } catch (const std::exception& e) {
    throw ckpt::Error(path + ": " + e.what());
  }
  auto scalar = [&](const char* key) -> std::optional<std::string> {
    const YAML::Node n = migrate::Find(root, key);
    if (!n.IsDefined() || !n.IsScalar() || n.Scalar() == "null") return std::nullopt;
    return n.Scalar();
  };
  auto integer = [&](const char* key) -> std::optional<int64_t> {
    const auto v = scalar(key);
    if (!v) return std::nullopt;
    try {
      size_t used = 0;
      const int64_t x = std::stoll(*v, &used);
      if (used == v->size() && x > 0) return x;
    } catch (const std::exception&) {
    }
    throw ckpt::Error(path + ": " + key + " is '" + *v + "', not a positive whole number");
  };
  auto boolean = [&](const char* key) -> std::optional<bool> {
    const auto v = scalar(key);
    if (!v) return std::nullopt;
    if (*v == "True" || *v == "true") return true;
    if (*v == "False" || *v == "false") return false;
    throw ckpt::Error(path + ": " + key + " is '" + *v + "', not True or False");
  };
  ckpt::FormatHints h;
  if (scalar("model_source").value_or("megatron") == "hf") {
    const auto given = scalar("model.model_config");
    if (!given) throw ckpt::Error(path + ": model_source hf without model.model_config");
    std::string cpath = *given;
    if (!env->Exists(cpath) && !std::filesystem::path(cpath).is_absolute())
      cpath = (std::filesystem::path(path).parent_path() / *given).string();
    if (!env->Exists(cpath)) throw ckpt::Error(path + ": model.model_config '" + *given + "' does not exist (here or beside the config)");
    model_config = cpath;
    h.kv_size_multiplier = integer("distributed_strategy.kv_replicator").value_or(1);
    h.fuse_qkv = boolean("model.fuse_qkv").value_or(true), h.qkv_linear = boolean("model.qkv_linear").value_or(false);
    h.layers = integer("model.num_layers"), h.hidden = integer("model.hidden_size");
  } else {
    h.heads = integer("model.num_attention_heads"), h.kv_heads = integer("model.num_kv_heads");
    h.make_vocab_size_divisible_by = integer("model.make_vocab_size_divisible_by");
  }
  return h;
}

}  // namespace

ckpt::FormatHints FormatHintOptions::Hints() const {
  ckpt::FormatHints h;
  std::string hf_config = model_config, from_job;
  if (!config.empty()) {
    h = HintsOfJobConfig(config, from_job);
    if (hf_config.empty()) hf_config = from_job;
  }
  if (!hf_config.empty()) {
    const ckpt::ModelFormat f = FormatOfHfConfig(ReadJson(ckpt::Env::Default(), hf_config), hf_config);
    h.heads = f.heads, h.kv_heads = f.kv_heads, h.vocab_size = f.vocab_size, h.rope_theta = f.rope_theta, h.norm_eps = f.norm_eps;
    h.ffn = f.ffn, h.max_positions = f.max_positions;
    // NxDT's YAML overrides config.json's layers and hidden size (llama_model.py _get_model).
    if (!h.layers) h.layers = f.layers;
    if (!h.hidden) h.hidden = f.hidden;
  }
  // A flag agrees with what the configs say, or is refused.
  const std::string said = !hf_config.empty() ? hf_config : config;
  auto take = [&]<typename T>(std::optional<T>& into, T flag, const char* name) {
    if (!flag) return;
    if (into && *into != flag)
      throw ckpt::Error(std::string(name) + " " + std::to_string(flag) + " contradicts " + said + " (" + std::to_string(*into) + ")");
    into = flag;
  };
  take(h.heads, heads, "--heads"), take(h.kv_heads, kv_heads, "--kv_heads"), take(h.vocab_size, vocab, "--vocab_size");
  take(h.make_vocab_size_divisible_by, divisible, "--make_vocab_size_divisible_by");
  take(h.kv_size_multiplier, kv_size_multiplier, "--kv_size_multiplier");
  take(h.rope_theta, rope_theta, "--rope_theta"), take(h.norm_eps, norm_eps, "--layernorm_epsilon");
  take(h.rotary_percentage, rotary, "--rotary_percentage");
  take(h.moe_top_k, moe_top_k, "--moe_top_k");
  if (!hw_backend.empty()) h.hw_backend = ckpt::ParseBackend(hw_backend);
  return h;
}

}  // namespace tools

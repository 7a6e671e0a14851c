#include "ckpt/spec/lora.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

// The HF-style Llama's linear layers shardkit lays adapters out for (NxDT
// hf_llama3_8B_SFT_lora_config.yaml: "eligible Llama target modules").
const std::vector<std::string>& KnownTargets() {
  static const std::vector<std::string> k{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  return k;
}

constexpr int64_t kMaxLoraRank = 1 << 16;
constexpr size_t kMaxTargets = 16;

const Value& Entry(const Dict& d, const char* key, const std::string& where) {
  const Value* v = d.Find(key);
  if (!v) throw Error(where + ": '" + kLoraConfigKey + "' has no '" + key + "'");
  return *v;
}

bool EntryBool(const Dict& d, const char* key, const std::string& where) {
  const Value& v = Entry(d, key, where);
  if (!v.is_bool()) throw Error(where + ": '" + kLoraConfigKey + "' '" + key + "' is not True or False");
  return v.as_bool();
}

int64_t EntryRank(const Dict& d, const char* key, const std::string& where) {
  const Value& v = Entry(d, key, where);
  if (!v.is_int() || v.as_int() < 1 || v.as_int() > kMaxLoraRank)
    throw Error(where + ": '" + kLoraConfigKey + "' '" + key + "' is not a whole number from 1 to " + std::to_string(kMaxLoraRank));
  return v.as_int();
}

// Target names (nullopt: an entry that is not a string), checked: 1..kMaxTargets known names, none twice.
std::vector<std::string> CheckedTargets(const std::vector<std::optional<std::string>>& names, const std::string& where) {
  if (names.empty() || names.size() > kMaxTargets)
    throw Error(where + ": LoRA target_modules is not a list of 1 to " + std::to_string(kMaxTargets) + " module names");
  std::vector<std::string> out;
  const auto& known = KnownTargets();
  for (const auto& t : names) {
    if (!t || std::find(known.begin(), known.end(), *t) == known.end())
      throw Error(where + ": LoRA targets " + (t ? "'" + *t + "'" : std::string("a non-string")) +
                  ", not one of the HF-style Llama's qkv_proj, o_proj, gate_up_proj, down_proj that shardkit lays adapters out for");
    if (std::find(out.begin(), out.end(), *t) != out.end()) throw Error(where + ": LoRA targets '" + *t + "' twice");
    out.push_back(*t);
  }
  return out;
}

std::vector<std::string> EntryTargets(const Dict& d, const std::string& where) {
  const Value& v = Entry(d, "target_modules", where);
  if (!v.is_seq()) throw Error(where + ": '" + kLoraConfigKey + "' 'target_modules' is not a list");
  std::vector<std::optional<std::string>> names;
  for (const Value& t : v.as_seq().items) names.push_back(t.is_str() ? std::optional<std::string>(t.as_str()) : std::nullopt);
  return CheckedTargets(names, where);
}

bool FiniteAlpha(double a) { return std::isfinite(a) && a > 0 && a <= 1e9; }

// The module (all but the last name part) and the leaf of a parameter name.
std::pair<std::string, std::string> ModuleAndLeaf(const std::string& name) {
  const size_t dot = name.rfind('.');
  return {name.substr(0, dot), name.substr(dot + 1)};
}

bool Targeted(const LoraFormat& l, const std::string& module) {
  return std::any_of(l.targets.begin(), l.targets.end(), [&](const std::string& t) { return module.ends_with("." + t); });
}

ParamRule Rule(const ParamRule& base, std::string name, std::vector<int64_t> shape, SplitDim split, FusedRows fused, const ModelFormat& f) {
  ParamRule r{std::move(name), std::move(shape), split, fused};
  r.spec = TensorParallelSpec(r.shape, split, split == SplitDim::kReplicated ? FusedRows::kPlain : fused, f);
  r.layer = base.layer, r.place = base.place;
  return r;
}

// The adapters of one targeted module whose base weights are `group` (tp_layer.py: see lora.h).
void AddAdapters(const ModelFormat& f, const std::string& module, const std::vector<ParamRule>& group, std::vector<ParamRule>& out) {
  const int64_t r = f.lora.rank;
  const ParamRule& first = group.front();
  const std::string a = module + ".lora_A.weight", b = module + ".lora_B.";
  if (module.ends_with(".qkv_proj")) {  // LoraGQAQKVParallelLinear
    out.push_back(Rule(first, a, {r, first.shape[1]}, SplitDim::kReplicated, FusedRows::kPlain, f));
    for (const ParamRule& g : group) out.push_back(Rule(g, b + ModuleAndLeaf(g.name).second, {g.shape[0], r}, g.split, g.fused, f));
  } else if (first.split == SplitDim::kColumns) {  // row-parallel base
    out.push_back(Rule(first, a, {r, first.shape[1]}, SplitDim::kColumns, first.fused, f));
    out.push_back(Rule(first, b + "weight", {first.shape[0], r}, SplitDim::kReplicated, FusedRows::kPlain, f));
  } else {  // column-parallel base
    out.push_back(Rule(first, a, {r, first.shape[1]}, SplitDim::kReplicated, FusedRows::kPlain, f));
    out.push_back(Rule(first, b + "weight", {first.shape[0], r}, SplitDim::kRows, first.fused, f));
  }
}

}  // namespace

LoraFormat LoraFormatOfConfig(const Value& config, const std::string& where) {
  if (!config.is_dict()) throw Error(where + ": '" + kLoraConfigKey + "' is not a dict");
  const Dict& d = config.as_dict();
  LoraFormat l;
  l.rank = EntryRank(d, "lora_rank", where);
  if (EntryRank(d, "r", where) != l.rank) throw Error(where + ": '" + kLoraConfigKey + "' 'r' differs from 'lora_rank'");
  const Value& alpha = Entry(d, "lora_alpha", where);
  if (!(alpha.is_int() || alpha.is_float()) || !FiniteAlpha(alpha.as_float()))
    throw Error(where + ": '" + kLoraConfigKey + "' 'lora_alpha' is not a positive number up to 1e9");
  l.alpha = alpha.as_float();
  l.use_rslora = EntryBool(d, "use_rslora", where);
  l.targets = EntryTargets(d, where);
  const Value& bias = Entry(d, "bias", where);
  if (!bias.is_str() || bias.as_str() != "none")
    throw Error(where + ": '" + kLoraConfigKey + "' 'bias' is not 'none': the HF-style Llama has no biases for LoRA to train");
  if (const Value* m = d.Find("modules_to_save"); m && !m->is_none())
    throw Error(where + ": '" + kLoraConfigKey + "' names modules_to_save, whose extra trainable modules shardkit does not lay out");
  LoraDropoutOfConfig(config, where);  // carried as it is (in the model files), read by peft exports
  const bool base = EntryBool(d, "save_lora_base", where), merge = EntryBool(d, "merge_lora", where);
  // _get_lora_adapter_state_dict: merge_lora counts only with save_lora_base.
  l.saved = !base ? LoraSaved::kAdapterOnly : merge ? LoraSaved::kMerged : LoraSaved::kBaseAndAdapter;
  return l;
}

nlohmann::ordered_json LoraToJson(const LoraFormat& l) {
  return {{"lora_rank", l.rank}, {"lora_alpha", l.alpha}, {"use_rslora", l.use_rslora}, {"target_modules", l.targets},
          {"saved", LoraSavedName(l.saved)}};
}

LoraFormat LoraFormatOfJson(const nlohmann::json& j, const std::string& where) {
  const std::string at = where + ": model format 'lora'";
  if (!j.is_object()) throw Error(at + " is not an object");
  LoraFormat l;
  const auto& rank = j.value("lora_rank", nlohmann::json());
  if (!rank.is_number_integer() || rank.get<int64_t>() < 1 || rank.get<int64_t>() > kMaxLoraRank)
    throw Error(at + " 'lora_rank' is not a whole number from 1 to " + std::to_string(kMaxLoraRank));
  l.rank = rank.get<int64_t>();
  const auto& alpha = j.value("lora_alpha", nlohmann::json());
  if (!alpha.is_number() || !FiniteAlpha(alpha.get<double>())) throw Error(at + " 'lora_alpha' is not a positive number up to 1e9");
  l.alpha = alpha.get<double>();
  const auto& rs = j.value("use_rslora", nlohmann::json());
  if (!rs.is_boolean()) throw Error(at + " 'use_rslora' is not true or false");
  l.use_rslora = rs.get<bool>();
  const auto& targets = j.value("target_modules", nlohmann::json());
  if (!targets.is_array()) throw Error(at + " 'target_modules' is not a list");
  std::vector<std::optional<std::string>> names;
  for (const auto& t : targets) names.push_back(t.is_string() ? std::optional<std::string>(t.get<std::string>()) : std::nullopt);
  l.targets = CheckedTargets(names, at);
  const auto saved = ParseLoraSaved(j.value("saved", std::string()));
  if (!saved) throw Error(at + " 'saved' is not base_and_adapter, adapter_only or merged");
  l.saved = *saved;
  return l;
}

double LoraScale(const LoraFormat& l) {
  return l.use_rslora ? l.alpha / std::sqrt(static_cast<double>(l.rank)) : l.alpha / static_cast<double>(l.rank);
}

const char* LoraSavedName(LoraSaved s) {
  return s == LoraSaved::kBaseAndAdapter ? "base_and_adapter" : s == LoraSaved::kAdapterOnly ? "adapter_only" : "merged";
}

std::optional<LoraSaved> ParseLoraSaved(const std::string& s) {
  for (LoraSaved v : {LoraSaved::kBaseAndAdapter, LoraSaved::kAdapterOnly, LoraSaved::kMerged})
    if (s == LoraSavedName(v)) return v;
  return std::nullopt;
}

std::string DescribeLora(const LoraFormat& l) {
  char alpha[32], scale[32];
  std::snprintf(alpha, sizeof alpha, "%g", l.alpha), std::snprintf(scale, sizeof scale, "%g", LoraScale(l));
  std::string targets;
  for (const auto& t : l.targets) targets += (targets.empty() ? "" : ", ") + t;
  const char* saved = l.saved == LoraSaved::kBaseAndAdapter ? "base and adapters"
                      : l.saved == LoraSaved::kAdapterOnly  ? "adapters only"
                                                            : "adapters merged into the base";
  return "LoRA rank " + std::to_string(l.rank) + ", alpha " + alpha + " (scale " + scale + (l.use_rslora ? ", rsLoRA" : "") + ") on " +
         targets + "; " + saved;
}

std::string LoraProblem(const ModelFormat& f) {
  if (!f.lora.on()) return "";
  if (f.family != ModelFamily::kHfLlama) return "LoRA adapters are laid out for the HF-style family only";
  const auto& t = f.lora.targets;
  if (std::find(t.begin(), t.end(), "qkv_proj") != t.end() && !f.qkv_linear)
    return "a LoRA adapter on qkv_proj without qkv_linear (NxD's plain column-parallel LoRA of the stride-3 weight) is not laid out here";
  if (f.moe() && (std::find(t.begin(), t.end(), "gate_up_proj") != t.end() || std::find(t.begin(), t.end(), "down_proj") != t.end()))
    return "LoRA adapters on an MoE model's MLP are not laid out here";
  return "";
}

std::string LoraHfUnsupported(const ModelFormat& f) {
  if (!f.lora.on() || f.lora.saved != LoraSaved::kAdapterOnly) return "";
  return "is an adapter-only LoRA tag (" + DescribeLora(f.lora) +
         "): a Hugging Face model needs the base weights to merge the adapters into, which the tag does not hold; give them with "
         "--lora_base (an HF folder or a tag of the base model), or write the adapters alone with --format peft";
}

std::optional<LoraMergeSource> LoraMergeOf(const ModelFormat& f, const std::string& name) {
  if (f.lora.saved != LoraSaved::kBaseAndAdapter) return std::nullopt;
  return LoraAdaptersOf(f, name);
}

std::optional<LoraMergeSource> LoraAdaptersOf(const ModelFormat& f, const std::string& name) {
  if (!f.lora.on() || f.lora.saved == LoraSaved::kMerged) return std::nullopt;
  const auto [module, leaf] = ModuleAndLeaf(name);
  if (!Targeted(f.lora, module)) return std::nullopt;
  return LoraMergeSource{module + ".base_layer." + leaf, module + ".lora_A.weight", module + ".lora_B." + leaf};
}

double LoraDropoutOfConfig(const Value& config, const std::string& where) {
  if (!config.is_dict()) throw Error(where + ": '" + kLoraConfigKey + "' is not a dict");
  const Value* v = config.as_dict().Find("lora_dropout");
  if (!v) return 0.0;
  if (!(v->is_int() || v->is_float()) || !(v->as_float() >= 0 && v->as_float() < 1))
    throw Error(where + ": '" + kLoraConfigKey + "' 'lora_dropout' is not a number from 0 up to 1");
  return v->as_float();
}

std::vector<ParamRule> WithLora(const ModelFormat& f, std::vector<ParamRule> base) {
  if (!f.lora.on() || f.lora.saved == LoraSaved::kMerged) return base;
  if (const std::string why = LoraProblem(f); !why.empty()) throw Error(why);
  std::vector<ParamRule> out;
  for (size_t i = 0; i < base.size();) {
    const std::string module = ModuleAndLeaf(base[i].name).first;
    if (base[i].layer < 0 || !Targeted(f.lora, module)) {
      if (f.lora.saved == LoraSaved::kBaseAndAdapter) out.push_back(std::move(base[i]));
      ++i;
      continue;
    }
    std::vector<ParamRule> group;  // the module's base weights (qkv_proj: weight_q, _k, _v)
    for (; i < base.size() && ModuleAndLeaf(base[i].name).first == module; ++i) group.push_back(base[i]);
    if (f.lora.saved == LoraSaved::kBaseAndAdapter)
      for (ParamRule g : group) g.name = module + ".base_layer." + ModuleAndLeaf(g.name).second, out.push_back(std::move(g));
    AddAdapters(f, module, group, out);
  }
  return out;
}

std::string WithoutBaseLayer(const std::string& name) {
  const size_t at = name.find(".base_layer.");
  return at == std::string::npos ? name : name.substr(0, at) + name.substr(at + std::string(".base_layer").size());
}

bool IsLoraAdapterName(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

}  // namespace ckpt

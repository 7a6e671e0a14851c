#include "migrate/migrate.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <set>
#include <sstream>

#include "migrate/check.h"
#include "migrate/interpolation.h"
#include "migrate/schema.h"

namespace migrate {
namespace {

enum class Action { kKeep, kMove, kDrop, kPrecision };

// What happens to an NNM key and everything below it.
struct Rule {
  Action action = Action::kKeep;
  std::string target;  // kMove: the NxDT path
  std::string reason;
};

bool StartsWith(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

std::string Unquote(std::string s) {  // ``x.y`` -> x.y
  while (StartsWith(s, "`")) s.erase(0, 1);
  while (!s.empty() && s.back() == '`') s.pop_back();
  return s;
}

// Rules by NNM path, from NxDT's table plus the few keys it does not list.
std::map<std::string, Rule> BuildRules(std::vector<std::string>* notes) {
  std::map<std::string, Rule> rules;
  for (const MappingRow& row : MappingTable()) {
    const std::string path = row.section.empty() ? row.key : row.section + "." + row.key;
    const std::string& m = row.mapping;
    const std::string comment = row.comment.empty() ? "" : ": " + row.comment;
    Rule r;
    if (m == row.key) {
      r = {Action::kKeep, "", "same key in NxDT (mapping table)"};
    } else if (StartsWith(m, "``") && m.find(' ') == std::string::npos) {
      std::string target = Unquote(m);
      // Absolute targets name a top-level section; others (fusions.softmax)
      // are relative to the row's own section, where NxDT keeps them.
      const bool absolute = StartsWith(target, "distributed_strategy.") || StartsWith(target, "data.") ||
                            StartsWith(target, "exp_manager.");
      if (!absolute && !row.section.empty()) target = row.section + "." + target;
      std::string reason = "moved (mapping table)" + comment;
      if (row.key == "log_parameter_norm" && target == "exp_manager.log_gradient_norm") {
        target = "exp_manager.log_parameter_norm";
        reason = "moved; the mapping table says exp_manager.log_gradient_norm, an evident typo (that is where "
                 "log_gradient_norm goes), corrected to exp_manager.log_parameter_norm";
        notes->push_back("mapping table typo corrected: log_parameter_norm maps to exp_manager.log_parameter_norm, not "
                         "exp_manager.log_gradient_norm");
      }
      r = {Action::kMove, target, reason};
    } else if (StartsWith(m, "Moved to ``data``")) {
      r = {Action::kMove, "data", "the whole data config moved to the top-level data section (mapping table)" + comment};
    } else if (StartsWith(m, "Seed is moved")) {
      r = {Action::kMove, "seed", "seed moved to the top level (mapping table)"};
    } else if (m == "Supported via precision config" || StartsWith(m, "replaced by ``precision_config``")) {
      r = {Action::kPrecision, "precision", "folded into the precision section (mapping table: " + m + ")" + comment};
    } else {
      r = {Action::kDrop, "", m + comment};
    }
    rules[path] = r;
    // NNM keeps these two at the top level, though the table lists them under model.
    if (row.section == "model" && StartsWith(r.target, "exp_manager.")) rules[row.key] = r;
  }
  // Keys the table does not list.
  rules["model.save_xser"] = {Action::kMove, "exp_manager.save_xser", "xser saving is an exp_manager setting in NxDT"};
  rules["model.load_xser"] = {Action::kMove, "exp_manager.load_xser", "xser loading is an exp_manager setting in NxDT"};
  for (const char* k : {"model.fp8_interval", "model.fp8_amax_history_len", "model.fp8_amax_compute_algo"})
    rules[k] = {Action::kDrop, "", "Not supported: fp8 training is not supported on Neuron (the table drops every other fp8 key for this reason)"};
  for (const char* k : {"model.output_dir", "model.config_path"})
    rules[k] = {Action::kDrop, "", "companion of convert_to_hf, which NxDT supports via a separate script (mapping table)"};
  return rules;
}

// The rule for `path`: the longest rule prefix, rewritten for the rest of the path.
std::optional<Rule> Lookup(const std::map<std::string, Rule>& rules, const std::string& path) {
  auto parts = SplitPath(path);
  for (size_t n = parts.size(); n > 0; --n) {
    const std::string prefix = JoinPath(parts, n);
    auto it = rules.find(prefix);
    if (it == rules.end()) continue;
    Rule r = it->second;
    if (r.action == Action::kMove) {
      const std::string rest = path.substr(prefix.size());
      r.target += rest;
    } else if (r.action == Action::kKeep) {
      r.target = path;
    }
    return r;
  }
  return std::nullopt;
}

struct Decision {
  std::string fate;  // kept | moved | dropped | unknown
  std::string to;
  std::string reason;
  bool precision = false;
};

Decision Decide(const std::map<std::string, Rule>& rules, const std::string& path) {
  if (auto r = Lookup(rules, path)) {
    switch (r->action) {
      case Action::kKeep: return {"kept", path, r->reason};
      case Action::kMove: return {r->target == path ? "kept" : "moved", r->target, r->reason};
      case Action::kDrop: return {"dropped", "", r->reason};
      case Action::kPrecision: return {"dropped", "", r->reason, true};
    }
  }
  if (NxdtKey(path)) return {"kept", path, "not in the mapping table; NxDT has the same key here"};
  return {"unknown", path, "in neither the mapping table nor NxDT's schema; kept where it was, check it by hand"};
}

std::string Bool(bool b) { return b ? "True" : "False"; }

bool Truthy(const YAML::Node& n) {
  if (!n.IsDefined() || !n.IsScalar()) return false;
  std::string s = n.Scalar();
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  return s == "true" || s == "1" || s == "yes";
}

YAML::Node Quoted(const std::string& s) {
  YAML::Node n(s);
  n.SetTag("!");
  return n;
}

YAML::Node Plain(const std::string& s) {
  YAML::Node n(s);
  n.SetTag("?");
  return n;
}

// The precision section NNM's settings and launch environment amount to.
YAML::Node DerivePrecision(const YAML::Node& nnm, const MigrateOptions& opts, Report* report) {
  auto env = [&](const std::string& name, const std::string& recipe_default) {
    auto it = opts.env.find(name);
    if (it != opts.env.end()) return it->second;
    report->warnings.push_back("assumed " + name + "=" + recipe_default +
                               " as the NNM recipe scripts export it (pass --env " + name + "=... to change)");
    return recipe_default;
  };
  const bool bf16 = env("XLA_USE_BF16", "1") == "1" || env("XLA_DOWNCAST_BF16", "0") == "1";
  const bool sr = env("NEURON_RT_STOCHASTIC_ROUNDING_EN", "1") == "1";
  const bool amp_o2 = Truthy(Find(nnm, "model.megatron_amp_O2"));
  const bool master = Truthy(Find(nnm, "model.zero_use_master_weight")) || amp_o2;
  const bool fp32_acc = Truthy(Find(nnm, "model.zero_use_fp32_grad_accum")) || amp_o2;
  const YAML::Node tp = Find(nnm, "trainer.precision");
  const std::string trainer_precision = tp.IsDefined() && tp.IsScalar() ? tp.Scalar() : "32";

  std::string type, why;
  if (bf16 && master && fp32_acc) {
    type = sr ? "mixed_precisionSR" : "mixed_precision";
    why = "bf16 (XLA_USE_BF16) with fp32 master weights and fp32 gradient accumulation";
  } else if (bf16 && master) {
    type = "manual";
    why = "bf16 with fp32 master weights but bf16 gradient accumulation, which no preset expresses";
  } else if (bf16) {
    type = sr ? "bf16SR" : "manual";
    why = sr ? "everything in bf16 (XLA_USE_BF16) with stochastic rounding" : "everything in bf16 without stochastic rounding";
  } else if (trainer_precision == "bf16" || trainer_precision == "16" || trainer_precision == "bf16-mixed") {
    type = "autocast";
    why = "Lightning mixed precision (trainer.precision=" + trainer_precision + ")";
  } else {
    type = "fp32";
    why = "trainer.precision=" + trainer_precision + " and no bf16 environment";
  }
  YAML::Node p(YAML::NodeType::Map);
  p["type"] = Quoted(type);
  const bool mp = type.rfind("mixed_precision", 0) == 0;
  p["master_weights"] = Plain(Bool(mp || master));
  p["fp32_grad_acc"] = Plain(Bool(mp || fp32_acc));
  p["xla_use_bf16"] = Quoted(bf16 && !mp ? "1" : "0");
  p["xla_downcast_bf16"] = Quoted("0");
  p["neuron_rt_stochastic_rounding_en"] = Quoted(sr && bf16 ? "1" : "0");
  report->entries.push_back({"precision", "added", "precision", "", type,
                             "derived from NNM's trainer.precision, megatron_amp_O2, zero_use_master_weight, "
                             "zero_use_fp32_grad_accum and the launch environment: " + why});
  return p;
}

// NxDT's top-level Neuron runtime keys, from the launch environment NNM read
// them from (only what --env gives).
void AddRuntimeKeys(const MigrateOptions& opts, YAML::Node* out, Report* report) {
  auto env = [&](const char* name) -> std::optional<std::string> {
    auto it = opts.env.find(name);
    return it == opts.env.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  auto add = [&](const std::string& key, const YAML::Node& v, const std::string& from) {
    Set(*out, key, v);
    report->entries.push_back({key, "added", key, "", Describe(v), "from the NNM launch environment: " + from});
  };
  if (auto flags = env("NEURON_CC_FLAGS")) {
    // NxDT takes the compile cache separately: split --cache_dir=X out of the flags.
    std::string kept, cache;
    std::istringstream in(*flags);
    for (std::string tok; in >> tok;) {
      if (tok.rfind("--cache_dir=", 0) == 0) cache = tok.substr(12);
      else kept += (kept.empty() ? "" : " ") + tok;
    }
    add("compiler_flags", Quoted(kept), "NEURON_CC_FLAGS");
    if (!cache.empty()) add("compiler_cache_url", Plain(cache), "NEURON_CC_FLAGS --cache_dir");
    if (kept.find("--distribution-strategy=nemo") != std::string::npos)
      report->warnings.push_back("compiler_flags keeps NNM's --distribution-strategy=nemo; NxDT's examples use "
                                 "--distribution-strategy=llm-training");
  }
  if (auto v = env("NEURON_RT_EXEC_TIMEOUT")) add("neuron_rt_exec_timeout", Plain(*v), "NEURON_RT_EXEC_TIMEOUT");
  // NxDT spells this key "aync_...".
  if (auto v = env("NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"))
    add("aync_exec_max_inflight_requests", Plain(*v), "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS");
}

// Sorts every mapping by NxDT's key order; keys NxDT does not list keep
// their relative order after the known ones.
YAML::Node Ordered(const YAML::Node& n, const std::string& path) {
  if (!n.IsMap()) return n;
  std::vector<std::pair<std::string, YAML::Node>> items;
  for (auto it = n.begin(); it != n.end(); ++it) items.emplace_back(it->first.Scalar(), it->second);
  auto rank = [&](const std::string& key) -> int {
    const std::string full = path.empty() ? key : path + "." + key;
    if (path.empty()) {
      const auto& order = NxdtSectionOrder();
      auto at = std::find(order.begin(), order.end(), key);
      if (at != order.end()) return static_cast<int>(at - order.begin());
      const int o = NxdtOrder(full);
      return o < 0 ? 1 << 20 : 1000 + o;
    }
    const int o = NxdtOrder(full);
    return o < 0 ? 1 << 20 : o;
  };
  // Sort indices: assigning a YAML::Node (as sorting the pairs would) rebinds
  // the node it refers to, corrupting the tree.
  std::vector<size_t> idx(items.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return rank(items[a].first) < rank(items[b].first); });
  YAML::Node out(YAML::NodeType::Map);
  for (size_t i : idx) out[items[i].first] = Ordered(items[i].second, path.empty() ? items[i].first : path + "." + items[i].first);
  return out;
}

std::string LineOf(const YAML::Node& n, const std::string& source) {
  return n.Mark().line >= 0 ? source + ":" + std::to_string(n.Mark().line + 1) : source + " (from an override)";
}

// Every interpolation must point at something (after overrides).
void ValidateInterpolations(const YAML::Node& root, const YAML::Node& n, const std::string& path, const std::string& source) {
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it)
      ValidateInterpolations(root, it->second, path.empty() ? it->first.Scalar() : path + "." + it->first.Scalar(), source);
  } else if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) ValidateInterpolations(root, n[i], path, source);
  } else if (n.IsScalar() && HasInterpolation(n.Scalar())) {
    std::vector<std::string> targets;
    try {
      targets = InterpolationTargets(n.Scalar(), path);
    } catch (const InputError& e) {
      throw InputError(LineOf(n, source) + ": key '" + path + "': " + e.what());
    }
    for (const auto& t : targets)
      if (!Has(root, t))
        throw InputError(LineOf(n, source) + ": key '" + path + "': interpolation '" + n.Scalar() + "' points to '" + t +
                         "', which is not in the config");
  }
}

}  // namespace

// NNM groups weight decay by module class (get_params_for_weight_decay_optimization
// in NNM's nemo/collections/nlp/modules/common/megatron/utils.py), exempting
// apex.normalization's classes: GPT's MixedFusedLayerNorm weights did not
// decay, Llama's FastRMSNorm weights did. NxDT's megatron models call NeMo
// v2.1.0's function of the same name over NxD's norms, which are no apex
// class, so every norm weight decays whatever do_layer_norm_weight_decay says
// (run on CPU: tests/data/upstream/nxdt_megatron). An RMSNorm model trains as it
// did; a LayerNorm model starts decaying its norm weights, which no setting
// avoids: the report says so.
void NoteNormWeightDecay(const YAML::Node& nnm, Report* report) {
  const YAML::Node norm = Find(nnm, "model.normalization");
  const bool layernorm = !norm.IsDefined() || (norm.IsScalar() && norm.Scalar() == "layernorm");  // NNM's default
  if (!layernorm) return;
  report->warnings.push_back(
      "NNM did not decay LayerNorm weights (MixedFusedLayerNorm is an apex.normalization class, which NNM's "
      "get_params_for_weight_decay_optimization exempts); NxDT's megatron models do, whatever model.do_layer_norm_weight_decay "
      "says (NxD's LayerNorm is no apex class, so NeMo v2.1.0's same function keeps only biases apart). "
      "nnm2nxdt-ckpt --optimizer_groups nxdt regroups the optimizer state to match");
}

Migration Migrate(const YAML::Node& nnm, const MigrateOptions& opts) {
  ValidateInterpolations(nnm, nnm, "", opts.source);
  Migration result;
  Report& report = result.report;
  report.source = opts.source;
  std::vector<std::string> notes;
  const auto rules = BuildRules(&notes);
  for (const auto& n : notes) report.warnings.push_back(n);

  // 1. Place every leaf.
  YAML::Node out(YAML::NodeType::Map);
  std::vector<std::string> leaves;
  Leaves(nnm, "", &leaves);
  std::map<std::string, std::string> placed;  // NxDT path -> NNM path (for interpolations)
  for (const std::string& leaf : leaves) {
    const YAML::Node value = Find(nnm, leaf);
    const Decision d = Decide(rules, leaf);
    ReportEntry e{leaf, d.fate, d.to, Describe(value), "", d.reason};
    if (d.fate == "dropped") {
      report.entries.push_back(e);
      continue;
    }
    if (d.fate == "unknown") report.warnings.push_back("unknown key '" + leaf + "' kept where it was: " + d.reason);
    Set(out, d.to, YAML::Clone(value));
    placed[d.to] = leaf;
    report.entries.push_back(e);
  }

  // 2. Rewrite interpolations to where their targets went; resolve those whose target was dropped.
  auto relocate = [&](const std::string& old_target) -> Relocation {
    const Decision d = Decide(rules, old_target);
    if (d.fate != "dropped") return {d.to, ""};
    return {std::nullopt, Describe(Find(nnm, old_target))};
  };
  for (auto& entry : report.entries) {
    if (entry.fate == "dropped") continue;
    YAML::Node v = Find(out, entry.to);
    auto rewrite = [&](YAML::Node node) {
      if (!node.IsScalar() || !HasInterpolation(node.Scalar())) return;
      const std::string before = node.Scalar();
      if (auto sole = SoleTarget(before, entry.key); sole && relocate(*sole).new_path == std::nullopt) {
        node = YAML::Clone(Find(nnm, *sole));  // keeps the target's type
        entry.reason += "; interpolation " + before + " resolved: its target " + *sole + " was dropped";
      } else {
        node = Plain(RewriteInterpolations(before, entry.key, entry.to, relocate));
        if (IsQuoted(Find(nnm, entry.key))) node.SetTag("!");
      }
    };
    if (v.IsSequence())
      for (size_t i = 0; i < v.size(); ++i) rewrite(v[i]);
    else
      rewrite(v);
    const std::string after = Describe(Find(out, entry.to));
    if (after != entry.from_value) {
      entry.to_value = after;
      entry.fate = "changed";
    }
  }

  // 3. What NxDT needs that NNM does not say directly.
  auto add = [&](const std::string& path, const YAML::Node& value, const std::string& why) {
    if (Has(out, path)) return;
    Set(out, path, value);
    report.entries.push_back({path, "added", path, "", Describe(value), why});
  };
  add("model_source", Plain("megatron"), "NxDT builds NNM's megatron-style model with model_source: megatron");
  add("exp_manager.save_xser", Plain("False"), "NNM's default: model.save_xser was not set");
  add("exp_manager.load_xser", Plain("False"), "NNM's default: model.load_xser was not set");
  add("exp_manager.async_checkpointing", Plain("False"), "NNM's default: async_checkpointing was not set");
  const YAML::Node gran = Find(out, "model.activations_checkpoint_granularity");
  if (gran.IsDefined() && gran.IsScalar() && gran.Scalar() == "selective") {
    YAML::Node recompute(YAML::NodeType::Sequence);
    recompute.push_back(Plain("CoreAttention"));
    recompute.SetStyle(YAML::EmitterStyle::Flow);
    add("model.activations_checkpoint_recompute", recompute,
        "selective checkpointing in NxDT recomputes the CoreAttention block, as NNM's selective mode did");
  }
  Set(out, "precision", DerivePrecision(nnm, opts, &report));
  AddRuntimeKeys(opts, &out, &report);
  NoteNormWeightDecay(nnm, &report);

  result.config = Ordered(out, "");
  report.check_problems = CheckNxdt(result.config);
  report.set_at_launch = SetAtLaunch(result.config);
  report.at_launch = CheckAtLaunch(result.config);
  return result;
}

nlohmann::ordered_json Report::ToJson() const {
  nlohmann::ordered_json j;
  j["source"] = source;
  j["overrides"] = overrides;
  std::map<std::string, int> counts;
  auto keys = nlohmann::ordered_json::array();
  for (const auto& e : entries) {
    ++counts[e.fate];
    nlohmann::ordered_json k = {{"key", e.key}, {"fate", e.fate}};
    if (!e.to.empty() && e.fate != "kept") k["to"] = e.to;
    if (e.fate == "changed") k["from_value"] = e.from_value, k["to_value"] = e.to_value;
    if (e.fate == "added") k["value"] = e.to_value;
    k["reason"] = e.reason;
    keys.push_back(k);
  }
  j["summary"] = counts;
  j["keys"] = keys;
  j["warnings"] = warnings;
  j["check"] = check_problems;
  j["set_at_launch"] = set_at_launch;
  j["at_launch"] = at_launch;
  return j;
}

std::string Report::Summary() const {
  std::map<std::string, int> counts;
  for (const auto& e : entries) ++counts[e.fate];
  std::ostringstream o;
  o << "nnm2nxdt-config: " << source << ":";
  for (const auto& [fate, n] : counts) o << " " << n << " " << fate;
  o << "\n";
  for (const auto& e : entries) {
    if (e.fate == "moved") o << "  moved    " << e.key << " -> " << e.to << "\n";
    else if (e.fate == "changed") o << "  changed  " << e.key << (e.to != e.key ? " -> " + e.to : "") << ": " << e.from_value << " -> " << e.to_value << "\n";
    else if (e.fate == "dropped") o << "  dropped  " << e.key << ": " << e.reason << "\n";
    else if (e.fate == "added") o << "  added    " << e.key << " = " << e.to_value << ": " << e.reason << "\n";
  }
  for (const auto& w : warnings) o << "  warning: " << w << "\n";
  for (const auto& p : check_problems) o << "  check: " << p << "\n";
  if (!set_at_launch.empty()) {
    o << "  warning: kept as ??? (mandatory, to be set at launch with an override, as NxDT's Hydra launch takes it):";
    for (const auto& k : set_at_launch) o << " " << k;
    o << "\n";
  }
  for (const auto& p : at_launch)
    o << "  warning: as written, " << p << "; launch scripts set these sizes (trainer.devices, trainer.num_nodes, "
         "the batch sizes) and NxD checks them when the job starts\n";
  return o.str();
}

}  // namespace migrate

#include "migrate/check.h"

#include <functional>

#include <algorithm>
#include <optional>
#include <set>

#include "ckpt/util/error.h"
#include "ckpt/spec/tag_paths.h"
#include "migrate/interpolation.h"
#include "migrate/schema.h"

namespace migrate {
namespace {

const char* TypeName(ValueType t) {
  switch (t) {
    case ValueType::kInt: return "an integer";
    case ValueType::kNumber: return "a number";
    case ValueType::kBool: return "a boolean";
    case ValueType::kString: return "a string";
    case ValueType::kMap: return "a mapping";
    case ValueType::kList: return "a list";
    case ValueType::kAny: return "anything";
  }
  return "";
}

bool Matches(const YAML::Node& n, ValueType t) {
  switch (t) {
    case ValueType::kAny: return true;
    case ValueType::kMap: return n.IsMap();
    case ValueType::kList: return n.IsSequence();
    case ValueType::kString: return n.IsScalar();
    case ValueType::kInt: return n.IsScalar() && !IsQuoted(n) && IsIntegerText(n.Scalar());
    case ValueType::kNumber: return n.IsScalar() && !IsQuoted(n) && IsNumberText(n.Scalar());
    case ValueType::kBool: return n.IsScalar() && !IsQuoted(n) && IsBoolText(n.Scalar());
  }
  return false;
}

// An integer value, following plain ${a.b} interpolations.
std::optional<long long> IntAt(const YAML::Node& root, std::string path, int depth = 0) {
  const YAML::Node n = Find(root, path);
  if (!n.IsDefined() || !n.IsScalar() || depth > 16) return std::nullopt;
  if (HasInterpolation(n.Scalar())) {
    auto target = SoleTarget(n.Scalar(), path);
    return target ? IntAt(root, *target, depth + 1) : std::nullopt;
  }
  if (!IsIntegerText(n.Scalar())) return std::nullopt;
  try {
    return std::stoll(n.Scalar());
  } catch (const std::out_of_range&) {
    return std::nullopt;
  }
}

// A number value, following plain ${a.b} interpolations.
std::optional<double> NumberAt(const YAML::Node& root, std::string path, int depth = 0) {
  const YAML::Node n = Find(root, path);
  if (!n.IsDefined() || !n.IsScalar() || depth > 16) return std::nullopt;
  if (HasInterpolation(n.Scalar())) {
    auto target = SoleTarget(n.Scalar(), path);
    return target ? NumberAt(root, *target, depth + 1) : std::nullopt;
  }
  if (!Matches(n, ValueType::kNumber)) return std::nullopt;
  try {
    return std::stod(n.Scalar());
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Plain ${a.b} chains that come back to where they started (OmegaConf fails
// on them at run time), and ones that point at nothing.
void CheckInterpolationChains(const YAML::Node& cfg, std::vector<std::string>* problems) {
  std::vector<std::string> leaves;
  Leaves(cfg, "", &leaves);
  std::set<std::string> walked;  // each link is followed once, whichever chain reaches it first
  for (const auto& leaf : leaves) {
    if (walked.count(leaf)) continue;
    std::vector<std::string> chain = {leaf};
    std::string at = leaf;
    while (walked.insert(at).second) {
      const YAML::Node n = Find(cfg, at);
      if (!n.IsDefined()) {
        if (chain.size() > 1) problems->push_back(chain.front() + ": interpolation points to " + at + ", which is not set");
        break;
      }
      if (!n.IsScalar() || !HasInterpolation(n.Scalar())) break;
      const auto next = SoleTarget(n.Scalar(), at);
      if (!next) break;
      if (auto start = std::find(chain.begin(), chain.end(), *next); start != chain.end()) {
        std::string loop;
        for (auto c = start; c != chain.end(); ++c) loop += *c + " -> ";
        problems->push_back(*start + ": interpolation cycle " + loop + *next);
        break;
      }
      if (chain.size() >= 16) {  // as deep as the resolver follows
        problems->push_back(chain.front() + ": interpolation chain longer than 16 links");
        break;
      }
      chain.push_back(at = *next);
    }
  }
}

}  // namespace

std::vector<std::string> CheckAtLaunch(const YAML::Node& cfg) {
  std::vector<std::string> found;
  const auto tp = IntAt(cfg, "distributed_strategy.tensor_model_parallel_size").value_or(1);
  const auto pp = IntAt(cfg, "distributed_strategy.pipeline_model_parallel_size").value_or(1);
  const auto devices = IntAt(cfg, "trainer.devices"), nodes = IntAt(cfg, "trainer.num_nodes");
  // Degrees past a million ranks are nonsense (CheckNxdt refuses them), and their products would overflow.
  auto sane = [&](long long v) { return v >= 1 && v <= ckpt::kMaxRanks; };
  if (!devices || !sane(*devices) || !sane(nodes.value_or(1)) || !sane(tp) || !sane(pp)) return found;
  const long long world = *devices * nodes.value_or(1);
  const std::string named_world = "trainer.devices (" + std::to_string(*devices) + ") * trainer.num_nodes (" +
                                  std::to_string(nodes.value_or(1)) + ") = " + std::to_string(world) + ", the world size";
  try {
    const int dp = ckpt::RankGrid::ForWorld(world, tp, pp, false, "distributed_strategy", named_world).dp;
    const auto gbs = IntAt(cfg, "data.global_batch_size"), mbs = IntAt(cfg, "data.micro_batch_size");
    if (gbs && mbs && sane(*mbs) && *gbs % *mbs == 0 && *gbs % (*mbs * dp))
      found.push_back("data.global_batch_size (" + std::to_string(*gbs) + ") is not a multiple of data.micro_batch_size (" +
                      std::to_string(*mbs) + ") * data-parallel size (" + std::to_string(dp) + ") = " + std::to_string(*mbs * dp) +
                      " at " + named_world);
  } catch (const ckpt::Error& e) {
    found.push_back(e.what());
  }
  return found;
}

std::vector<std::string> CheckNxdt(const YAML::Node& cfg) {
  std::vector<std::string> problems;
  for (const char* s : {"model_source", "trainer", "exp_manager", "distributed_strategy", "data", "model", "precision"})
    if (!Has(cfg, s)) problems.push_back(std::string("missing required section '") + s + "'");
  for (const SchemaKey& k : NxdtSchema()) {
    const YAML::Node n = Find(cfg, k.path);
    if (!n.IsDefined()) continue;
    if (n.IsNull()) {
      if (!k.nullable && k.type != ValueType::kAny) problems.push_back(k.path + ": is null but must be " + TypeName(k.type));
      continue;
    }
    if (n.IsScalar() && n.Scalar() == "???") continue;  // set at launch (SetAtLaunch)
    if (n.IsScalar() && HasInterpolation(n.Scalar())) continue;  // checked where it points
    if (!Matches(n, k.type)) problems.push_back(k.path + ": " + Describe(n) + " is not " + TypeName(k.type));
  }

  const auto tp = IntAt(cfg, "distributed_strategy.tensor_model_parallel_size").value_or(1);
  const auto pp = IntAt(cfg, "distributed_strategy.pipeline_model_parallel_size").value_or(1);
  if (tp < 1 || pp < 1 || tp > ckpt::kMaxRanks || pp > ckpt::kMaxRanks)
    problems.push_back("distributed_strategy: tensor and pipeline parallel sizes must be from 1 to " + std::to_string(ckpt::kMaxRanks));
  // What holds for every world size; CheckAtLaunch checks the world the config names.
  const auto gbs = IntAt(cfg, "data.global_batch_size"), mbs = IntAt(cfg, "data.micro_batch_size");
  if (gbs && mbs && *mbs >= 1 && *mbs <= ckpt::kMaxRanks && *gbs % *mbs)
    problems.push_back("data.global_batch_size (" + std::to_string(*gbs) + ") is not a multiple of data.micro_batch_size (" +
                       std::to_string(*mbs) + ")");
  const auto layers = IntAt(cfg, "model.num_layers");
  const bool cuts = Has(cfg, "model.pipeline_cuts") && !Find(cfg, "model.pipeline_cuts").IsNull();
  if (layers && pp >= 1 && *layers % pp && !cuts)
    problems.push_back("model.num_layers (" + std::to_string(*layers) + ") does not divide evenly over pipeline_model_parallel_size (" +
                       std::to_string(pp) + "); give model.pipeline_cuts or change the sizes");
  // Sizes that make no model.
  for (const char* key : {"model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.ffn_hidden_size",
                          "model.encoder_seq_length", "model.max_position_embeddings", "model.num_kv_heads", "data.global_batch_size",
                          "data.micro_batch_size", "data.seq_length", "trainer.devices", "trainer.num_nodes", "trainer.max_steps"})
    if (const auto v = IntAt(cfg, key); v && *v < 1) problems.push_back(std::string(key) + ": " + std::to_string(*v) + " must be at least 1");
  for (const char* key : {"trainer.devices", "trainer.num_nodes"})
    if (const auto v = IntAt(cfg, key); v && *v > ckpt::kMaxRanks)
      problems.push_back(std::string(key) + ": " + std::to_string(*v) + " is more than " + std::to_string(ckpt::kMaxRanks) + " ranks");
  const auto hidden = IntAt(cfg, "model.hidden_size"), kv = IntAt(cfg, "model.num_kv_heads");
  const auto heads = IntAt(cfg, "model.num_attention_heads");
  if (hidden && heads && *heads >= 1 && *hidden >= 1 && *hidden % *heads)
    problems.push_back("model.hidden_size (" + std::to_string(*hidden) + ") is not divisible by model.num_attention_heads (" +
                       std::to_string(*heads) + ")");
  if (kv && heads && *kv >= 1 && *heads >= 1 && *heads % *kv)
    problems.push_back("model.num_kv_heads (" + std::to_string(*kv) + ") does not divide model.num_attention_heads (" +
                       std::to_string(*heads) + ")");
  if (const auto lr = NumberAt(cfg, "model.optim.lr"); lr && !(*lr > 0))
    problems.push_back("model.optim.lr: " + std::to_string(*lr) + " must be positive");
  for (const char* key : {"model.optim.weight_decay", "model.optim.sched.min_lr", "model.optim.sched.warmup_steps",
                          "model.optim.sched.constant_steps", "trainer.gradient_clip_val"})
    if (const auto v = NumberAt(cfg, key); v && !(*v >= 0)) problems.push_back(std::string(key) + ": " + std::to_string(*v) + " must not be negative");
  CheckInterpolationChains(cfg, &problems);
  if (heads && tp >= 1 && *heads % tp)
    problems.push_back("model.num_attention_heads (" + std::to_string(*heads) + ") is not divisible by tensor_model_parallel_size (" +
                       std::to_string(tp) + ")");
  return problems;
}

std::vector<std::string> SetAtLaunch(const YAML::Node& config) {
  std::vector<std::string> out;
  std::function<void(const YAML::Node&, const std::string&)> walk = [&](const YAML::Node& n, const std::string& at) {
    if (n.IsScalar() && n.Scalar() == "???" && n.Tag() != "!") out.push_back(at);
    if (n.IsMap())
      for (const auto& kv : n) walk(kv.second, (at.empty() ? "" : at + ".") + kv.first.as<std::string>());
  };
  walk(config, "");
  return out;
}

}  // namespace migrate

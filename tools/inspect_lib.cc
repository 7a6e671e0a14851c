#include "tools/inspect_lib.h"


#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "ckpt/util/input_guard.h"
#include "ckpt/util/error.h"
#include "ckpt/store/manifest.h"
#include "ckpt/spec/lora.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/store/tag_verify.h"
#include "ckpt/pt/value_json.h"
#include "ckpt/pt/xser.h"

namespace shardkit {
namespace fs = std::filesystem;
using ckpt::Value;

namespace {

std::string KeyString(const Value& k, size_t index) {
  if (k.is_str()) return k.as_str();
  if (k.is_int()) return std::to_string(k.as_int());
  return "[" + std::to_string(index) + "]";
}

std::string Join(const std::string& prefix, const std::string& part) { return prefix.empty() ? part : prefix + "/" + part; }

void CollectFiles(ckpt::Env* env, const std::string& root, const std::string& rel, std::vector<std::string>* out) {
  const std::string dir = rel.empty() ? root : root + "/" + rel;
  for (const std::string& name : env->ListDir(dir)) {
    const std::string child_rel = rel.empty() ? name : rel + "/" + name;
    const std::string child = root + "/" + child_rel;
    if (ckpt::IsTempPath(name)) continue;
    if (env->IsDirectory(child)) {
      ckpt::RequireInside(root, child);  // a folder linked out of the one named is never listed
      if (!name.ends_with(".tensors")) CollectFiles(env, root, child_rel, out);
    } else if (name.ends_with(".pt") || name.ends_with(".ckpt") || name.ends_with(".pth") || name.ends_with(".bin")) {
      out->push_back(child_rel);
    }
  }
}

InspectedFile InspectFile(const std::string& full, const std::string& rel, bool verify_crc, ckpt::Env* env) {
  InspectedFile f;
  f.file = rel;
  f.format = ckpt::IsXser(full, env) ? "xser" : "pt";
  ckpt::LoadOptions opts;
  opts.verify_crc = verify_crc;
  // Inside a folder, nothing outside it is read (an xser file's tensor files included).
  if (!rel.empty()) opts.confine_to = full.substr(0, full.size() - rel.size() - 1);
  Value v = ckpt::LoadPtOrXser(full, opts, env);
  Flatten(v, "", &f.entries);
  return f;
}

}  // namespace

void Flatten(const Value& v, const std::string& prefix, std::vector<InspectEntry>* out) {
  if (v.is_tensor()) {
    const auto& t = v.as_tensor();
    InspectEntry e;
    e.key = prefix;
    e.is_tensor = true;
    e.dtype = std::string(ckpt::DTypeName(t.dtype()));
    e.shape = t.shape();
    e.bytes = t.nbytes();
    out->push_back(std::move(e));
    return;
  }
  const bool seq = v.is_seq() && v.as_seq().kind != ckpt::SeqKind::kTorchSize;
  if (v.is_dict() && !v.as_dict().items.empty()) {
    size_t i = 0;
    for (const auto& [k, c] : v.as_dict().items) Flatten(c, Join(prefix, KeyString(k, i++)), out);
    return;
  }
  if (seq && !v.as_seq().items.empty() && v.as_seq().items.size() <= 64) {
    bool scalars = true;
    for (const auto& c : v.as_seq().items) scalars &= !(c.is_tensor() || c.is_dict() || c.is_seq() || c.is_object());
    if (!scalars) {
      for (size_t i = 0; i < v.as_seq().items.size(); ++i)
        Flatten(v.as_seq().items[i], Join(prefix, "[" + std::to_string(i) + "]"), out);
      return;
    }
  }
  InspectEntry e;
  e.key = prefix.empty() ? "<root>" : prefix;
  e.value = v.is_object() ? nlohmann::ordered_json{{"object", v.as_object().cls.full()}} : ckpt::ValueToJson(v);
  out->push_back(std::move(e));
}

namespace {

// An MoE (Mixtral) tag, which no reader of shardkit takes yet, told by what its
// model files show: the family (FamilyLabel), the experts (the router's rows),
// the MoE layers and the ep ranks its model file names carry. Nothing when its
// model files hold no MoE tensor.
void DescribeMoeTag(InspectReport& r) {
  std::vector<std::string> names;
  std::map<std::string, std::vector<int64_t>> shapes;  // the first shape each name is seen with
  std::set<int> ep_ranks;
  for (const auto& f : r.files) {
    if (!f.file.starts_with("model/") || f.file.ends_with(".info.pt")) continue;
    if (const auto c = ckpt::ParseAnyRankFileName(f.file.substr(6)); c && c->ep) ep_ranks.insert(*c->ep);
    for (const auto& e : f.entries)
      if (shapes.emplace(e.key, e.shape).second) names.push_back(e.key);
  }
  const auto moe = ckpt::FirstMoeName(names);
  if (!moe) return;
  ckpt::ModelFormat f;
  f.family = *ckpt::FamilyOfName(*moe);
  std::set<int> layers;
  for (const std::string& n : names) {
    if (!ckpt::FirstMoeName({n})) continue;
    const int layer = ckpt::LayerOfName(n);
    layers.insert(layer);
    if (const auto& shape = shapes.at(n); n == ckpt::ParamName(f, ckpt::Module::kRouter, layer) && !shape.empty()) f.experts = shape[0];
  }
  const int ep = ep_ranks.empty() ? 1 : *ep_ranks.rbegin() + 1;
  std::string list;
  for (int l : layers) list += (list.empty() ? "" : ", ") + std::to_string(l);
  ckpt::ModelFormat labelled = f;
  labelled.experts = std::max<int64_t>(f.experts, 1);  // an MoE family, its expert count known or not
  r.model = ckpt::FamilyLabel(labelled) + " (MoE): " +
            (f.experts > 0 ? std::to_string(f.experts) + " experts (the router's rows)" : "experts of unknown count") +
            ", MoE layers " + list + ", ep " + std::to_string(ep) + (ep > 1 ? " (the model files' _ep_rank_)" : "");
  r.model_json = nlohmann::ordered_json{{"model_family", ckpt::FamilyLabel(labelled)}, {"num_experts", f.experts}, {"moe_layers", layers}, {"ep", ep}};
  r.notes.push_back(ckpt::MoeRefusal(*moe));
}

// A LoRA tag NxD wrote (no manifest): what its first model file's lora_config
// says (ckpt/spec/lora.h), validated. Nothing when it holds none.
void DescribeLoraTag(InspectReport& r, ckpt::Env* env) {
  for (const auto& f : r.files) {
    if (!f.file.starts_with("model/") || f.file.ends_with(".info.pt")) continue;
    const bool has = std::any_of(f.entries.begin(), f.entries.end(), [](const InspectEntry& e) {
      return e.key == ckpt::kLoraConfigKey || e.key.starts_with(std::string(ckpt::kLoraConfigKey) + "/");
    });
    if (!has) continue;
    ckpt::LoadOptions opts;
    opts.confine_to = r.path;
    const Value v = ckpt::LoadPtOrXser(r.path + "/" + f.file, opts, env);
    const Value* config = v.is_dict() ? v.as_dict().Find(ckpt::kLoraConfigKey) : nullptr;
    if (!config) return;
    const ckpt::LoraFormat l = ckpt::LoraFormatOfConfig(*config, r.path + "/" + f.file);
    r.model = ckpt::DescribeLora(l) + " (the model files' " + ckpt::kLoraConfigKey + ")";
    r.model_json = nlohmann::ordered_json{{"lora", ckpt::LoraToJson(l)}};
    return;
  }
}

}  // namespace

InspectReport Inspect(const std::string& path, bool verify_crc, ckpt::Env* env) {
  InspectReport r;
  r.path = path;
  if (!env->Exists(path)) throw ckpt::Error(path + ": no such file or directory");
  if (!env->IsDirectory(path)) {
    r.kind = ckpt::IsXser(path, env) ? "xser" : "file";
    r.files.push_back(InspectFile(path, "", verify_crc, env));
    return r;
  }
  const auto names = env->ListDir(path);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  for (const char* m : {"checkpoint", "done", "newest", "manifest.json"})
    if (has(m)) r.markers.push_back(m);
  r.kind = ckpt::LooksLikeTag(env, path) ? "nxdt_tag" : ckpt::HoldsNnmRankFolders(env, path) ? "nnm_folder" : "directory";
  std::vector<std::string> files;
  CollectFiles(env, path, "", &files);
  if (files.empty()) throw ckpt::Error(path + ": directory holds no .pt or .ckpt files");
  for (const auto& rel : files) r.files.push_back(InspectFile(path + "/" + rel, rel, verify_crc, env));
  if (r.kind == "nxdt_tag")
    for (const auto& p : ckpt::VerifyTag(env, path, {.checksums = verify_crc}).problems)
      r.problems.push_back((p.file.empty() ? "" : p.file + ": ") + p.what);
  if (r.kind == "nxdt_tag" && has(ckpt::kManifestFile)) {
    try {
      const ckpt::Manifest m = ckpt::Manifest::Load(env, path + "/" + ckpt::kManifestFile);
      if (m.model) {
        r.model = m.grid.ToString() + ", " + ckpt::FamilyLabel(*m.model) + ": " + m.model->Describe();
        r.model_json = m.model->ToJson();
        if (const std::string note = ckpt::MegatronKvReplicationNote(*m.model, m.grid.tp); !note.empty()) r.notes.push_back(note);
      }
    } catch (const ckpt::Error& e) {  // VerifyTag has reported it
    }
  }
  if (r.kind == "nxdt_tag" && r.model.empty()) DescribeMoeTag(r);
  if (r.kind == "nxdt_tag" && r.model.empty()) DescribeLoraTag(r, env);
  return r;
}

nlohmann::ordered_json ReportToJson(const InspectReport& r) {
  nlohmann::ordered_json j = {{"path", r.path}, {"kind", r.kind}, {"markers", r.markers}};
  if (r.model_json) j["model"] = *r.model_json, j["notes"] = r.notes;
  uint64_t tensors = 0, bytes = 0;
  auto files = nlohmann::ordered_json::array();
  for (const auto& f : r.files) {
    auto entries = nlohmann::ordered_json::array();
    for (const auto& e : f.entries) {
      if (e.is_tensor) {
        entries.push_back({{"key", e.key}, {"dtype", e.dtype}, {"shape", e.shape}, {"bytes", e.bytes}});
        ++tensors;
        bytes += e.bytes;
      } else {
        entries.push_back({{"key", e.key}, {"value", e.value}});
      }
    }
    files.push_back({{"file", f.file}, {"format", f.format}, {"entries", entries}});
  }
  j["files"] = files;
  j["totals"] = {{"files", r.files.size()}, {"tensors", tensors}, {"tensor_bytes", bytes}};
  j["problems"] = r.problems;
  return j;
}

namespace {
std::string Scalar(const nlohmann::ordered_json& v) {
  if (v.contains("object")) return "<object " + v["object"].get<std::string>() + ">";
  const std::string t = v.value("t", "");
  if (t == "none") return "None";
  if (t == "str") return v["v"].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (t == "bool") return v["v"].get<bool>() ? "True" : "False";
  if (t == "int" && v.contains("v")) return v["v"].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (t == "float") {
    std::string be = v["bits"];
    uint64_t bits = std::stoull(be, nullptr, 16);
    double d;
    std::memcpy(&d, &bits, 8);
    std::ostringstream s;
    s << d;
    return s.str();
  }
  if (t == "list" || t == "tuple" || t == "size") {  // as Python prints it: [0.9, 0.999], (1, 2)
    std::string out = t == "list" ? "[" : "(";
    for (size_t i = 0; i < v["items"].size(); ++i) {
      out += (i ? ", " : "") + Scalar(v["items"][i]);
      if (out.size() > 120) return out.substr(0, 117) + "...";
    }
    return out + (t == "list" ? "]" : (v["items"].size() == 1 ? ",)" : ")"));
  }
  if (t == "dict" || t == "odict") return "{}";
  std::string d = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return d.size() > 120 ? d.substr(0, 117) + "..." : d;
}
}  // namespace

std::string ReportToText(const InspectReport& r) {
  std::ostringstream o;
  o << r.path << ": " << r.kind;
  if (!r.markers.empty()) {
    o << " (markers:";
    for (const auto& m : r.markers) o << " " << m;
    o << ")";
  }
  o << "\n";
  if (!r.model.empty()) o << "model: " << r.model << "\n";
  for (const auto& n : r.notes) o << "note: " << n << "\n";
  uint64_t total_t = 0, total_b = 0;
  for (const auto& f : r.files) {
    uint64_t nt = 0, nb = 0;
    for (const auto& e : f.entries)
      if (e.is_tensor) ++nt, nb += e.bytes;
    total_t += nt, total_b += nb;
    o << "== " << (f.file.empty() ? r.path : f.file) << " [" << f.format << "] " << nt << " tensors, " << nb << " bytes\n";
    for (const auto& e : f.entries) {
      if (e.is_tensor) o << "  " << e.key << "  " << e.dtype << " " << ckpt::ShapeString(e.shape) << "  " << e.bytes << " B\n";
      else o << "  " << e.key << " = " << Scalar(e.value) << "\n";
    }
  }
  o << "total: " << r.files.size() << " files, " << total_t << " tensors, " << total_b << " bytes\n";
  for (const auto& p : r.problems) o << "problem: " << p << "\n";
  return o.str();
}

}  // namespace shardkit

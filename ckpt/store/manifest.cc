#include "ckpt/store/manifest.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>

#include "ckpt/util/crc32.h"
#include "ckpt/util/error.h"
#include "ckpt/pt/value_json.h"

namespace ckpt {

std::string CrcHex(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

FileDigest DigestFile(Env* env, const std::string& path) {
  // Read, not mapped (Env::ReadInPieces), through one window per thread,
  // kept: a 4 MiB buffer freed after each file would be unmapped by malloc
  // (over its mmap threshold), flushing the TLB as a mapping's release does.
  thread_local std::vector<uint8_t> window(kCrcWindow);
  FileDigest d;
  d.size = env->ReadInPieces(path, window, [&](std::span<const uint8_t> p) { d.crc32 = Crc32Combine(d.crc32, Crc32(p), p.size()); });
  return d;
}

const char* ContainerName(Container c) { return c == Container::kXser ? "xser" : "pt"; }

Container ContainerOfFiles(const std::map<std::string, FileDigest>& files) {
  for (const auto& [path, digest] : files)
    if (path.find(".pt.tensors/") != std::string::npos) return Container::kXser;
  return Container::kPlainPt;
}

StageMap StageMapOf(const std::vector<int64_t>& bounds, int virtual_stages) {
  StageMap m;
  const int pp = static_cast<int>(bounds.size() - 1) / virtual_stages;
  for (int p = 0; p < pp; ++p) m.push_back(RankLayerRanges(bounds, virtual_stages, p));
  return m;
}

std::optional<StageSplit> StageSplitOf(const StageMap& stages) {
  if (stages.empty()) return std::nullopt;
  StageSplit s;
  s.virtual_stages = static_cast<int>(stages[0].size());
  s.bounds = {0};
  for (int v = 0; v < s.virtual_stages; ++v)
    for (const auto& ranges : stages) {
      if (static_cast<int>(ranges.size()) != s.virtual_stages || ranges[v].first != s.bounds.back()) return std::nullopt;
      s.bounds.push_back(ranges[v].second);
    }
  return s;
}

std::optional<std::vector<int64_t>> StageBoundsOf(const StageMap& stages) {
  std::optional<StageSplit> s = StageSplitOf(stages);
  if (!s || s->virtual_stages != 1) return std::nullopt;
  return std::move(s->bounds);
}

namespace {

nlohmann::ordered_json LayoutToJson(const RecordedLayout& l) {
  nlohmann::ordered_json stages = nlohmann::ordered_json::array();
  for (const auto& ranges : l.stages) {
    nlohmann::ordered_json r = nlohmann::ordered_json::array();
    for (const auto& [first, end] : ranges) r.push_back({first, end});
    stages.push_back(std::move(r));
  }
  return {{"stages", stages}, {"master_weights", l.master_weights}, {"container", ContainerName(l.container)}};
}

}  // namespace

nlohmann::ordered_json Manifest::ToJson() const {
  nlohmann::ordered_json files_json = nlohmann::ordered_json::object();
  for (const auto& [p, d] : files) files_json[p] = {{"size", d.size}, {"crc32", CrcHex(d.crc32)}};
  nlohmann::ordered_json j = {{"format", "shardkit-checkpoint-manifest"},
                              {"version", 1},
                              {"step", step},
                              {"consumed_samples", consumed_samples},
                              {"grid", {{"tp", grid.tp}, {"pp", grid.pp}, {"dp", grid.dp}, {"zero1", grid.zero1}}},
                              {"world_size", world_size}};
  if (grid.ep > 1) j["grid"]["ep"] = grid.ep;  // expert parallelism (RankGrid::ep); absent at ep 1
  if (model) j["model"] = model->ToJson();
  if (optimizer_grouping) j["optimizer_grouping"] = GroupingRuleName(*optimizer_grouping);
  j["files"] = files_json;
  if (tensors) j["tensors"] = FingerprintsToJson(*tensors);
  if (layout) j["layout"] = LayoutToJson(*layout);
  return j;
}

nlohmann::ordered_json FingerprintsToJson(const TensorFingerprints& t) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, fields] : t)
    for (const auto& [field, f] : fields) j[name][field] = {{"dtype", f.dtype}, {"numel", f.numel}, {"crc32", CrcHex(f.crc32)}};
  return j;
}

namespace {

int64_t BoundedInt(const nlohmann::json& j, const char* key, int64_t lo, int64_t hi, const std::string& where) {
  const nlohmann::json& v = j.at(key);
  const bool fits = v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(hi));
  const int64_t x = fits ? v.get<int64_t>() : 0;
  if (!fits || x < lo || x > hi)
    throw Error(where + ": malformed manifest: '" + key + "' is " + v.dump() + ", not a whole number from " + std::to_string(lo) +
                " to " + std::to_string(hi));
  return x;
}

// The "layout" object of a manifest whose grid has `pp` stages: half-open,
// non-empty, non-overlapping layer ranges, at least one per pp rank.
RecordedLayout LayoutFromJson(const nlohmann::json& j, int pp, const std::string& source) {
  const std::string where = source + ": malformed manifest 'layout'";
  if (!j.is_object()) throw Error(where + ": not an object");
  RecordedLayout l;
  const nlohmann::json& stages = j.at("stages");
  if (!stages.is_array() || stages.size() != static_cast<size_t>(pp))
    throw Error(where + ": 'stages' is not a list of " + std::to_string(pp) + " pp ranks' layer ranges");
  std::set<int64_t> firsts;
  for (size_t p = 0; p < stages.size(); ++p) {
    const std::string at = where + ": 'stages' pp rank " + std::to_string(p);
    if (!stages[p].is_array() || stages[p].empty()) throw Error(at + " is not a non-empty list of [first, end) layer ranges");
    l.stages.emplace_back();
    for (const auto& r : stages[p]) {
      if (!r.is_array() || r.size() != 2) throw Error(at + ": " + r.dump() + " is not a [first, end) layer range");
      const nlohmann::json pair = {{"first", r[0]}, {"end", r[1]}};
      const int64_t first = BoundedInt(pair, "first", 0, int64_t{1} << 40, at), end = BoundedInt(pair, "end", 1, int64_t{1} << 40, at);
      if (first >= end || !firsts.insert(first).second) throw Error(at + ": layer range " + r.dump() + " is empty or repeated");
      l.stages.back().push_back({first, end});
    }
  }
  if (!j.at("master_weights").is_boolean()) throw Error(where + ": 'master_weights' is " + j.at("master_weights").dump() + ", not true or false");
  l.master_weights = j.at("master_weights").get<bool>();
  const nlohmann::json& c = j.at("container");
  if (c != "pt" && c != "xser") throw Error(where + ": 'container' is " + c.dump() + ", not \"pt\" or \"xser\"");
  l.container = c == "xser" ? Container::kXser : Container::kPlainPt;
  return l;
}

}  // namespace

TensorFingerprints FingerprintsFromJson(const nlohmann::json& j, const std::string& where) try {
  if (!j.is_object()) throw Error(where + ": malformed manifest: 'tensors' is not an object");
  TensorFingerprints out;
  for (const auto& [name, fields] : j.items()) {
    if (!fields.is_object() || fields.empty()) throw Error(where + ": malformed manifest: tensor '" + name + "' has no fields");
    for (const auto& [field, f] : fields.items()) {
      const std::string at = where + ": tensor '" + name + "' " + field;
      const FileDigest d = DigestFromJson({{"size", f.at("numel")}, {"crc32", f.at("crc32")}}, at);
      if (!f.at("dtype").is_string()) throw Error(at + ": malformed dtype " + f.at("dtype").dump());
      out[name][field] = {f.at("dtype").get<std::string>(), d.size, d.crc32};
    }
  }
  return out;
} catch (const nlohmann::json::exception& e) {
  throw Error(where + ": malformed manifest 'tensors': " + JsonErrorText(e));
}

FileDigest DigestFromJson(const nlohmann::json& d, const std::string& where) try {
  if (!d.is_object()) throw Error(where + ": is " + d.dump() + ", not {\"size\", \"crc32\"}");
  const nlohmann::json& hex = d.at("crc32");
  if (!hex.is_string() || hex.get<std::string>().size() != 8 ||
      hex.get<std::string>().find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
    throw Error(where + ": malformed checksum " + hex.dump() + " (8 hex digits)");
  return FileDigest{static_cast<uint64_t>(BoundedInt(d, "size", 0, int64_t{1} << 56, where)),
                    static_cast<uint32_t>(std::stoul(hex.get<std::string>(), nullptr, 16))};
} catch (const nlohmann::json::exception& e) {
  throw Error(where + ": malformed: " + JsonErrorText(e));
}

Manifest Manifest::FromJson(const nlohmann::json& j, const std::string& source) {
  try {
    if (!j.is_object() || j.at("format") != "shardkit-checkpoint-manifest") throw Error(source + ": not a shardkit manifest");
    if (j.at("version") != 1) throw Error(source + ": unsupported manifest version " + j.at("version").dump());
    Manifest m;
    m.step = BoundedInt(j, "step", 0, std::numeric_limits<int64_t>::max(), source);
    const nlohmann::json& cs = j.at("consumed_samples");
    if (!cs.is_number() || !(cs.get<double>() >= 0) || !std::isfinite(cs.get<double>()))
      throw Error(source + ": malformed manifest: 'consumed_samples' is " + cs.dump());
    m.consumed_samples = cs.get<double>();
    const auto& g = j.at("grid");
    const std::string at = source + " grid";
    m.grid = RankGrid{static_cast<int>(BoundedInt(g, "tp", 1, kMaxRanks, at)), static_cast<int>(BoundedInt(g, "pp", 1, kMaxRanks, at)),
                      static_cast<int>(BoundedInt(g, "dp", 1, kMaxRanks, at)), g.at("zero1").get<bool>()};
    if (g.contains("ep")) m.grid.ep = static_cast<int>(BoundedInt(g, "ep", 1, kMaxRanks, at));
    if (m.grid.dp % m.grid.ep)  // ep lies inside dp (RankGrid::ep)
      throw Error(source + ": malformed manifest: grid ep=" + std::to_string(m.grid.ep) + " does not divide dp=" + std::to_string(m.grid.dp));
    const int64_t ranks = int64_t{m.grid.tp} * m.grid.pp * m.grid.dp;
    if (ranks > kMaxRanks)
      throw Error(source + ": malformed manifest: grid tp=" + std::to_string(m.grid.tp) + " pp=" + std::to_string(m.grid.pp) +
                  " dp=" + std::to_string(m.grid.dp) + " has more than " + std::to_string(kMaxRanks) + " ranks");
    m.world_size = static_cast<int>(BoundedInt(j, "world_size", 1, kMaxRanks, source));
    if (j.contains("model")) m.model = ModelFormat::FromJson(j.at("model"), source);
    if (j.contains("tensors")) m.tensors = FingerprintsFromJson(j.at("tensors"), source);
    if (j.contains("optimizer_grouping")) {
      GroupingRule r;
      if (!j.at("optimizer_grouping").is_string() || !ParseGroupingRule(j.at("optimizer_grouping").get<std::string>(), &r))
        throw Error(source + ": malformed manifest: 'optimizer_grouping' is not one of nxdt, nxdt-layer-norm-decay, name-split");
      m.optimizer_grouping = r;
    }
    if (!j.at("files").is_object()) throw Error(source + ": malformed manifest: 'files' is not an object");
    for (const auto& [p, d] : j.at("files").items()) m.files[p] = DigestFromJson(d, source + ": file '" + p + "'");
    // The files a complete tag of this grid holds must be among those listed.
    if (int64_t{m.grid.tp} * m.grid.pp > static_cast<int64_t>(m.files.size()))
      throw Error(source + ": malformed manifest: its grid tp=" + std::to_string(m.grid.tp) + " pp=" + std::to_string(m.grid.pp) +
                  " needs " + std::to_string(int64_t{m.grid.tp} * m.grid.pp) + " model files, but it lists " +
                  std::to_string(m.files.size()) + " files");
    if (j.contains("layout")) m.layout = LayoutFromJson(j.at("layout"), m.grid.pp, source);
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": malformed manifest: " + JsonErrorText(e));
  }
}

Manifest Manifest::Load(Env* env, const std::string& path) {
  auto m = env->MapFile(path);
  nlohmann::json j = ParseJsonBounded(reinterpret_cast<const char*>(m->data()), reinterpret_cast<const char*>(m->data()) + m->size(), path);
  if (j.is_discarded()) throw Error(path + ": manifest is not valid JSON");
  return FromJson(j, path);
}

void Manifest::Save(Env* env, const std::string& path) const {
  const std::string text = ToJson().dump(1) + "\n";
  WriteFileAtomically(env, path, [&](WritableFile& f) {
    f.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  });
}

}  // namespace ckpt

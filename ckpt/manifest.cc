#include "ckpt/manifest.h"

#include <xxhash.h>

#include <cstdio>

#include "ckpt/error.h"

namespace ckpt {

std::string DigestHex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t Xxh3(std::span<const uint8_t> data) { return XXH3_64bits(data.data(), data.size()); }

FileDigest DigestFile(Env* env, const std::string& path) {
  auto m = env->MapFile(path);
  return {m->size(), Xxh3(m->bytes())};
}

nlohmann::ordered_json Manifest::ToJson() const {
  nlohmann::ordered_json files_json = nlohmann::ordered_json::object();
  for (const auto& [p, d] : files) files_json[p] = {{"size", d.size}, {"xxh3", DigestHex(d.xxh3)}};
  return {{"format", "shardkit-checkpoint-manifest"},
          {"version", 1},
          {"step", step},
          {"consumed_samples", consumed_samples},
          {"grid", {{"tp", grid.tp}, {"pp", grid.pp}, {"dp", grid.dp}, {"zero1", grid.zero1}}},
          {"world_size", world_size},
          {"files", files_json}};
}

Manifest Manifest::FromJson(const nlohmann::json& j, const std::string& source) {
  try {
    if (j.at("format") != "shardkit-checkpoint-manifest") throw Error(source + ": not a shardkit manifest");
    if (j.at("version") != 1) throw Error(source + ": unsupported manifest version " + j.at("version").dump());
    Manifest m;
    m.step = j.at("step");
    m.consumed_samples = j.at("consumed_samples");
    const auto& g = j.at("grid");
    m.grid = RankGrid{g.at("tp"), g.at("pp"), g.at("dp"), g.at("zero1")};
    m.world_size = j.at("world_size");
    for (const auto& [p, d] : j.at("files").items()) {
      const std::string hex = d.at("xxh3");
      if (hex.size() != 16) throw Error(source + ": file '" + p + "' has a malformed checksum");
      m.files[p] = FileDigest{d.at("size"), std::stoull(hex, nullptr, 16)};
    }
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": malformed manifest: " + e.what());
  } catch (const std::invalid_argument&) {
    throw Error(source + ": malformed manifest checksum");
  }
}

Manifest Manifest::Load(Env* env, const std::string& path) {
  auto m = env->MapFile(path);
  nlohmann::json j = nlohmann::json::parse(m->data(), m->data() + m->size(), nullptr, false);
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

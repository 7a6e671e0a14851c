#include "ckpt/manifest.h"

#include <cstdio>

#include "ckpt/crc32.h"
#include "ckpt/error.h"

namespace ckpt {

std::string CrcHex(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

FileDigest DigestFile(Env* env, const std::string& path) {
  auto m = env->MapFile(path);
  return {m->size(), Crc32(m->bytes())};
}

nlohmann::ordered_json Manifest::ToJson() const {
  nlohmann::ordered_json files_json = nlohmann::ordered_json::object();
  for (const auto& [p, d] : files) files_json[p] = {{"size", d.size}, {"crc32", CrcHex(d.crc32)}};
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
      const std::string hex = d.at("crc32");
      if (hex.size() != 8) throw Error(source + ": file '" + p + "' has a malformed checksum");
      m.files[p] = FileDigest{d.at("size"), static_cast<uint32_t>(std::stoul(hex, nullptr, 16))};
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

// libFuzzer target for the checkpoint store's JSON parsers: manifest.json
// and the per-rank completion records. ckpt::Error is a correct rejection;
// a crash, UB, a leak, a huge allocation or any other exception is a finding.
#include <cstdint>
#include <string>

#include "ckpt/util/error.h"
#include "ckpt/store/manifest.h"
#include "ckpt/store/tag_writer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_discarded()) {
      const ckpt::Manifest m = ckpt::Manifest::FromJson(j, "fuzz/manifest.json");
      m.grid.ModelFiles();  // bounded by the files the manifest lists
      m.ToJson().dump();
    }
  } catch (const ckpt::Error&) {
  }
  try {
    ckpt::ParseRankRecord(text, "fuzz/rank_00000.json");
  } catch (const ckpt::Error&) {
  }
  return 0;
}

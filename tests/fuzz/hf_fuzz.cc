// libFuzzer target for the Hugging Face import's safetensors header parser
// (tools/hf_state.h) and the fingerprint pieces a rank record carries
// (ckpt/fingerprint.h). ckpt::Error is a correct rejection; a crash, UB, a
// leak or any other exception is a finding.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/error.h"
#include "ckpt/fingerprint.h"
#include "tools/hf_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    for (const auto& [name, e] : tools::ParseSafetensors({data, size}, "fuzz/model.safetensors"))
      if (e.end > size || e.begin > e.end) __builtin_trap();  // the parser promised the range fits
  } catch (const ckpt::Error&) {
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, false);
    if (!j.is_discarded()) {
      ckpt::FingerprintCollector c;
      c.MergeJson(j, "fuzz/rank_00000.json");
      c.Finish({{"w", ckpt::StateField::kParam, ckpt::DType::kFloat32, 16}});
    }
  } catch (const ckpt::Error&) {
  }
  return 0;
}

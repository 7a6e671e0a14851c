// libFuzzer target for the Hugging Face import's safetensors header parser
// (tools/hf_state.h), the fingerprint pieces a rank record carries
// (ckpt/shard/fingerprint.h), and the path an HDF5 export's JSON attributes take on
// import (the bounded parse, canonical JSON to a Value tree, the plain-data
// check that keeps calls out of the output, the model format), and an HF config.json. ckpt::Error is a correct rejection; a crash, UB, a
// leak or any other exception is a finding.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/util/error.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/pt/value.h"
#include "ckpt/pt/value_json.h"
#include "tools/hf_state.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    for (const auto& [name, e] : tools::ParseSafetensors({data, size}, "fuzz/model.safetensors"))
      if (e.end > size || e.begin > e.end) __builtin_trap();  // the parser promised the range fits
  } catch (const ckpt::Error&) {
  }
  try {
    const nlohmann::json j = ckpt::ParseJsonBounded(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size, "fuzz");
    if (!j.is_discarded()) {
      try {
        ckpt::RequirePlainData(ckpt::ValueFromJson(j), "fuzz/user_content.pt");
      } catch (const ckpt::Error&) {
      }
      try {
        ckpt::ModelFormat::FromJson(j, "fuzz/model");
      } catch (const ckpt::Error&) {
      }
      try {  // an HF config.json (ckpt-import, --model_config, the trainer's model.model_config), and the format it gives
        const ckpt::ModelFormat f = ckpt::FormatOfHfConfig(j, "fuzz/config.json");
        if (f.CheckSizes().empty() && f.CheckTensorParallel(1).empty()) ckpt::LogicalParameters(f, 1);
      } catch (const ckpt::Error&) {
      }
      ckpt::FingerprintCollector c;
      c.MergeJson(j, "fuzz/rank_00000.json");
      c.Finish({{"w", ckpt::StateField::kParam, ckpt::DType::kFloat32, 16}});
    }
  } catch (const ckpt::Error&) {
  }
  return 0;
}

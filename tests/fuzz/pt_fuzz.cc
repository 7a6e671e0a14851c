// libFuzzer target for the .pt readers: the whole file path (zip container,
// legacy format, pickle) and, separately, the pickle decoder on raw bytes with
// a storage resolver, so both get mutated directly. Any ckpt::Error is a
// correct rejection; crashes, leaks, UB and other exceptions are findings.
#include <cstdint>
#include <string>

#include "ckpt/util/error.h"
#include "ckpt/pt/pickle_reader.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/value_json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    ckpt::Value v = ckpt::LoadPtFromFile(ckpt::MappedFile::FromBuffer("fuzz.pt", bytes), {.verify_crc = true, .confine_to = {}});
    ckpt::ValueToJson(v, {.tensor_bytes = true});  // walk everything that loaded
  } catch (const ckpt::Error&) {
  }
  try {
    auto storage = ckpt::Storage::Allocate(64);
    ckpt::PickleSource src{"fuzz.pkl", "data.pkl", [&](const ckpt::Value&) {
                             return ckpt::Value(ckpt::StorageRef{ckpt::DType::kFloat32, storage});
                           }};
    ckpt::Value v = ckpt::Unpickle({data, size}, src);
    ckpt::ValueToJson(v, {.tensor_bytes = true});
  } catch (const ckpt::Error&) {
  }
  return 0;
}

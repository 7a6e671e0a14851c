// libFuzzer target for the xser reader (LoadXser): an X.pt reference tree and
// its X.pt.info.pt, both mutated, over tensor files that exist (tensor_<i>.pt:
// float32, shape [i + 1], i < 4). The input is a 4-byte little-endian length
// of the X.pt bytes, the X.pt bytes, then the info.pt bytes (none: no info.pt).
// Any ckpt::Error is a correct rejection; crashes, leaks, UB and other
// exceptions are findings.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "ckpt/util/error.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/tensor.h"
#include "ckpt/pt/value_json.h"
#include "ckpt/pt/xser.h"

namespace {

std::string dir;

void Write(const std::string& path, const char* data, size_t n) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data, static_cast<std::streamsize>(n));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char tmpl[] = "/tmp/xser_fuzz.XXXXXX";
  dir = ::mkdtemp(tmpl);
  std::filesystem::create_directories(dir + "/x.pt.tensors");
  for (int i = 0; i < 4; ++i) {
    ckpt::Tensor t = ckpt::Tensor::Zeros(ckpt::DType::kFloat32, {i + 1});
    ckpt::SavePt(dir + "/x.pt.tensors/tensor_" + std::to_string(i) + ".pt", ckpt::Value(t));
  }
  std::atexit([] { std::filesystem::remove_all(dir); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t n;
  std::memcpy(&n, data, 4);
  const size_t x = std::min<size_t>(n, size - 4);
  const char* bytes = reinterpret_cast<const char*>(data) + 4;
  Write(dir + "/x.pt", bytes, x);
  const std::string info = dir + "/x.pt.info.pt";
  if (size - 4 - x > 0) Write(info, bytes + x, size - 4 - x);
  else std::filesystem::remove(info);
  try {
    ckpt::LoadOptions opts;
    opts.confine_to = dir;
    ckpt::Value v = ckpt::LoadXser(dir + "/x.pt", opts);
    ckpt::ValueToJson(v, {.tensor_bytes = true});
  } catch (const ckpt::Error&) {
  }
  return 0;
}

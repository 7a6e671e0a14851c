// Test bridge between the C++ .pt library and the Python interop tests:
//   pt_canonical dump FILE             canonical JSON (with tensor bytes) of FILE
//   pt_canonical tag-file TAG REL      the same of file REL of tag TAG as the tag
//                                      readers load it (LoadTagFile: plain or xser,
//                                      an ep rank's shared xser tensors from ep_rank_00)
//   pt_canonical ep-optim TAG REL OUT  parse optim file REL of TAG as NxD's
//                                      NeuronEPZero1Optimizer state dict and write it
//                                      back to OUT (ParseEpZero1File, ToValue)
//   pt_canonical build JSON OUT [-w]   write OUT from canonical JSON
//   pt_canonical copy IN OUT [-w]      read IN, write OUT (round trip)
//   pt_canonical big OUT MIB           a file past 4 GiB: one MIB-MiB uint8 storage
//                                      (byte i = i*7 mod 251) viewed by three tensors,
//                                      then a small tensor whose record lies past 4 GiB
//   pt_canonical check-big FILE MIB    read such a file back and verify every byte
// -w: weights-only mode. Errors print on stderr and exit 1.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "ckpt/util/error.h"
#include "ckpt/pt/pt_file.h"
#include "ckpt/pt/value_json.h"
#include "ckpt/pt/xser.h"
#include "ckpt/spec/ep_zero1_state.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: pt_canonical dump FILE | build JSON OUT [-w] | copy IN OUT [-w]\n";
    return 2;
  }
  const std::string cmd = argv[1];
  const bool weights_only = argc > 4 && std::string(argv[4]) == "-w";
  try {
    if (cmd == "dump") {
      std::cout << ckpt::ValueToJson(ckpt::LoadPt(argv[2], {.verify_crc = true, .confine_to = {}}), {.tensor_bytes = true}).dump() << "\n";
    } else if (cmd == "tag-file" && argc >= 4) {
      std::cout << ckpt::ValueToJson(ckpt::LoadTagFile(ckpt::Env::Default(), argv[2], argv[3], {.verify_crc = true, .confine_to = {}}),
                                     {.tensor_bytes = true})
                       .dump()
                << "\n";
    } else if (cmd == "ep-optim" && argc >= 5) {
      const ckpt::Value file = ckpt::LoadTagFile(ckpt::Env::Default(), argv[2], argv[3], {.verify_crc = true, .confine_to = {}});
      ckpt::SavePt(argv[4], ckpt::ParseEpZero1File(file, std::string(argv[2]) + "/" + argv[3]).ToValue());
    } else if (cmd == "build" && argc >= 4) {
      std::ifstream in(argv[2]);
      ckpt::SavePt(argv[3], ckpt::ValueFromJson(nlohmann::json::parse(in)), {.weights_only = weights_only});
    } else if (cmd == "big" && argc >= 4) {
      const int64_t n = std::stoll(argv[3]) << 20;
      ckpt::Tensor all = ckpt::Tensor::Zeros(ckpt::DType::kUInt8, {n});
      uint8_t* p = all.mutable_data();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(i * 7 % 251);
      ckpt::Value root = ckpt::Value::NewDict();
      root.as_dict().Set("all", ckpt::Value(all));
      root.as_dict().Set("head", ckpt::Value(all.Narrow0(0, 16)));
      root.as_dict().Set("tail", ckpt::Value(all.Narrow0(n - 16, n)));
      ckpt::Tensor after = ckpt::Tensor::Zeros(ckpt::DType::kInt64, {4});
      for (int i = 0; i < 4; ++i) reinterpret_cast<int64_t*>(after.mutable_data())[i] = 1000 + i;
      root.as_dict().Set("after", ckpt::Value(after));
      ckpt::SavePt(argv[2], root);
    } else if (cmd == "check-big" && argc >= 4) {
      const int64_t n = std::stoll(argv[3]) << 20;
      ckpt::Value root = ckpt::LoadPt(argv[2], {.verify_crc = true, .confine_to = {}});
      const ckpt::Tensor& all = root.as_dict().At("all").as_tensor();
      if (all.numel() != n) throw ckpt::Error("size mismatch");
      const uint8_t* p = all.data();
      for (int64_t i = 0; i < n; ++i)
        if (p[i] != static_cast<uint8_t>(i * 7 % 251)) throw ckpt::Error("byte " + std::to_string(i) + " differs");
      if (root.as_dict().At("tail").as_tensor().storage() != all.storage()) throw ckpt::Error("views lost sharing");
      const auto* after = reinterpret_cast<const int64_t*>(root.as_dict().At("after").as_tensor().data());
      if (after[3] != 1003) throw ckpt::Error("tensor after 4 GiB is wrong");
      std::cout << "ok\n";
    } else if (cmd == "copy" && argc >= 4) {
      ckpt::SavePt(argv[3], ckpt::LoadPt(argv[2]), {.weights_only = weights_only});
    } else {
      std::cerr << "pt_canonical: unknown command " << cmd << "\n";
      return 2;
    }
  } catch (const std::exception& e) {
    std::cerr << "pt_canonical: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

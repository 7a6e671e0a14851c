// Test bridge between the C++ .pt library and the Python interop tests:
//   pt_canonical dump FILE             canonical JSON (with tensor bytes) of FILE
//   pt_canonical build JSON OUT [-w]   write OUT from canonical JSON
//   pt_canonical copy IN OUT [-w]      read IN, write OUT (round trip)
// -w: weights-only mode. Errors print on stderr and exit 1.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "ckpt/error.h"
#include "ckpt/pt_file.h"
#include "ckpt/value_json.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: pt_canonical dump FILE | build JSON OUT [-w] | copy IN OUT [-w]\n";
    return 2;
  }
  const std::string cmd = argv[1];
  const bool weights_only = argc > 4 && std::string(argv[4]) == "-w";
  try {
    if (cmd == "dump") {
      std::cout << ckpt::ValueToJson(ckpt::LoadPt(argv[2], {.verify_crc = true}), {.tensor_bytes = true}).dump() << "\n";
    } else if (cmd == "build" && argc >= 4) {
      std::ifstream in(argv[2]);
      ckpt::SavePt(argv[3], ckpt::ValueFromJson(nlohmann::json::parse(in)), {.weights_only = weights_only});
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

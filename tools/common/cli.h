// Command-line parsing shared by every shardkit command (CLI11): --help and
// --version exit 0; every usage error (unknown option, a value out of range,
// a missing argument) prints CLI11's message and exits 2, the code every
// command uses for bad input, instead of CLI11's own codes above 100.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <string>

#include "ckpt/util/error.h"

#define SHARDKIT_PARSE(app, argc, argv)           \
  try {                                           \
    (app).parse((argc), (argv));                  \
  } catch (const CLI::ParseError& e) {            \
    return (app).exit(e) == 0 ? 0 : 2;            \
  }

namespace ckpt {

// "512M", "2G", "300000000": bytes. Throws ckpt::Error naming `option`.
inline uint64_t ParseSize(const std::string& s, const std::string& option) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    throw ckpt::Error(option + " '" + s + "' is not a size (e.g. 512M, 2G)");
  }
  std::string unit = s.substr(used);
  double mult = 1;
  if (unit == "K" || unit == "KiB" || unit == "k") mult = 1024.0;
  else if (unit == "M" || unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") mult = 1024.0 * 1024 * 1024;
  else if (!unit.empty()) throw ckpt::Error(option + " '" + s + "': unknown unit '" + unit + "' (K, M, G)");
  if (!(v > 0) || v * mult > 1e18) throw ckpt::Error(option + " '" + s + "' is not a positive size");
  return static_cast<uint64_t>(v * mult);
}


}  // namespace ckpt

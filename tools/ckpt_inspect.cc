// ckpt-inspect PATH [--json] [--verify-crc]: lists every key of a checkpoint
// with dtype, shape and bytes for tensors and the value of everything else,
// and which rank file each entry comes from.
#include <CLI/CLI.hpp>
#include <iostream>

#include "tools/common/cli.h"
#include "ckpt/util/error.h"
#include "tools/inspect_lib.h"

int main(int argc, char** argv) {
  CLI::App app{"List the contents of a .pt/.ckpt file, an xser file, an NxDT checkpoint tag or an NNM checkpoint folder"};
  std::string path;
  bool json = false, verify = false;
  app.add_option("path", path, "file or directory")->required();
  app.add_flag("--json", json, "print the report as JSON");
  app.add_flag("--verify-crc", verify, "recompute every zip record's CRC-32");
  SHARDKIT_PARSE(app, argc, argv);
  try {
    const auto report = shardkit::Inspect(path, verify);
    if (json) std::cout << shardkit::ReportToJson(report).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    else std::cout << shardkit::ReportToText(report);
    for (const auto& p : report.problems) std::cerr << "ckpt-inspect: " << path << ": " << p << "\n";
    return report.problems.empty() ? 0 : 1;
  } catch (const ckpt::Error& e) {  // a path that is not there or not a checkpoint: bad input
    std::cerr << "ckpt-inspect: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "ckpt-inspect: " << path << ": " << e.what() << "\n";
    return 1;
  }
}

// nnm2nxdt-config [INPUT.yaml] [-o OUTPUT.yaml] [--report REPORT.json] [--env K=V]... [overrides...]
// nnm2nxdt-config --check CONFIG.yaml
// Migrates an NNM config (stdin without INPUT) to the NxDT schema, applying
// Hydra-style overrides first; writes YAML to OUTPUT (or stdout), a summary
// of every key's fate to stderr, and with --report the same as JSON.
// Exit codes: 0 done, 1 --check found problems (a migration whose output
// would not pass --check writes nothing unless --allow-incomplete), 2 bad
// input (nothing written).
#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tools/common/cli.h"
#include "ckpt/util/env.h"
#include "ckpt/util/error.h"
#include "ckpt/util/output_guard.h"
#include "migrate/check.h"
#include "migrate/migrate.h"
#include "migrate/overrides.h"

namespace {

std::string ReadInput(const std::string& path) {
  std::stringstream s;
  if (path.empty()) {
    s << std::cin.rdbuf();
  } else {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw migrate::InputError(path + ": cannot open");
    s << f.rdbuf();
  }
  return s.str();
}

std::function<void(ckpt::WritableFile&)> Text(const std::string& text) {
  return [&text](ckpt::WritableFile& f) { f.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()}); };
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Migrate NNM YAML configs to the NxDT schema, with a report of every key's fate"};
  std::vector<std::string> args, env_args;
  std::string output, report_path, check_path;
  app.add_option("args", args, "INPUT.yaml and/or Hydra overrides (key=value, +key=value, ~key)");
  app.add_option("-o,--output", output, "write the NxDT config here (default stdout)");
  app.add_option("--report", report_path, "write the report as JSON here");
  app.add_option("--env", env_args, "launch environment NNM read precision from, e.g. XLA_USE_BF16=1");
  app.add_option("--check", check_path, "validate an NxDT config instead of migrating");
  bool allow_incomplete = false;
  app.add_flag("--allow-incomplete", allow_incomplete,
               "write the migrated config even when it does not pass --check (to edit it by hand)");
  app.allow_extras(false);
  SHARDKIT_PARSE(app, argc, argv);
  try {
    if (!check_path.empty()) {
      const auto cfg = migrate::LoadYaml(ReadInput(check_path), check_path);
      const auto problems = migrate::CheckNxdt(cfg);
      for (const auto& p : problems) std::cerr << check_path << ": " << p << "\n";
      for (const auto& k : migrate::SetAtLaunch(cfg))
        std::cerr << check_path << ": " << k << ": ??? (mandatory): to be set at launch with an override (" << k << "=...)\n";
      for (const auto& p : migrate::CheckAtLaunch(cfg))
        std::cerr << check_path << ": at launch: as written, " << p
                  << "; set trainer.devices, trainer.num_nodes or the batch sizes to match when launching\n";
      if (problems.empty()) std::cerr << check_path << ": ok\n";
      return problems.empty() ? 0 : 1;
    }
    std::string input;
    std::vector<migrate::Override> overrides;
    for (const auto& a : args) {
      // Overrides have '=' or a ~/+ prefix; after the input file, anything that
      // is not a file is taken as a (malformed) override so the error says so.
      const bool looks_like_override = a.find('=') != std::string::npos || a.rfind("~", 0) == 0 || a.rfind("+", 0) == 0;
      if (looks_like_override || (!input.empty() && !std::filesystem::exists(a))) {
        overrides.push_back(migrate::ParseOverride(a));
      } else if (input.empty()) {
        input = a;
      } else {
        throw migrate::InputError("more than one input file given ('" + input + "' and '" + a + "')");
      }
    }
    // Before any work: no output may be the input (or the other output), a link or a missing folder.
    ckpt::CheckOutputs({{output, "-o"}, {report_path, "--report"}}, {{input, "input"}});
    migrate::MigrateOptions opts;
    opts.source = input.empty() ? "<stdin>" : input;
    for (const auto& e : env_args) {
      const auto eq = e.find('=');
      if (eq == std::string::npos || eq == 0) throw migrate::InputError("--env '" + e + "': expected NAME=VALUE");
      opts.env[e.substr(0, eq)] = e.substr(eq + 1);
    }
    YAML::Node nnm = migrate::LoadYaml(ReadInput(input), opts.source);
    migrate::ApplyOverrides(nnm, overrides);
    migrate::Migration m = migrate::Migrate(nnm, opts);
    for (const auto& o : overrides) m.report.overrides.push_back(o.text);
    const std::string yaml = migrate::EmitYaml(m.config);
    // YAML text may hold invalid UTF-8: replaced, never thrown.
    const std::string report = m.report.ToJson().dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (!m.report.check_problems.empty() && !allow_incomplete) {
      std::cerr << m.report.Summary();
      // The closing line names what is wrong, so the advice fits the problem (heads that do not
      // split over tp are not missing values).
      std::string named;
      for (const auto& p : m.report.check_problems) named += (named.empty() ? "" : "; ") + p;
      std::cerr << "nnm2nxdt-config: nothing was written: the migrated config does not pass --check (" << m.report.check_problems.size()
                << " problem(s): " << named << "). Change the NNM keys behind them with overrides (key=value), "
                << "or pass --allow-incomplete to write it for editing\n";
      return 2;  // bad input, as every command's
    }
    std::vector<ckpt::FileContent> files;
    if (!output.empty()) files.push_back({output, Text(yaml)});
    if (!report_path.empty()) files.push_back({report_path, Text(report)});
    ckpt::WriteFilesAtomically(ckpt::Env::Default(), files);  // both or neither
    if (output.empty()) std::cout << yaml;
    std::cerr << m.report.Summary();
    return 0;
  } catch (const std::exception& e) {  // InputError, ckpt::Error and any library's own: a message and exit 2, never an abort
    std::cerr << "nnm2nxdt-config: " << e.what() << "\n";
    return 2;
  }
}

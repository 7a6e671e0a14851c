// The NNM -> NxDT config migration. Every NNM key (after overrides) gets a
// fate in the report: kept, moved, changed (value rewritten), dropped (with
// the mapping table's reason) or unknown (kept where it was, with a
// warning); keys NxDT needs that NNM lacks are added and reported as such.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "migrate/yaml_tree.h"

namespace migrate {

struct ReportEntry {
  std::string key;    // the NNM path (the NxDT path for "added")
  std::string fate;   // kept | moved | changed | dropped | unknown | added
  std::string to;     // the NxDT path, when it has one
  std::string from_value, to_value;
  std::string reason;
};

struct Report {
  std::string source;
  std::vector<std::string> overrides;
  std::vector<ReportEntry> entries;
  std::vector<std::string> warnings;
  std::vector<std::string> check_problems;  // --check run on the output
  std::vector<std::string> set_at_launch;   // ??? values, carried over (SetAtLaunch)
  std::vector<std::string> at_launch;       // the named world's arithmetic, settled at launch (CheckAtLaunch)

  nlohmann::ordered_json ToJson() const;
  std::string Summary() const;  // the human report for stderr
};

struct MigrateOptions {
  std::string source = "<stdin>";
  // The launch environment NNM read settings from: precision (XLA_USE_BF16,
  // XLA_DOWNCAST_BF16, NEURON_RT_STOCHASTIC_ROUNDING_EN; when not given, the
  // NNM recipes' values are assumed and reported) and NxDT's runtime keys
  // (NEURON_CC_FLAGS, NEURON_RT_EXEC_TIMEOUT,
  // NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS; only when given).
  std::map<std::string, std::string> env = {};
};

struct Migration {
  YAML::Node config;
  Report report;
};

// `nnm` must already have its overrides applied. Throws InputError for an
// interpolation that points nowhere.
Migration Migrate(const YAML::Node& nnm, const MigrateOptions& opts);

}  // namespace migrate

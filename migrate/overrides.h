// Hydra-style command-line overrides, as NNM launch scripts pass them:
//   key.path=value    set an existing key (Hydra refuses unknown keys)
//   +key.path=value   add a key that does not exist yet
//   ++key.path=value  set, adding it if absent
//   ~key.path         delete a key
// Values parse as YAML flow scalars or collections ([0.9,0.95], null, True,
// '/quoted/path'). Malformed overrides raise InputError naming them.
#pragma once

#include <string>
#include <vector>

#include "migrate/yaml_tree.h"

namespace migrate {

struct Override {
  enum class Kind { kSet, kAdd, kForce, kDelete };
  Kind kind = Kind::kSet;
  std::string path;
  YAML::Node value;
  std::string text;  // as given, for messages and the report
};

Override ParseOverride(const std::string& arg);
// Applies in order; throws InputError for a set on a missing key, an add on
// an existing one, or a delete of a missing one.
void ApplyOverrides(YAML::Node root, const std::vector<Override>& overrides);

}  // namespace migrate

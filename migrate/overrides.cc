#include "migrate/overrides.h"

#include <regex>

namespace migrate {

Override ParseOverride(const std::string& arg) {
  Override o;
  o.text = arg;
  std::string rest = arg;
  if (rest.rfind("++", 0) == 0) o.kind = Override::Kind::kForce, rest = rest.substr(2);
  else if (rest.rfind("+", 0) == 0) o.kind = Override::Kind::kAdd, rest = rest.substr(1);
  else if (rest.rfind("~", 0) == 0) o.kind = Override::Kind::kDelete, rest = rest.substr(1);
  const auto eq = rest.find('=');
  o.path = rest.substr(0, eq);
  static const std::regex key(R"([A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*)");
  if (o.path.size() > 1024) throw InputError("override '" + arg.substr(0, 64) + "...': a key path of " + std::to_string(o.path.size()) +
                                             " characters (at most 1024)");
  if (!std::regex_match(o.path, key))
    throw InputError("override '" + arg + "': '" + o.path + "' is not a dotted key path (expected e.g. model.num_layers=32)");
  if (o.kind == Override::Kind::kDelete) {
    if (eq != std::string::npos) throw InputError("override '" + arg + "': a deletion (~key) takes no value");
    return o;
  }
  if (eq == std::string::npos) throw InputError("override '" + arg + "': missing '=value'");
  const std::string text = rest.substr(eq + 1);
  try {
    // A flow context parses what Hydra accepts: scalars, [a, b], {k: v}.
    YAML::Node doc = LoadYaml("v: " + (text.empty() ? std::string("''") : text), "override '" + arg + "'");
    o.value = doc["v"];
  } catch (const YamlSyntaxError& e) {  // bounds (alias bombs, depth) propagate as they are
    throw InputError("override '" + arg + "': value '" + text + "' does not parse: " + e.detail());
  }
  return o;
}

void ApplyOverrides(YAML::Node root, const std::vector<Override>& overrides) {
  for (const auto& o : overrides) {
    const bool exists = Has(root, o.path);
    switch (o.kind) {
      case Override::Kind::kSet:
        if (!exists)
          throw InputError("override '" + o.text + "': key '" + o.path + "' is not in the config (use +" + o.text + " to add it)");
        Set(root, o.path, o.value);
        break;
      case Override::Kind::kAdd:
        if (exists) throw InputError("override '" + o.text + "': key '" + o.path + "' already exists (drop the '+' to change it)");
        Set(root, o.path, o.value);
        break;
      case Override::Kind::kForce:
        Set(root, o.path, o.value);
        break;
      case Override::Kind::kDelete:
        if (!exists) throw InputError("override '" + o.text + "': key '" + o.path + "' is not in the config");
        Erase(root, o.path);
        break;
    }
  }
}

}  // namespace migrate

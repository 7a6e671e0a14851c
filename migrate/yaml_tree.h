// YAML documents as the config migration needs them, on top of yaml-cpp:
// loading that rejects duplicate keys and names file and line, dotted-path
// access that keeps key order, and an emitter that writes readable block
// YAML while keeping each scalar's meaning: quoted strings stay quoted
// ('0' stays a string), plain scalars keep their text (3e-4 stays 3e-4),
// null stays null, and flow lists stay flow lists.
#pragma once

#include <yaml-cpp/yaml.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace migrate {

// Bad input: the message names the file, line and key. Exit code 2.
class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& what) : std::runtime_error(what) {}
};

// Text that does not parse as YAML; detail() is the parser's own message.
class YamlSyntaxError : public InputError {
 public:
  YamlSyntaxError(const std::string& what, std::string detail) : InputError(what), detail_(std::move(detail)) {}
  const std::string& detail() const { return detail_; }

 private:
  std::string detail_;
};

// Parses YAML text; `source` names it in errors. The top level must be a mapping.
YAML::Node LoadYaml(const std::string& text, const std::string& source);

std::vector<std::string> SplitPath(const std::string& dotted);
std::string JoinPath(const std::vector<std::string>& parts, size_t n = std::string::npos);

// The node at `path`, or an undefined node. Never creates anything.
YAML::Node Find(const YAML::Node& root, const std::string& path);
bool Has(const YAML::Node& root, const std::string& path);
// Sets `path`, creating mappings on the way; new keys go last.
void Set(YAML::Node root, const std::string& path, const YAML::Node& value);
// Removes `path`; returns whether it existed. Empty parents stay.
bool Erase(YAML::Node root, const std::string& path);

// Every leaf (scalar, null or sequence) under `node`, as dotted paths in order.
void Leaves(const YAML::Node& node, const std::string& prefix, std::vector<std::string>* out);

// A scalar's text as written, quoted if it was quoted: for reports.
std::string Describe(const YAML::Node& n);
bool IsQuoted(const YAML::Node& n);

// What YAML 1.2's core schema reads as an integer ([+-]?digits), a float
// (digits with an optional point and exponent, .inf, .nan) or a boolean.
// Scanned by hand: std::regex recurses per character and overflows the stack
// on a long hostile scalar.
bool IsIntegerText(std::string_view s);
bool IsNumberText(std::string_view s);
bool IsBoolText(std::string_view s);

// Block-style YAML; top-level keys separated by blank lines.
std::string EmitYaml(const YAML::Node& root);

}  // namespace migrate

#include "migrate/yaml_tree.h"

#include <yaml-cpp/depthguard.h>

#include <algorithm>
#include <set>
#include <sstream>

namespace migrate {

namespace {

// Walks a freshly parsed document looking for a mapping key given twice.
void CheckDuplicates(const YAML::Node& n, const std::string& prefix, const std::string& source) {
  if (n.IsMap()) {
    std::set<std::string> seen;
    for (auto it = n.begin(); it != n.end(); ++it) {
      const std::string key = it->first.Scalar();
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      if (!seen.insert(key).second)
        throw InputError(source + ":" + std::to_string(it->first.Mark().line + 1) + ": duplicate key '" + path + "'");
      CheckDuplicates(it->second, path, source);
    }
  } else if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) CheckDuplicates(n[i], prefix + "[" + std::to_string(i) + "]", source);
  }
}

}  // namespace

namespace {

// A parsed document is a graph: an alias shares its anchor's node. Walking it
// as a tree, every later pass would expand aliases (exponentially for a
// "billion laughs" file) and never end on an alias inside its own anchor.
// So the graph is walked once here, as every later pass will see it, and
// refused past fixed bounds, which no real config comes near.
constexpr int kMaxYamlDepth = 64;
constexpr size_t kMaxYamlValues = 1 << 12;  // keys and values after alias expansion; real configs hold under 1000

void CheckBounds(const YAML::Node& n, std::vector<YAML::Node>& path, size_t& values, const std::string& source) {
  const std::string at = source + ":" + std::to_string(n.Mark().line + 1);
  for (const auto& p : path)
    if (p.is(n)) throw InputError(at + ": an alias refers to a node that contains it; such a value never ends");
  if (++values > kMaxYamlValues)
    throw InputError(source + ": more than " + std::to_string(kMaxYamlValues) +
                     " values once its aliases are expanded (an alias bomb?); refusing to expand it");
  if (static_cast<int>(path.size()) >= kMaxYamlDepth)
    throw InputError(at + ": nested more than " + std::to_string(kMaxYamlDepth) + " levels deep");
  if (!n.IsMap() && !n.IsSequence()) return;
  path.push_back(n);
  for (auto it = n.begin(); it != n.end(); ++it) {
    if (n.IsMap()) {
      CheckBounds(it->first, path, values, source);
      CheckBounds(it->second, path, values, source);
    } else {
      CheckBounds(*it, path, values, source);
    }
  }
  path.pop_back();
}

}  // namespace

YAML::Node LoadYaml(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);  // yaml-cpp >= 0.7 stops its recursive parser at 2000 levels (DepthGuard)
  } catch (const YAML::DeepRecursion& e) {
    throw InputError(source + ":" + std::to_string(e.mark.line + 1) + ": nested more than " + std::to_string(kMaxYamlDepth) +
                     " levels deep");
  } catch (const YAML::Exception& e) {
    throw YamlSyntaxError(source + ":" + std::to_string(e.mark.line + 1) + ": not valid YAML: " + e.msg, e.msg);
  }
  std::vector<YAML::Node> path;
  size_t values = 0;
  CheckBounds(root, path, values, source);
  if (!root.IsMap())
    throw InputError(source + ": the top level must be a mapping of config sections, not " +
                     (root.IsNull() ? std::string("an empty document") : root.IsSequence() ? "a list" : "a scalar"));
  CheckDuplicates(root, "", source);
  return root;
}

std::vector<std::string> SplitPath(const std::string& dotted) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : dotted) {
    if (c == '.') parts.push_back(cur), cur.clear();
    else cur.push_back(c);
  }
  parts.push_back(cur);
  return parts;
}

std::string JoinPath(const std::vector<std::string>& parts, size_t n) {
  std::string s;
  for (size_t i = 0; i < parts.size() && i < n; ++i) s += (i ? "." : "") + parts[i];
  return s;
}

YAML::Node Find(const YAML::Node& root, const std::string& path) {
  YAML::Node cur = root;
  for (const auto& p : SplitPath(path)) {
    if (!cur.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    YAML::Node next;
    bool found = false;
    for (auto it = cur.begin(); it != cur.end(); ++it)
      if (it->first.Scalar() == p) {
        next = it->second;
        found = true;
        break;
      }
    if (!found) return YAML::Node(YAML::NodeType::Undefined);
    cur.reset(next);
  }
  return cur;
}

bool Has(const YAML::Node& root, const std::string& path) { return Find(root, path).IsDefined(); }

void Set(YAML::Node root, const std::string& path, const YAML::Node& value) {
  const auto parts = SplitPath(path);
  YAML::Node cur = root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node next = cur[parts[i]];
    if (!next.IsMap()) {
      cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      next = cur[parts[i]];
    }
    cur.reset(next);
  }
  cur[parts.back()] = value;
}

bool Erase(YAML::Node root, const std::string& path) {
  const auto parts = SplitPath(path);
  YAML::Node parent = parts.size() == 1 ? root : Find(root, JoinPath(parts, parts.size() - 1));
  if (!parent.IsMap() || !Find(parent, parts.back()).IsDefined()) return false;
  parent.remove(parts.back());
  return true;
}

void Leaves(const YAML::Node& node, const std::string& prefix, std::vector<std::string>* out) {
  if (node.IsMap() && node.size() > 0) {
    for (auto it = node.begin(); it != node.end(); ++it)
      Leaves(it->second, prefix.empty() ? it->first.Scalar() : prefix + "." + it->first.Scalar(), out);
  } else {
    out->push_back(prefix);
  }
}

bool IsQuoted(const YAML::Node& n) { return n.IsScalar() && n.Tag() == "!"; }

namespace {

// Whether a plain scalar's text would be read back as the same plain text.
std::string ScalarText(const YAML::Node& n) {
  if (n.IsNull()) return "null";
  const std::string& s = n.Scalar();
  if (IsQuoted(n) || s.empty()) {  // single-quoted, '' escapes a quote
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
    return q + "'";
  }
  return s;
}

void EmitFlow(std::ostringstream& o, const YAML::Node& n) {
  if (n.IsSequence()) {
    o << "[";
    for (size_t i = 0; i < n.size(); ++i) {
      if (i) o << ", ";
      EmitFlow(o, n[i]);
    }
    o << "]";
  } else if (n.IsMap()) {
    o << "{";
    bool first = true;
    for (auto it = n.begin(); it != n.end(); ++it) {
      o << (first ? "" : ", ") << it->first.Scalar() << ": ";
      EmitFlow(o, it->second);
      first = false;
    }
    o << "}";
  } else {
    o << ScalarText(n);
  }
}

void EmitBlock(std::ostringstream& o, const YAML::Node& n, int indent);

void EmitValue(std::ostringstream& o, const YAML::Node& v, int indent) {
  if ((v.IsMap() || v.IsSequence()) && v.size() > 0 && v.Style() != YAML::EmitterStyle::Flow) {
    o << "\n";
    EmitBlock(o, v, indent + 2);
  } else if (v.IsMap() && v.size() == 0) {
    o << " {}\n";
  } else {
    o << " ";
    EmitFlow(o, v);
    o << "\n";
  }
}

void EmitBlock(std::ostringstream& o, const YAML::Node& n, int indent) {
  const std::string pad(indent, ' ');
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it) {
      if (indent == 0 && it != n.begin()) o << "\n";
      o << pad << it->first.Scalar() << ":";
      EmitValue(o, it->second, indent);
    }
  } else if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) {
      const YAML::Node item = n[i];
      if (item.IsMap() && item.size() > 0) {
        std::ostringstream inner;
        EmitBlock(inner, item, indent + 2);
        std::string s = inner.str();
        o << pad << "- " << s.substr(indent + 2);
      } else {
        o << pad << "-";
        EmitValue(o, item, indent);
      }
    }
  }
}

}  // namespace

std::string Describe(const YAML::Node& n) {
  if (!n.IsDefined()) return "<absent>";
  std::ostringstream o;
  EmitFlow(o, n);
  return o.str();
}

std::string EmitYaml(const YAML::Node& root) {
  std::ostringstream o;
  EmitBlock(o, root, 0);
  return o.str();
}

namespace {
bool Digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
std::string_view Unsigned(std::string_view s) {
  return !s.empty() && (s[0] == '+' || s[0] == '-') ? s.substr(1) : s;
}
}  // namespace

bool IsIntegerText(std::string_view s) { return Digits(Unsigned(s)); }

bool IsNumberText(std::string_view s) {
  if (s == ".nan" || s == ".NaN" || s == ".NAN" || s == "nan" || s == "NaN" || s == "NAN") return true;
  std::string_view u = Unsigned(s);
  for (std::string_view inf : {"inf", "Inf", "INF"})
    if (u == inf || (u.size() == 4 && u[0] == '.' && u.substr(1) == inf)) return true;
  const size_t e = u.find_first_of("eE");
  std::string_view mantissa = u.substr(0, e);
  if (e != std::string_view::npos && !Digits(Unsigned(u.substr(e + 1)))) return false;
  const size_t dot = mantissa.find('.');
  if (dot == std::string_view::npos) return Digits(mantissa);
  const std::string_view whole = mantissa.substr(0, dot), frac = mantissa.substr(dot + 1);
  return (Digits(whole) && (frac.empty() || Digits(frac))) || (whole.empty() && Digits(frac));
}

bool IsBoolText(std::string_view s) {
  for (std::string_view b : {"true", "True", "TRUE", "false", "False", "FALSE"})
    if (s == b) return true;
  return false;
}

}  // namespace migrate

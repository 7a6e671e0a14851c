#include "migrate/interpolation.h"

#include "migrate/yaml_tree.h"

namespace migrate {
namespace {

struct Piece {
  enum Kind { kText, kPath, kResolver } kind = kText;
  std::string text;                        // literal, path text, or resolver name
  std::vector<std::vector<Piece>> args;    // resolver arguments
};

std::string Trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::vector<Piece> Parse(const std::string& s);

// Parses the inside of ${...}.
Piece ParseInner(const std::string& inner) {
  // A resolver has a ':' outside any nested ${...}.
  int depth = 0;
  for (size_t i = 0; i < inner.size(); ++i) {
    if (inner.compare(i, 2, "${") == 0) ++depth, ++i;
    else if (inner[i] == '}') --depth;
    else if (inner[i] == ':' && depth == 0) {
      Piece p{Piece::kResolver, Trim(inner.substr(0, i)), {}};
      std::string arg;
      int d = 0;
      for (size_t j = i + 1; j < inner.size(); ++j) {
        if (inner.compare(j, 2, "${") == 0) ++d;
        if (inner[j] == '}') --d;
        if (inner[j] == ',' && d == 0) {
          p.args.push_back(Parse(Trim(arg)));
          arg.clear();
        } else {
          arg.push_back(inner[j]);
        }
      }
      p.args.push_back(Parse(Trim(arg)));
      return p;
    }
  }
  return Piece{Piece::kPath, Trim(inner), {}};
}

std::vector<Piece> Parse(const std::string& s) {
  std::vector<Piece> out;
  std::string lit;
  for (size_t i = 0; i < s.size();) {
    if (s.compare(i, 2, "${") == 0) {
      int depth = 1;
      size_t j = i + 2;
      for (; j < s.size() && depth; ++j) {
        if (s.compare(j, 2, "${") == 0) ++depth, ++j;
        else if (s[j] == '}') --depth;
      }
      if (depth) throw InputError("unbalanced interpolation in '" + s + "'");
      if (!lit.empty()) out.push_back({Piece::kText, lit, {}}), lit.clear();
      out.push_back(ParseInner(s.substr(i + 2, j - i - 3)));
      i = j;
    } else {
      lit.push_back(s[i++]);
    }
  }
  if (!lit.empty()) out.push_back({Piece::kText, lit, {}});
  return out;
}

// Absolute target of a path interpolation in the value of `key_path`.
std::string Absolute(const std::string& path, const std::string& key_path) {
  if (path.empty() || path[0] != '.') return path;
  size_t dots = 0;
  while (dots < path.size() && path[dots] == '.') ++dots;
  auto parts = SplitPath(key_path);
  parts.pop_back();  // the key's own mapping
  for (size_t i = 1; i < dots && !parts.empty(); ++i) parts.pop_back();
  const std::string base = JoinPath(parts);
  return base.empty() ? path.substr(dots) : base + "." + path.substr(dots);
}

std::string Parent(const std::string& path) {
  auto parts = SplitPath(path);
  parts.pop_back();
  return JoinPath(parts);
}

void Collect(const std::vector<Piece>& pieces, const std::string& key, std::vector<std::string>* out) {
  for (const auto& p : pieces) {
    if (p.kind == Piece::kPath) out->push_back(Absolute(p.text, key));
    for (const auto& a : p.args) Collect(a, key, out);
  }
}

std::string Render(const std::vector<Piece>& pieces, const std::string& old_key, const std::string& new_key,
                   const std::function<Relocation(const std::string&)>& relocate) {
  std::string out;
  for (const auto& p : pieces) {
    if (p.kind == Piece::kText) {
      out += p.text;
    } else if (p.kind == Piece::kPath) {
      const std::string target = Absolute(p.text, old_key);
      const Relocation r = relocate(target);
      if (!r.new_path) {
        out += r.substitute;
      } else if (p.text[0] == '.' && Parent(*r.new_path) == Parent(new_key)) {
        out += "${." + SplitPath(*r.new_path).back() + "}";
      } else {
        out += "${" + *r.new_path + "}";
      }
    } else {
      out += "${" + p.text + ":";
      for (size_t i = 0; i < p.args.size(); ++i) out += (i ? ", " : "") + Render(p.args[i], old_key, new_key, relocate);
      out += "}";
    }
  }
  return out;
}

// Evaluates ${multiply:a, b} once its arguments are numbers.
std::string EvaluateResolvers(const std::string& text) {
  std::string out = text;
  for (size_t at; (at = out.find("${multiply:")) != std::string::npos;) {
    const size_t end = out.find('}', at);
    if (end == std::string::npos) throw InputError("unbalanced resolver in '" + text + "'");
    const std::string args = out.substr(at + 11, end - at - 11);
    const size_t comma = args.find(',');
    if (comma == std::string::npos) throw InputError("multiply needs two arguments in '" + text + "'");
    const std::string a = Trim(args.substr(0, comma)), b = Trim(args.substr(comma + 1));
    std::string product;
    try {
      if (a.find_first_of(".eE") == std::string::npos && b.find_first_of(".eE") == std::string::npos)
      {
        long long p = 0;
        if (__builtin_mul_overflow(std::stoll(a), std::stoll(b), &p)) throw std::out_of_range("product");
        product = std::to_string(p);
      }
      else
        product = std::to_string(std::stod(a) * std::stod(b));
    } catch (const std::exception&) {
      throw InputError("multiply arguments '" + a + "', '" + b + "' are not numbers");
    }
    out = out.substr(0, at) + product + out.substr(end + 1);
  }
  if (out.find("${") != std::string::npos) throw InputError("unknown resolver in '" + text + "'");
  return out;
}

YAML::Node ResolveNode(const YAML::Node& root, const YAML::Node& n, const std::string& path, int depth);

// The resolved value of the node at `target`.
YAML::Node ResolveTarget(const YAML::Node& root, const std::string& target, int depth) {
  if (depth > 32) throw InputError("interpolation cycle through '" + target + "'");
  const YAML::Node t = Find(root, target);
  if (!t.IsDefined()) throw InputError("interpolation target '" + target + "' is not in the config");
  return ResolveNode(root, t, target, depth + 1);
}

YAML::Node ResolveNode(const YAML::Node& root, const YAML::Node& n, const std::string& path, int depth) {
  if (n.IsMap()) {
    YAML::Node out(YAML::NodeType::Map);
    for (auto it = n.begin(); it != n.end(); ++it)
      out[it->first.Scalar()] =
          ResolveNode(root, it->second, path.empty() ? it->first.Scalar() : path + "." + it->first.Scalar(), depth);
    return out;
  }
  if (n.IsSequence()) {
    YAML::Node out(YAML::NodeType::Sequence);
    for (size_t i = 0; i < n.size(); ++i) out.push_back(ResolveNode(root, n[i], path, depth));
    return out;
  }
  if (!n.IsScalar() || !HasInterpolation(n.Scalar())) return YAML::Clone(n);
  if (auto sole = SoleTarget(n.Scalar(), path)) return ResolveTarget(root, *sole, depth);
  const std::string spliced = RewriteInterpolations(n.Scalar(), path, path, [&](const std::string& t) {
    const YAML::Node v = ResolveTarget(root, t, depth);
    return Relocation{std::nullopt, v.IsScalar() ? v.Scalar() : Describe(v)};  // splice the text, not its quotes
  });
  YAML::Node out(EvaluateResolvers(spliced));
  out.SetTag("?");
  return out;
}

}  // namespace

YAML::Node ResolveInterpolations(const YAML::Node& root) { return ResolveNode(root, root, "", 0); }

bool HasInterpolation(const std::string& text) { return text.find("${") != std::string::npos; }

std::vector<std::string> InterpolationTargets(const std::string& text, const std::string& key_path) {
  std::vector<std::string> out;
  Collect(Parse(text), key_path, &out);
  return out;
}

std::string RewriteInterpolations(const std::string& text, const std::string& old_key, const std::string& new_key,
                                  const std::function<Relocation(const std::string&)>& relocate) {
  return Render(Parse(text), old_key, new_key, relocate);
}

std::optional<std::string> SoleTarget(const std::string& text, const std::string& key_path) {
  const auto pieces = Parse(text);
  if (pieces.size() == 1 && pieces[0].kind == Piece::kPath) return Absolute(pieces[0].text, key_path);
  return std::nullopt;
}

}  // namespace migrate

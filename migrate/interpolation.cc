#include "migrate/interpolation.h"

#include <map>
#include <set>

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

// At most 200 characters of a value for a message: an expanded value may be a megabyte.
std::string Excerpt(const std::string& text) { return text.size() <= 200 ? text : text.substr(0, 200) + "..."; }

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
        // Parsing recurses once per level: a hostile value nested 100,000 deep would overflow the stack.
        if (depth > kMaxInterpolationDepth)
          throw InputError("interpolations nested deeper than " + std::to_string(kMaxInterpolationDepth) + " levels in '" +
                           Excerpt(s) + "'");
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

// Evaluates ${multiply:a, b} once its arguments are numbers. The text is
// copied once, left to right (a megabyte value with many resolvers would
// otherwise be copied once per resolver).
std::string EvaluateResolvers(const std::string& text) {
  std::string out;
  size_t from = 0;
  for (size_t at; (at = text.find("${multiply:", from)) != std::string::npos;) {
    const size_t end = text.find('}', at);
    if (end == std::string::npos) throw InputError("unbalanced resolver in '" + Excerpt(text) + "'");
    const std::string args = text.substr(at + 11, end - at - 11);
    const size_t comma = args.find(',');
    if (comma == std::string::npos) throw InputError("multiply needs two arguments in '" + Excerpt(text) + "'");
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
      throw InputError("multiply arguments '" + Excerpt(a) + "', '" + Excerpt(b) + "' are not numbers");
    }
    out.append(text, from, at - from);
    out += product;
    from = end + 1;
  }
  out.append(text, from);
  if (out.find("${") != std::string::npos) throw InputError("unknown resolver in '" + Excerpt(text) + "'");
  return out;
}

std::string MiB(size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

// Resolves a config's interpolations, each target once (a chain of
// ${a}${a}... through many keys would otherwise be resolved exponentially
// often), counting what the expansions add against the bounds in the header.
// A resolved node may be shared by the keys that refer to it.
class Resolver {
 public:
  explicit Resolver(const YAML::Node& root) : root_(root) {}

  YAML::Node Resolve() { return Build(root_, "", 0).node; }

 private:
  struct Resolved {
    YAML::Node source;  // the node it was resolved from
    YAML::Node node;
    size_t bytes = 0;   // written out as a tree: every scalar's and key's text, plus one per mapping or sequence
  };

  // Counts bytes an interpolation at `key` adds to the config.
  void Add(size_t bytes, const std::string& key) {
    added_ += bytes;
    if (added_ > kMaxInterpolatedConfigBytes)
      throw InputError("key '" + key + "': interpolations expand the config past " + MiB(kMaxInterpolatedConfigBytes) +
                       " (the bound on all of a config's interpolations together)");
  }

  static void RequireValueBound(size_t bytes, const std::string& key) {
    if (bytes > kMaxInterpolatedValueBytes)
      throw InputError("key '" + key + "': its interpolation expands past " + MiB(kMaxInterpolatedValueBytes) +
                       " (the bound on one value)");
  }

  // The resolved value of the node at `target`, resolved once.
  const Resolved& Target(const std::string& target, int depth) {
    if (auto it = done_.find(target); it != done_.end()) return it->second;
    if (depth > kMaxInterpolationDepth || busy_.count(target)) throw InputError("interpolation cycle through '" + target + "'");
    const YAML::Node t = Find(root_, target);
    if (!t.IsDefined()) throw InputError("interpolation target '" + target + "' is not in the config");
    busy_.insert(target);
    Resolved r = Build(t, target, depth + 1);
    busy_.erase(target);
    return done_[target] = std::move(r);
  }

  Resolved Build(const YAML::Node& n, const std::string& path, int depth) {
    Resolved r{n, {}, 0};
    if (n.IsMap()) {
      r.bytes = 1;
      r.node = YAML::Node(YAML::NodeType::Map);
      for (auto it = n.begin(); it != n.end(); ++it) {
        const std::string& key = it->first.Scalar();
        const std::string child = path.empty() ? key : path + "." + key;
        // A key is resolved once, whether as a target or here. A key with a dot in
        // its name may share its path with another node: only the node at the path counts.
        const auto memo = done_.find(child);
        const bool resolved = memo != done_.end() && memo->second.source.is(it->second);
        const Resolved c = resolved ? memo->second : Build(it->second, child, depth);
        if (!resolved && Find(root_, child).is(it->second)) done_[child] = c;
        r.node[key] = c.node;
        r.bytes += key.size() + c.bytes;
      }
      return r;
    }
    if (n.IsSequence()) {
      r.node = YAML::Node(YAML::NodeType::Sequence);
      r.bytes = 1;
      for (size_t i = 0; i < n.size(); ++i) {
        const Resolved c = Build(n[i], path, depth);
        r.node.push_back(c.node);
        r.bytes += c.bytes;
      }
      return r;
    }
    if (!n.IsScalar() || !HasInterpolation(n.Scalar())) {
      r.node = YAML::Clone(n);
      if (n.IsScalar()) r.bytes += n.Scalar().size();
      return r;
    }
    std::optional<std::string> sole;
    try {
      sole = SoleTarget(n.Scalar(), path);
    } catch (const InputError& e) {
      throw InputError("key '" + path + "': " + e.what());
    }
    if (sole) {
      const Resolved& t = Target(*sole, depth);
      RequireValueBound(t.bytes, path);
      Add(t.bytes, path);
      return {n, t.node, t.bytes};
    }
    size_t spliced_bytes = 0;
    const std::string spliced = RewriteInterpolations(n.Scalar(), path, path, [&](const std::string& t) {
      const Resolved& v = Target(t, depth);
      RequireValueBound(v.bytes, path);  // before Describe writes a mapping out
      Relocation out{std::nullopt, v.node.IsScalar() ? v.node.Scalar() : Describe(v.node)};  // splice the text, not its quotes
      spliced_bytes += out.substitute.size();
      RequireValueBound(spliced_bytes, path);
      return out;
    });
    r.node = YAML::Node(EvaluateResolvers(spliced));
    r.node.SetTag("?");
    r.bytes = r.node.Scalar().size();
    RequireValueBound(r.bytes, path);
    Add(r.bytes, path);
    return r;
  }

  const YAML::Node root_;
  std::map<std::string, Resolved> done_;  // by target path
  std::set<std::string> busy_;            // targets being resolved: meeting one again is a cycle
  size_t added_ = 0;                      // bytes interpolations added so far
};

}  // namespace

YAML::Node ResolveInterpolations(const YAML::Node& root) { return Resolver(root).Resolve(); }

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

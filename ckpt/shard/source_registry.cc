#include "ckpt/shard/source_registry.h"

#include <utility>

#include "ckpt/shard/tag_source.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

std::string Joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

SourceRegistry& SourceRegistry::Default() {
  static SourceRegistry* registry = [] {
    auto* r = new SourceRegistry();  // never destroyed: entries may be used until exit
    r->Add(TagSourceKind());
    return r;
  }();
  return *registry;
}

void SourceRegistry::Add(SourceKind kind) {
  if (kind.name.empty() || !kind.detect || !kind.open) throw Error("source kind '" + kind.name + "': needs a name, a detect and an open function");
  if (Find(kind.name)) throw Error("source kind '" + kind.name + "': registered twice");
  kinds_.push_back(std::move(kind));
}

const SourceKind* SourceRegistry::Find(const std::string& name) const {
  for (const SourceKind& k : kinds_)
    if (k.name == name) return &k;
  return nullptr;
}

const SourceKind* SourceRegistry::Detect(Env* env, const std::string& path) const {
  std::vector<const SourceKind*> claimed;
  for (const SourceKind& k : kinds_)
    if (k.detect(env, path)) claimed.push_back(&k);
  if (claimed.size() > 1) {
    std::vector<std::string> names;
    for (const SourceKind* k : claimed) names.push_back(k->name);
    throw Error(path + ": could be any of these kinds of source: " + Joined(names) + "; name the kind");
  }
  return claimed.empty() ? nullptr : claimed.front();
}

OpenedSource SourceRegistry::Open(Env* env, const std::string& path, const SourceOptions& options, const std::string& kind) const {
  const SourceKind* k = kind.empty() ? Detect(env, path) : Find(kind);
  if (!k && !kind.empty()) throw Error(path + ": no reader of kind '" + kind + "' (known: " + Joined(names()) + ")");
  if (!k) throw Error(path + ": is not a checkpoint source any reader here knows (known: " + Joined(names()) + ")");
  OpenedSource s = k->open(env, path, options);
  s.kind = k->name;
  return s;
}

std::vector<std::string> SourceRegistry::names() const {
  std::vector<std::string> out;
  for (const SourceKind& k : kinds_) out.push_back(k.name);
  return out;
}

}  // namespace ckpt

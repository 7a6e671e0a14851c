// OmegaConf interpolations in config strings: ${model.encoder_seq_length}
// (absolute), ${.encoder_seq_length} (relative to the key's own mapping; each
// extra dot goes one level up) and resolvers such as
// ${multiply:${a}, ${b}} whose arguments may be interpolations themselves.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace migrate {

bool HasInterpolation(const std::string& text);

// Absolute dotted paths of every interpolation in `text`, which is the value
// of the key at `key_path`. Throws InputError on unbalanced braces.
std::vector<std::string> InterpolationTargets(const std::string& text, const std::string& key_path);

// Where an old absolute path lives now: a new absolute path, or, when the
// target was removed, the text to substitute for it.
struct Relocation {
  std::optional<std::string> new_path;
  std::string substitute;  // used when new_path is empty
};

// Rewrites `text` (the value of a key moved from `old_key` to `new_key`).
// Relative references stay relative when key and target still share a
// parent mapping; otherwise they become absolute.
std::string RewriteInterpolations(const std::string& text, const std::string& old_key, const std::string& new_key,
                                  const std::function<Relocation(const std::string&)>& relocate);

// Bounds on what interpolations may expand to. A 500-byte config of
// ${a}${a}... chains through a few keys otherwise expands to gigabytes. A
// value's expansion (its text, or the tree a sole reference brings in,
// counted as its keys' and scalars' text plus one byte per mapping or
// sequence) is at most
// kMaxInterpolatedValueBytes; all expansions of one config together at most
// kMaxInterpolatedConfigBytes. NxDT's own configs expand by a few hundred bytes.
inline constexpr size_t kMaxInterpolatedValueBytes = size_t{1} << 20;
inline constexpr size_t kMaxInterpolatedConfigBytes = size_t{4} << 20;
// References followed from one key before it is called a cycle.
inline constexpr int kMaxInterpolationDepth = 32;

// A copy of `root` with every interpolation replaced by its value: a value
// that is exactly one reference takes the target's node (and type); others
// get the target's text spliced in; ${multiply:a, b} is evaluated. Each
// target is resolved once, and keys that refer to it may share its node (the
// result is for reading). Throws InputError for a reference cycle, a missing
// target, an unknown resolver, or an expansion past the bounds above, naming
// the key.
YAML::Node ResolveInterpolations(const YAML::Node& root);

// If `text` is exactly one path interpolation, its absolute target.
std::optional<std::string> SoleTarget(const std::string& text, const std::string& key_path);

}  // namespace migrate

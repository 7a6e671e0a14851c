// Unpickle decodes a Python pickle stream (protocols 0 to 5, the whole opcode
// set) into a Value tree. Torch's reconstruction functions become tensors
// (torch._utils._rebuild_tensor, _v2, _v3, _rebuild_parameter[_with_state],
// torch._tensor._rebuild_from_type_v2), collections.OrderedDict, torch.Size,
// sets and protocol-2 bytes become their Value kinds, and any other class
// becomes an opaque Object so files full of foreign classes still load.
// Malformed input raises ckpt::Error naming the file, the record and the byte
// offset; it never crashes, and trees deeper than kMaxDepth or with reference
// cycles are rejected (checkpoints have neither).
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>

#include "ckpt/pt/value.h"

namespace ckpt {

struct PickleSource {
  std::string file;    // for error messages
  std::string record;  // e.g. "data.pkl"
  // Resolves a persistent id (torch: a storage reference) to a value.
  std::function<Value(const Value& pid)> persistent_load;
};

inline constexpr size_t kMaxPickleDepth = 1000;

// Decodes one pickle starting at bytes[0]; if `consumed` is given, it receives
// the length of the pickle (legacy .pt files hold several in a row).
Value Unpickle(std::span<const uint8_t> bytes, const PickleSource& src, size_t* consumed = nullptr);

// Calls `fn` on each direct child value of a container (sequence items, dict
// keys and values and attrs, object args, kwargs, state and items).
void ForEachChild(const Value& v, const std::function<void(const Value&)>& fn);

}  // namespace ckpt

// A canonical JSON form of a Value tree, exact enough to compare trees across
// languages: floats as their IEEE bits, big ints as two's-complement bytes,
// tensors with dtype, shape, stride, offset, storage identity (numbered in
// order of first appearance) and optionally their bytes. The interop tests
// compare this form against the one Python computes from torch objects, and
// ckpt-inspect --json uses it (without tensor bytes) for non-tensor values.
#pragma once

#include <nlohmann/json.hpp>

#include "ckpt/pt/value.h"

namespace ckpt {

struct JsonOptions {
  // Include "data" (element bytes, row-major) and "storage_hex" (whole storage) as hex.
  bool tensor_bytes = false;
};

nlohmann::ordered_json ValueToJson(const Value& v, const JsonOptions& opts = {});
// Inverse of ValueToJson with tensor_bytes; tensors sharing a storage number
// share one storage. Throws ckpt::Error on malformed input.
Value ValueFromJson(const nlohmann::json& j);

std::string HexEncode(const uint8_t* data, size_t n);

// Every JSON a file hands us is parsed through this: at most kMaxJsonDepth
// levels of nesting (as the pickle reader bounds its trees), so a hostile
// document cannot exhaust the stack of whatever walks it. Returns a discarded
// value for text that is not JSON; throws ckpt::Error naming `where` when it
// is nested too deep.
inline constexpr int kMaxJsonDepth = 1000;

// nlohmann's exception text in words for a user ("is an array where an
// object is expected", "has no key 'tp'"), without its "[json.exception...]" code.
std::string JsonErrorText(const nlohmann::json::exception& e);
nlohmann::json ParseJsonBounded(const char* begin, const char* end, const std::string& where);
inline nlohmann::json ParseJsonBounded(std::string_view text, const std::string& where) {
  return ParseJsonBounded(text.data(), text.data() + text.size(), where);
}

}  // namespace ckpt

// Value is the tree a pickle stream decodes to: Python's None, bool, int (of
// any size), float, str, bytes, list, tuple, set, dict (insertion order kept),
// plus tensors, class references (Global) and opaque objects for any class
// shardkit does not model (omegaconf containers, Lightning state, xser
// TensorReference...). Containers are held by shared_ptr, so copying a Value
// is cheap and a container referenced twice in a pickle stays one object.
// Editing the tree (rename keys, replace tensors, drop entries) copies no
// tensor data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "ckpt/pt/tensor.h"

namespace ckpt {

class Value;

// An int that does not fit int64: minimal little-endian two's complement bytes,
// the encoding of pickle's LONG1/LONG4.
struct BigInt {
  std::string le_bytes;
  bool operator==(const BigInt&) const = default;
};
struct Str {
  std::string utf8;
  bool operator==(const Str&) const = default;
};
struct Bytes {
  std::string data;
  bool operator==(const Bytes&) const = default;
};
// A reference to a Python global: a class or function such as torch.float32.
struct Global {
  std::string module, name;
  std::string full() const { return module + "." + name; }
  bool operator==(const Global&) const = default;
};
// A torch storage pickled on its own (not through a tensor).
struct StorageRef {
  DType dtype;
  std::shared_ptr<Storage> storage;
};

enum class SeqKind { kList, kTuple, kSet, kFrozenSet, kTorchSize };
struct Sequence {
  SeqKind kind;
  std::vector<Value> items;
};

struct Dict {
  std::vector<std::pair<Value, Value>> items;
  // collections.OrderedDict rather than dict.
  bool ordered = false;
  // State set on an OrderedDict by BUILD (module state dicts carry _metadata).
  std::shared_ptr<Value> attrs;

  // Lookup by string key; nullptr when absent.
  Value* Find(std::string_view key);
  const Value* Find(std::string_view key) const;
  // Throws ckpt::Error naming the key when absent.
  const Value& At(std::string_view key) const;
  // Sets (or appends) a string key.
  void Set(std::string_view key, Value v);
  bool Erase(std::string_view key);
  bool Rename(std::string_view from, std::string_view to);
};

// An instance of a class shardkit does not model, kept so it round-trips:
// built as `cls(*args)` (REDUCE) or `cls.__new__(cls, *args)` (NEWOBJ), then
// list/dict items appended, then `state` applied (BUILD).
struct Object {
  enum class Build { kReduce, kNewObj, kNewObjEx };
  Global cls;
  Build how = Build::kReduce;
  std::shared_ptr<Value> args;    // a tuple
  std::shared_ptr<Value> kwargs;  // NEWOBJ_EX only
  std::shared_ptr<Value> state;   // null when there was no BUILD
  std::vector<Value> list_items;
  std::vector<std::pair<Value, Value>> dict_items;
};

class Value {
 public:
  using Storage = std::variant<std::monostate, bool, int64_t, BigInt, double, Str, Bytes,
                               std::shared_ptr<Sequence>, std::shared_ptr<Dict>, Tensor, Global,
                               std::shared_ptr<Object>, StorageRef>;

  Value() = default;
  Value(bool b) : v_(b) {}
  Value(int v) : v_(int64_t{v}) {}
  Value(int64_t v) : v_(v) {}
  Value(double v) : v_(v) {}
  Value(const char* s) : v_(Str{s}) {}
  Value(std::string s) : v_(Str{std::move(s)}) {}
  Value(BigInt v) : v_(std::move(v)) {}
  Value(Str v) : v_(std::move(v)) {}
  Value(Bytes v) : v_(std::move(v)) {}
  Value(Tensor t) : v_(std::move(t)) {}
  Value(Global g) : v_(std::move(g)) {}
  Value(StorageRef s) : v_(std::move(s)) {}
  Value(std::shared_ptr<Sequence> s) : v_(std::move(s)) {}
  Value(std::shared_ptr<Dict> d) : v_(std::move(d)) {}
  Value(std::shared_ptr<Object> o) : v_(std::move(o)) {}

  static Value NewDict(bool ordered = false);
  static Value NewSeq(SeqKind kind, std::vector<Value> items = {});
  static Value List(std::vector<Value> items = {}) { return NewSeq(SeqKind::kList, std::move(items)); }
  static Value Tuple(std::vector<Value> items = {}) { return NewSeq(SeqKind::kTuple, std::move(items)); }

  bool is_none() const { return std::holds_alternative<std::monostate>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<int64_t>(v_); }
  bool is_bigint() const { return std::holds_alternative<BigInt>(v_); }
  bool is_float() const { return std::holds_alternative<double>(v_); }
  bool is_str() const { return std::holds_alternative<Str>(v_); }
  bool is_bytes() const { return std::holds_alternative<Bytes>(v_); }
  bool is_seq() const { return std::holds_alternative<std::shared_ptr<Sequence>>(v_); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<Dict>>(v_); }
  bool is_tensor() const { return std::holds_alternative<Tensor>(v_); }
  bool is_global() const { return std::holds_alternative<Global>(v_); }
  bool is_object() const { return std::holds_alternative<std::shared_ptr<Object>>(v_); }
  bool is_storage() const { return std::holds_alternative<StorageRef>(v_); }

  // Accessors throw ckpt::Error naming the expected and actual kind.
  bool as_bool() const;
  int64_t as_int() const;
  double as_float() const;  // ints are widened
  const std::string& as_str() const;
  const std::string& as_bytes() const;
  Sequence& as_seq() const;
  Dict& as_dict() const;
  const Tensor& as_tensor() const;
  Tensor& as_tensor();
  const Global& as_global() const;
  Object& as_object() const;
  const StorageRef& as_storage() const;

  // "dict", "tensor", "object collections.X", ...: for error messages.
  std::string kind_name() const;

  const Storage& raw() const { return v_; }

 private:
  Storage v_;
};

// Deep structural equality: tensors compare by dtype, shape and element
// bytes (not strides or sharing); floats compare bitwise.
bool DeepEqual(const Value& a, const Value& b);

// Where a value sits inside a file's content, for error messages: "<root>",
// or "/state/0/exp_avg" from the keys and indices walked to reach it.
std::string ValuePathString(const std::vector<std::string>& parts);

// Calls `f` on every tensor in `v`, depth first (dict values, sequence items), in order.
void ForEachTensor(const Value& v, const std::function<void(const Tensor&)>& f);

// A number held as a Python int or float, or as a one-element float32 or
// int64 tensor (torch >= 1.12 keeps optimizer `step` that way). Throws
// ckpt::Error naming the kind for anything else.
double AsScalar(const Value& v);

// An integer held as a Python int or as a one-element integral tensor;
// throws ckpt::Error starting with `what` for anything else.
int64_t AsInteger(const Value& v, const std::string& what);

// Checks that a tree is data a checkpoint holds and nothing that runs on
// load: None, bools, numbers, strings, bytes, lists, tuples, sets, dicts,
// OrderedDicts, torch.Size, tensors and torch dtypes. Any other object or
// global (a class, a function such as os.system) throws ckpt::Error naming
// `where`, the key path and the class: written back as a pickle it would be
// called by torch.load. Used wherever a tree comes from somewhere other than
// a torch checkpoint the user already loads (an HDF5 attribute, JSON).
void RequirePlainData(const Value& v, const std::string& where);

}  // namespace ckpt

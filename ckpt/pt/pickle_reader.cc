#include "ckpt/pt/pickle_reader.h"

#include <cmath>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/util/error.h"

namespace ckpt {

// The slots holding a container's children. They live behind the value's
// shared pointers, so a const handle still reaches them: the unpickler's
// shape check replaces one in place.
void ForEachChildSlot(const Value& v, const std::function<void(Value&)>& fn) {
  if (v.is_seq()) {
    for (Value& c : v.as_seq().items) fn(c);
  } else if (v.is_dict()) {
    Dict& d = v.as_dict();
    for (auto& [k, c] : d.items) fn(k), fn(c);
    if (d.attrs) fn(*d.attrs);
  } else if (v.is_object()) {
    Object& o = v.as_object();
    for (auto* p : {&o.args, &o.kwargs, &o.state})
      if (*p) fn(**p);
    for (Value& c : o.list_items) fn(c);
    for (auto& [k, c] : o.dict_items) fn(k), fn(c);
  }
}

void ForEachChild(const Value& v, const std::function<void(const Value&)>& fn) {
  ForEachChildSlot(v, [&](Value& c) { fn(c); });
}

namespace {

const void* ContainerId(const Value& v) {
  if (v.is_seq()) return &v.as_seq();
  if (v.is_dict()) return &v.as_dict();
  if (v.is_object()) return &v.as_object();
  return nullptr;
}

// Visits every container reachable from `roots` once, iteratively (no
// recursion on hostile depth), skipping ids already in `seen`.
void VisitContainers(std::vector<Value> todo, std::unordered_set<const void*>& seen,
                     const std::function<void(Value&&)>& visit) {
  while (!todo.empty()) {
    Value v = std::move(todo.back());
    todo.pop_back();
    const void* id = ContainerId(v);
    if (!id || !seen.insert(id).second) continue;
    ForEachChild(v, [&](const Value& c) { todo.push_back(c); });
    visit(std::move(v));
  }
}

// The ids of every container reachable from `root`.
std::unordered_set<const void*> Reachable(const Value& root) {
  std::unordered_set<const void*> seen;
  VisitContainers({root}, seen, [](Value&&) {});
  return seen;
}

// Empties every container reachable from `roots` except those in `keep`,
// so that destroying a hostile (deep or cyclic) tree neither overflows nor leaks.
void Dismantle(const std::vector<Value>& roots, std::unordered_set<const void*> keep = {}) {
  std::vector<Value> all;
  VisitContainers(roots, keep, [&](Value&& v) { all.push_back(std::move(v)); });
  for (Value& v : all) {
    if (v.is_seq()) v.as_seq().items.clear();
    else if (v.is_dict()) v.as_dict().items.clear(), v.as_dict().attrs.reset();
    else if (v.is_object()) {
      Object& o = v.as_object();
      o.args.reset(), o.kwargs.reset(), o.state.reset(), o.list_items.clear(), o.dict_items.clear();
    }
  }
}

// Rejects trees deeper than kMaxPickleDepth and cuts reference cycles, so
// recursive walkers downstream are safe. A back-reference to a container
// still being walked (omegaconf's DictConfig pickles each child with a
// `_parent` pointing back up, and Lightning checkpoints hold one under
// hyper_parameters) becomes None: nothing shardkit reads follows it.
// Iterative DFS with colours.
void CheckShape(Value& root) {
  struct Frame {
    const void* id;
    std::vector<Value*> children;
    size_t next = 0;
  };
  std::unordered_map<const void*, bool> state;  // false: on the path, true: done
  std::vector<Frame> path;
  auto push = [&](Value& v) {
    const void* id = ContainerId(v);
    if (!id) return;
    auto it = state.find(id);
    if (it != state.end()) {
      if (!it->second) v = Value();  // closes a cycle: cut it here
      return;
    }
    if (path.size() >= kMaxPickleDepth)
      throw Error("pickle nests deeper than " + std::to_string(kMaxPickleDepth) + " levels");
    state[id] = false;
    Frame f{id, {}, 0};
    ForEachChildSlot(v, [&](Value& c) { f.children.push_back(&c); });
    path.push_back(std::move(f));
  };
  push(root);
  while (!path.empty()) {
    Frame& top = path.back();
    if (top.next < top.children.size()) {
      Value* child = top.children[top.next++];
      push(*child);
    } else {
      state[top.id] = true;
      path.pop_back();
    }
  }
}

// Minimal two's-complement little-endian bytes -> int64 or BigInt.
Value IntFromLe(std::string b) {
  while (b.size() > 1) {
    const uint8_t last = b.back(), prev = b[b.size() - 2];
    if ((last == 0 && !(prev & 0x80)) || (last == 0xff && (prev & 0x80))) b.pop_back();
    else break;
  }
  if (b.empty()) return Value(int64_t{0});
  if (b.size() <= 8) {
    uint64_t u = 0;
    for (size_t i = b.size(); i-- > 0;) u = (u << 8) | static_cast<uint8_t>(b[i]);
    if (b.size() < 8 && (static_cast<uint8_t>(b.back()) & 0x80)) u |= ~uint64_t{0} << (8 * b.size());
    return Value(static_cast<int64_t>(u));
  }
  return Value(BigInt{std::move(b)});
}

// Decimal text (optional sign, optional trailing L) -> int.
Value IntFromDecimal(std::string_view s) {
  if (!s.empty() && s.back() == 'L') s.remove_suffix(1);
  bool neg = false;
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) neg = s[0] == '-', s.remove_prefix(1);
  if (s.empty()) throw Error("empty integer literal");
  std::vector<uint8_t> mag{0};  // little-endian magnitude
  for (char c : s) {
    if (c < '0' || c > '9') throw Error("bad integer literal '" + std::string(s) + "'");
    unsigned carry = static_cast<unsigned>(c - '0');
    for (auto& byte : mag) {
      unsigned v = byte * 10u + carry;
      byte = static_cast<uint8_t>(v);
      carry = v >> 8;
    }
    if (carry) mag.push_back(static_cast<uint8_t>(carry));
  }
  mag.push_back(0);  // room for the sign bit
  if (neg) {         // two's complement
    unsigned carry = 1;
    for (auto& byte : mag) {
      unsigned v = static_cast<uint8_t>(~byte) + carry;
      byte = static_cast<uint8_t>(v);
      carry = v >> 8;
    }
  }
  return IntFromLe(std::string(mag.begin(), mag.end()));
}

// UTF-8 -> latin-1 (protocol-2 bytes travel as _codecs.encode(str, 'latin1')).
std::string Latin1FromUtf8(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t c = s[i];
    if (c < 0x80) out.push_back(static_cast<char>(c));
    else if ((c & 0xe0) == 0xc0 && i + 1 < s.size() && c <= 0xc3)
      out.push_back(static_cast<char>(((c & 0x1f) << 6) | (static_cast<uint8_t>(s[++i]) & 0x3f)));
    else throw Error("_codecs.encode argument is not latin-1");
  }
  return out;
}

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) out.push_back(static_cast<char>(cp));
  else if (cp < 0x800) out += {static_cast<char>(0xc0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3f))};
  else if (cp < 0x10000)
    out += {static_cast<char>(0xe0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3f)),
            static_cast<char>(0x80 | (cp & 0x3f))};
  else
    out += {static_cast<char>(0xf0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3f)),
            static_cast<char>(0x80 | ((cp >> 6) & 0x3f)), static_cast<char>(0x80 | (cp & 0x3f))};
}

uint32_t Hex(std::string_view s) {
  uint32_t v = 0;
  for (char c : s) {
    v <<= 4;
    if (c >= '0' && c <= '9') v |= c - '0';
    else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
    else throw Error("bad hex escape");
  }
  return v;
}

// Protocol-0 STRING: a quoted Python literal with backslash escapes.
std::string UnquoteString(std::string_view s) {
  if (s.size() < 2 || (s.front() != '\'' && s.front() != '"') || s.back() != s.front())
    throw Error("STRING argument is not quoted");
  s = s.substr(1, s.size() - 2);
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out.push_back(s[i]);
      continue;
    }
    const char e = s[++i];
    switch (e) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case '0': case '1': case '2': case '3': case '4': case '5': case '6': case '7': {
        unsigned v = 0;
        size_t n = 0;
        while (n < 3 && i < s.size() && s[i] >= '0' && s[i] <= '7') v = v * 8 + (s[i++] - '0'), ++n;
        --i;
        out.push_back(static_cast<char>(v));
        break;
      }
      case 'x':
        if (i + 2 >= s.size()) throw Error("bad \\x escape");
        out.push_back(static_cast<char>(Hex(s.substr(i + 1, 2))));
        i += 2;
        break;
      default: out.push_back(e);
    }
  }
  return out;
}

// Protocol-0 UNICODE: raw-unicode-escape (\uXXXX, \UXXXXXXXX; other bytes latin-1).
std::string RawUnicodeEscape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size() && (s[i + 1] == 'u' || s[i + 1] == 'U')) {
      const size_t n = s[i + 1] == 'u' ? 4 : 8;
      if (i + 2 + n > s.size()) throw Error("bad \\u escape in UNICODE");
      AppendUtf8(out, Hex(s.substr(i + 2, n)));
      i += 1 + n;
    } else {
      AppendUtf8(out, static_cast<uint8_t>(s[i]));
    }
  }
  return out;
}

std::vector<int64_t> IntTuple(const Value& v, const char* what) {
  std::vector<int64_t> out;
  for (const Value& x : v.as_seq().items) {
    if (!x.is_int()) throw Error(std::string("tensor ") + what + " holds a " + x.kind_name());
    out.push_back(x.as_int());
  }
  return out;
}

const std::vector<Value>& Args(const Value& args, size_t min, const std::string& fn) {
  if (!args.is_seq() || args.as_seq().kind != SeqKind::kTuple) throw Error(fn + " called with non-tuple arguments");
  const auto& a = args.as_seq().items;
  if (a.size() < min) throw Error(fn + " called with " + std::to_string(a.size()) + " arguments, needs " + std::to_string(min));
  return a;
}

Value RebuildTensor(const std::vector<Value>& a, std::optional<DType> dtype) {
  if (!a[0].is_storage()) throw Error("tensor rebuilt from a " + a[0].kind_name() + ", not a storage");
  const StorageRef& s = a[0].as_storage();
  Tensor t(dtype.value_or(s.dtype), IntTuple(a[2], "size"), IntTuple(a[3], "stride"), a[1].as_int(), s.storage);
  if (a.size() > 4 && a[4].is_bool()) t.set_requires_grad(a[4].as_bool());
  return Value(std::move(t));
}

Value DictFromPairs(const Value& pairs) {
  Value d = Value::NewDict(true);
  for (const Value& p : pairs.as_seq().items) {
    const auto& kv = p.as_seq().items;
    if (kv.size() != 2) throw Error("OrderedDict item is not a pair");
    d.as_dict().items.emplace_back(kv[0], kv[1]);
  }
  return d;
}

// REDUCE: calls a global with a tuple of arguments.
Value Call(const Global& g, const Value& args) {
  const std::string f = g.full();
  if (f == "torch._utils._rebuild_tensor_v2") return RebuildTensor(Args(args, 4, f), std::nullopt);
  if (f == "torch._utils._rebuild_tensor") return RebuildTensor(Args(args, 4, f), std::nullopt);
  if (f == "torch._utils._rebuild_tensor_v3") {
    const auto& a = Args(args, 7, f);
    if (!a[6].is_global()) throw Error(f + ": dtype argument is a " + a[6].kind_name());
    auto dt = DTypeFromName(a[6].as_global().name);
    if (!dt) throw Error(f + ": unsupported dtype " + a[6].as_global().full());
    return RebuildTensor(a, dt);
  }
  if (f == "torch._utils._rebuild_parameter" || f == "torch._utils._rebuild_parameter_with_state") {
    const auto& a = Args(args, 2, f);
    Value t = a[0];
    t.as_tensor().set_parameter(true);
    t.as_tensor().set_requires_grad(a[1].as_bool());
    return t;
  }
  if (f == "torch._tensor._rebuild_from_type_v2") {
    const auto& a = Args(args, 3, f);
    if (!a[0].is_global()) throw Error(f + ": function argument is a " + a[0].kind_name());
    Value t = Call(a[0].as_global(), a[2]);
    if (t.is_tensor() && a[1].is_global() && a[1].as_global().full() == "torch.nn.parameter.Parameter")
      t.as_tensor().set_parameter(true);
    return t;
  }
  if (f == "collections.OrderedDict") {
    const auto& a = Args(args, 0, f);
    return a.empty() ? Value::NewDict(true) : DictFromPairs(a[0]);
  }
  if (f == "torch.Size") {
    const auto& a = Args(args, 0, f);
    return Value::NewSeq(SeqKind::kTorchSize, a.empty() ? std::vector<Value>{} : a[0].as_seq().items);
  }
  if (f == "_codecs.encode") {
    const auto& a = Args(args, 1, f);
    return Value(Bytes{Latin1FromUtf8(a[0].as_str())});
  }
  if (f == "builtins.bytes" || f == "builtins.bytearray") {
    const auto& a = Args(args, 0, f);
    if (a.empty()) return Value(Bytes{});
    if (a[0].is_bytes()) return a[0];
    if (a[0].is_str() && a.size() > 1) return Value(Bytes{Latin1FromUtf8(a[0].as_str())});
  }
  if (f == "builtins.set" || f == "builtins.frozenset") {
    const auto& a = Args(args, 0, f);
    const SeqKind k = g.name == "set" ? SeqKind::kSet : SeqKind::kFrozenSet;
    return Value::NewSeq(k, a.empty() ? std::vector<Value>{} : a[0].as_seq().items);
  }
  auto o = std::make_shared<Object>();
  o->cls = g;
  o->how = Object::Build::kReduce;
  o->args = std::make_shared<Value>(args);
  return Value(std::move(o));
}

class Unpickler {
 public:
  Unpickler(std::span<const uint8_t> b, const PickleSource& src) : b_(b), src_(src) {}

  Value Run(size_t* consumed) {
    try {
      Value v = Loop();
      if (consumed) *consumed = pos_;
      pending_.push_back(v);  // torn down with the rest if the shape check fails
      CheckShape(v);
      pending_.pop_back();
      Cleanup(Reachable(v));  // garbage the result does not reach
      return v;
    } catch (const Error& e) {
      Cleanup();
      throw Error(src_.file + ": " + src_.record + ": byte " + std::to_string(op_pos_) + ": " + e.what());
    } catch (const std::bad_alloc&) {
      Cleanup();
      throw Error(src_.file + ": " + src_.record + ": out of memory decoding the pickle");
    }
  }

 private:
  void Cleanup(std::unordered_set<const void*> keep = {}) {
    std::vector<Value> roots = std::move(stack_);
    for (auto& [k, v] : memo_) roots.push_back(std::move(v));
    memo_.clear();
    for (auto& v : pending_) roots.push_back(std::move(v));
    pending_.clear();
    Dismantle(roots, std::move(keep));
  }

  std::span<const uint8_t> Take(uint64_t n) {
    if (n > b_.size() - pos_) throw Error("pickle is truncated (wanted " + std::to_string(n) + " bytes, " +
                                          std::to_string(b_.size() - pos_) + " left)");
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  uint64_t Uint(int n) {
    auto s = Take(n);
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | s[i];
    return v;
  }
  std::string Str(uint64_t n) {
    auto s = Take(n);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }
  std::string Line() {
    for (size_t i = pos_; i < b_.size(); ++i)
      if (b_[i] == '\n') {
        std::string s(reinterpret_cast<const char*>(&b_[pos_]), i - pos_);
        pos_ = i + 1;
        if (!s.empty() && s.back() == '\r') s.pop_back();
        return s;
      }
    throw Error("pickle is truncated (unterminated text argument)");
  }

  Value Pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
      throw Error("stack underflow");
    Value v = std::move(stack_.back());
    stack_.pop_back();
    pending_.push_back(v);  // kept reachable for Cleanup until the op ends
    return v;
  }
  Value& Top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) throw Error("stack underflow");
    return stack_.back();
  }
  std::vector<Value> PopMark() {
    if (marks_.empty()) throw Error("stack underflow: no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value> items(std::make_move_iterator(stack_.begin() + m), std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    pending_.insert(pending_.end(), items.begin(), items.end());
    return items;
  }
  void Push(Value v) { stack_.push_back(std::move(v)); }

  void Memo(uint64_t idx) { memo_[idx] = Top(); }
  Value Get(uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) throw Error("memo key " + std::to_string(idx) + " was never stored");
    return it->second;
  }

  static Global MakeGlobal(std::string module, std::string name) {
    // Python 2 module names, mapped as Python 3's unpickler does (fix_imports).
    if (module == "__builtin__") module = "builtins";
    else if (module == "copy_reg") module = "copyreg";
    return Global{std::move(module), std::move(name)};
  }

  void Append(Value& target, std::vector<Value> items) {
    if (target.is_seq() && (target.as_seq().kind == SeqKind::kList || target.as_seq().kind == SeqKind::kSet)) {
      auto& dst = target.as_seq().items;
      dst.insert(dst.end(), items.begin(), items.end());
    } else if (target.is_object()) {
      auto& dst = target.as_object().list_items;
      dst.insert(dst.end(), items.begin(), items.end());
    } else {
      throw Error("APPEND to a " + target.kind_name());
    }
  }

  void SetItems(Value& target, std::vector<Value> kv) {
    if (kv.size() % 2) throw Error("SETITEMS with an odd number of values");
    if (target.is_object()) {
      auto& dst = target.as_object().dict_items;
      for (size_t i = 0; i < kv.size(); i += 2) dst.emplace_back(std::move(kv[i]), std::move(kv[i + 1]));
      return;
    }
    if (!target.is_dict()) throw Error("SETITEM on a " + target.kind_name());
    // A repeated key replaces the value, as in Python; indexed so big dicts stay linear.
    Dict& d = target.as_dict();
    auto& index = key_index_[&d];
    for (size_t i = 0; i < kv.size(); i += 2) {
      std::string key;
      if (kv[i].is_str()) key = "s" + kv[i].as_str();
      else if (kv[i].is_int()) key = "i" + std::to_string(kv[i].as_int());
      if (!key.empty()) {
        auto [it, fresh] = index.emplace(std::move(key), d.items.size());
        if (!fresh) {
          d.items[it->second].second = std::move(kv[i + 1]);
          continue;
        }
      }
      d.items.emplace_back(std::move(kv[i]), std::move(kv[i + 1]));
    }
  }

  void Build(Value& target, Value state) {
    if (target.is_object()) target.as_object().state = std::make_shared<Value>(std::move(state));
    else if (target.is_dict() && target.as_dict().ordered) target.as_dict().attrs = std::make_shared<Value>(std::move(state));
    else if (target.is_tensor()) {
    }  // tensor __setstate__ (hooks, subclass state): not modelled
    else throw Error("BUILD on a " + target.kind_name());
  }

  Value NewObject(const Value& cls, Value args, Value kwargs, Object::Build how) {
    if (!cls.is_global()) throw Error("NEWOBJ on a " + cls.kind_name() + ", not a class");
    if (cls.as_global().full() == "collections.OrderedDict") return Value::NewDict(true);
    auto o = std::make_shared<Object>();
    o->cls = cls.as_global();
    o->how = how;
    o->args = std::make_shared<Value>(std::move(args));
    if (!kwargs.is_none()) o->kwargs = std::make_shared<Value>(std::move(kwargs));
    return Value(std::move(o));
  }

  Value Loop() {
    while (true) {
      pending_.clear();
      op_pos_ = pos_;
      const uint8_t op = static_cast<uint8_t>(Uint(1));
      switch (op) {
        case 0x80: {  // PROTO
          const uint64_t p = Uint(1);
          if (p > 5) throw Error("unsupported pickle protocol " + std::to_string(p));
          break;
        }
        case 0x95: Uint(8); break;  // FRAME: framing is advisory
        case '.': {                 // STOP
          if (stack_.size() != 1 || !marks_.empty())
            throw Error("STOP with " + std::to_string(stack_.size()) + " values on the stack");
          Value v = std::move(stack_.back());
          stack_.clear();
          return v;
        }
        case '(': marks_.push_back(stack_.size()); break;
        case '0': Pop(); break;
        case '1': PopMark(); break;
        case '2': Push(Top()); break;
        // Scalars.
        case 'N': Push(Value()); break;
        case 0x88: Push(Value(true)); break;
        case 0x89: Push(Value(false)); break;
        case 'K': Push(Value(static_cast<int64_t>(Uint(1)))); break;
        case 'M': Push(Value(static_cast<int64_t>(Uint(2)))); break;
        case 'J': Push(Value(static_cast<int64_t>(static_cast<int32_t>(Uint(4))))); break;
        case 0x8a: Push(IntFromLe(Str(Uint(1)))); break;
        case 0x8b: {
          const int64_t n = static_cast<int32_t>(Uint(4));
          if (n < 0) throw Error("LONG4 with negative length");
          Push(IntFromLe(Str(n)));
          break;
        }
        case 'I': {
          const std::string s = Line();
          if (s == "01") Push(Value(true));
          else if (s == "00") Push(Value(false));
          else Push(IntFromDecimal(s));
          break;
        }
        case 'L': Push(IntFromDecimal(Line())); break;
        case 'G': {
          uint64_t bits = 0;
          for (uint8_t c : Take(8)) bits = (bits << 8) | c;  // big-endian
          double d;
          std::memcpy(&d, &bits, 8);
          Push(Value(d));
          break;
        }
        case 'F': {
          const std::string s = Line();
          char* end = nullptr;
          const double d = std::strtod(s.c_str(), &end);
          if (s.empty() || *end) throw Error("bad FLOAT literal '" + s + "'");
          Push(Value(d));
          break;
        }
        // Strings and bytes.
        case 'X': Push(Value(Str(Uint(4)))); break;
        case 0x8c: Push(Value(Str(Uint(1)))); break;
        case 0x8d: Push(Value(Str(Uint(8)))); break;
        case 'V': Push(Value(RawUnicodeEscape(Line()))); break;
        case 'S': Push(Value(UnquoteString(Line()))); break;
        case 'T': Push(Value(Str(Uint(4)))); break;
        case 'U': Push(Value(Str(Uint(1)))); break;
        case 'B': Push(Value(Bytes{Str(Uint(4))})); break;
        case 'C': Push(Value(Bytes{Str(Uint(1))})); break;
        case 0x8e: Push(Value(Bytes{Str(Uint(8))})); break;
        case 0x96: Push(Value(Bytes{Str(Uint(8))})); break;
        case 0x97: throw Error("NEXT_BUFFER: out-of-band buffers are not supported in files");
        case 0x98: Top(); break;  // READONLY_BUFFER
        // Containers.
        case ']': Push(Value::List()); break;
        case ')': Push(Value::Tuple()); break;
        case '}': Push(Value::NewDict()); break;
        case 0x8f: Push(Value::NewSeq(SeqKind::kSet)); break;
        case 'l': Push(Value::List(PopMark())); break;
        case 't': Push(Value::Tuple(PopMark())); break;
        case 0x91: Push(Value::NewSeq(SeqKind::kFrozenSet, PopMark())); break;
        case 0x85: case 0x86: case 0x87: {
          std::vector<Value> items(op - 0x84);
          for (size_t i = items.size(); i-- > 0;) items[i] = Pop();
          Push(Value::Tuple(std::move(items)));
          break;
        }
        case 'd': {
          Value d = Value::NewDict();
          SetItems(d, PopMark());
          Push(std::move(d));
          break;
        }
        case 'a': {
          Value v = Pop();
          Append(Top(), {std::move(v)});
          break;
        }
        case 'e': case 0x90: {
          auto items = PopMark();
          Append(Top(), std::move(items));
          break;
        }
        case 's': {
          Value v = Pop(), k = Pop();
          SetItems(Top(), {std::move(k), std::move(v)});
          break;
        }
        case 'u': {
          auto kv = PopMark();
          SetItems(Top(), std::move(kv));
          break;
        }
        // Memo.
        case 'p': {
          const std::string s = Line();
          char* end = nullptr;
          const unsigned long long idx = std::strtoull(s.c_str(), &end, 10);
          if (s.empty() || *end) throw Error("bad PUT index '" + s + "'");
          Memo(idx);
          break;
        }
        case 'q': Memo(Uint(1)); break;
        case 'r': Memo(Uint(4)); break;
        case 0x94: Memo(memo_.size()); break;
        case 'g': {
          const std::string s = Line();
          char* end = nullptr;
          const unsigned long long idx = std::strtoull(s.c_str(), &end, 10);
          if (s.empty() || *end) throw Error("bad GET index '" + s + "'");
          Push(Get(idx));
          break;
        }
        case 'h': Push(Get(Uint(1))); break;
        case 'j': Push(Get(Uint(4))); break;
        // Objects.
        case 'c': {
          std::string module = Line();
          std::string name = Line();
          Push(Value(MakeGlobal(std::move(module), std::move(name))));
          break;
        }
        case 0x93: {
          Value name = Pop(), module = Pop();
          if (!name.is_str() || !module.is_str()) throw Error("STACK_GLOBAL needs two strings");
          Push(Value(MakeGlobal(module.as_str(), name.as_str())));
          break;
        }
        case 'R': {
          Value args = Pop(), fn = Pop();
          if (!fn.is_global()) throw Error("REDUCE on a " + fn.kind_name() + ", not a global");
          if (!args.is_seq() || args.as_seq().kind != SeqKind::kTuple) throw Error("REDUCE arguments are not a tuple");
          Push(Call(fn.as_global(), args));
          break;
        }
        case 0x81: {
          Value args = Pop(), cls = Pop();
          Push(NewObject(cls, std::move(args), Value(), Object::Build::kNewObj));
          break;
        }
        case 0x92: {
          Value kwargs = Pop(), args = Pop(), cls = Pop();
          Push(NewObject(cls, std::move(args), std::move(kwargs), Object::Build::kNewObjEx));
          break;
        }
        case 'i': {
          std::string module = Line();
          std::string name = Line();
          Value g(MakeGlobal(std::move(module), std::move(name)));
          Push(Call(g.as_global(), Value::Tuple(PopMark())));
          break;
        }
        case 'o': {
          auto items = PopMark();
          if (items.empty()) throw Error("OBJ without a class");
          Value cls = items[0];
          items.erase(items.begin());
          if (!cls.is_global()) throw Error("OBJ on a " + cls.kind_name());
          Push(Call(cls.as_global(), Value::Tuple(std::move(items))));
          break;
        }
        case 'b': {
          Value state = Pop();
          Build(Top(), std::move(state));
          break;
        }
        case 'P': case 'Q': {
          Value pid = op == 'P' ? Value(Line()) : Pop();
          if (!src_.persistent_load) throw Error("persistent id in a pickle that has no storages");
          Push(src_.persistent_load(pid));
          break;
        }
        case 0x82: case 0x83: case 0x84:
          throw Error("extension-registry opcode (EXT" + std::to_string(op == 0x82 ? 1 : op == 0x83 ? 2 : 4) +
                      "): not used by checkpoints and not supported");
        default: {
          char buf[8];
          std::snprintf(buf, sizeof buf, "0x%02x", op);
          throw Error(std::string("unknown opcode ") + buf);
        }
      }
    }
  }

  std::span<const uint8_t> b_;
  const PickleSource& src_;
  size_t pos_ = 0, op_pos_ = 0;
  std::vector<Value> stack_, pending_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value> memo_;
  std::unordered_map<const Dict*, std::unordered_map<std::string, size_t>> key_index_;
};

}  // namespace

Value Unpickle(std::span<const uint8_t> bytes, const PickleSource& src, size_t* consumed) {
  return Unpickler(bytes, src).Run(consumed);
}

}  // namespace ckpt

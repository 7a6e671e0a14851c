#include "ckpt/pt/value.h"

#include <cmath>
#include <cstring>

#include "ckpt/util/error.h"

namespace ckpt {

Value* Dict::Find(std::string_view key) {
  for (auto& [k, v] : items)
    if (k.is_str() && k.as_str() == key) return &v;
  return nullptr;
}

const Value* Dict::Find(std::string_view key) const {
  return const_cast<Dict*>(this)->Find(key);
}

const Value& Dict::At(std::string_view key) const {
  if (const Value* v = Find(key)) return *v;
  throw Error("missing key '" + std::string(key) + "'");
}

void Dict::Set(std::string_view key, Value v) {
  if (Value* existing = Find(key)) {
    *existing = std::move(v);
    return;
  }
  items.emplace_back(Value(std::string(key)), std::move(v));
}

bool Dict::Erase(std::string_view key) {
  for (auto it = items.begin(); it != items.end(); ++it)
    if (it->first.is_str() && it->first.as_str() == key) {
      items.erase(it);
      return true;
    }
  return false;
}

bool Dict::Rename(std::string_view from, std::string_view to) {
  for (auto& [k, v] : items)
    if (k.is_str() && k.as_str() == from) {
      k = Value(std::string(to));
      return true;
    }
  return false;
}

Value Value::NewDict(bool ordered) {
  auto d = std::make_shared<Dict>();
  d->ordered = ordered;
  return Value(std::move(d));
}

Value Value::NewSeq(SeqKind kind, std::vector<Value> items) {
  auto s = std::make_shared<Sequence>();
  s->kind = kind;
  s->items = std::move(items);
  return Value(std::move(s));
}

std::string Value::kind_name() const {
  struct Namer {
    std::string operator()(std::monostate) const { return "None"; }
    std::string operator()(bool) const { return "bool"; }
    std::string operator()(int64_t) const { return "int"; }
    std::string operator()(const BigInt&) const { return "int"; }
    std::string operator()(double) const { return "float"; }
    std::string operator()(const Str&) const { return "str"; }
    std::string operator()(const Bytes&) const { return "bytes"; }
    std::string operator()(const std::shared_ptr<Sequence>& s) const {
      switch (s->kind) {
        case SeqKind::kList: return "list";
        case SeqKind::kTuple: return "tuple";
        case SeqKind::kSet: return "set";
        case SeqKind::kFrozenSet: return "frozenset";
        case SeqKind::kTorchSize: return "torch.Size";
      }
      return "sequence";
    }
    std::string operator()(const std::shared_ptr<Dict>& d) const { return d->ordered ? "OrderedDict" : "dict"; }
    std::string operator()(const Tensor&) const { return "tensor"; }
    std::string operator()(const Global& g) const { return "global " + g.full(); }
    std::string operator()(const std::shared_ptr<Object>& o) const { return "object " + o->cls.full(); }
    std::string operator()(const StorageRef&) const { return "storage"; }
  };
  return std::visit(Namer{}, v_);
}

namespace {
template <typename T>
const T& Get(const Value::Storage& v, const Value& self, const char* want) {
  if (const T* p = std::get_if<T>(&v)) return *p;
  throw Error(std::string("expected ") + want + ", found " + self.kind_name());
}
}  // namespace

bool Value::as_bool() const { return Get<bool>(v_, *this, "bool"); }
int64_t Value::as_int() const { return Get<int64_t>(v_, *this, "int"); }
double Value::as_float() const {
  if (is_int()) return static_cast<double>(as_int());
  return Get<double>(v_, *this, "float");
}
const std::string& Value::as_str() const { return Get<Str>(v_, *this, "str").utf8; }
const std::string& Value::as_bytes() const { return Get<Bytes>(v_, *this, "bytes").data; }
Sequence& Value::as_seq() const { return *Get<std::shared_ptr<Sequence>>(v_, *this, "list or tuple"); }
Dict& Value::as_dict() const { return *Get<std::shared_ptr<Dict>>(v_, *this, "dict"); }
const Tensor& Value::as_tensor() const { return Get<Tensor>(v_, *this, "tensor"); }
Tensor& Value::as_tensor() { return const_cast<Tensor&>(Get<Tensor>(v_, *this, "tensor")); }
const Global& Value::as_global() const { return Get<Global>(v_, *this, "global"); }
Object& Value::as_object() const { return *Get<std::shared_ptr<Object>>(v_, *this, "object"); }
const StorageRef& Value::as_storage() const { return Get<StorageRef>(v_, *this, "storage"); }

namespace {

bool TensorEqual(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  Tensor ca = a.Contiguous(), cb = b.Contiguous();
  return ca.nbytes() == 0 || std::memcmp(ca.data(), cb.data(), ca.nbytes()) == 0;
}

bool PtrEqual(const std::shared_ptr<Value>& a, const std::shared_ptr<Value>& b) {
  if (!a || !b) return !a && !b;
  return DeepEqual(*a, *b);
}

bool PairsEqual(const std::vector<std::pair<Value, Value>>& a,
                const std::vector<std::pair<Value, Value>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!DeepEqual(a[i].first, b[i].first) || !DeepEqual(a[i].second, b[i].second)) return false;
  return true;
}

bool ItemsEqual(const std::vector<Value>& a, const std::vector<Value>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!DeepEqual(a[i], b[i])) return false;
  return true;
}

}  // namespace

std::string ValuePathString(const std::vector<std::string>& parts) {
  std::string p = parts.empty() ? "<root>" : "";
  for (const auto& s : parts) p += "/" + s;
  return p;
}

bool DeepEqual(const Value& a, const Value& b) {
  if (a.raw().index() != b.raw().index()) return false;
  if (a.is_float()) {
    double x = a.as_float(), y = b.as_float();
    return std::memcmp(&x, &y, sizeof x) == 0;
  }
  if (a.is_seq()) {
    const auto &x = a.as_seq(), &y = b.as_seq();
    return x.kind == y.kind && ItemsEqual(x.items, y.items);
  }
  if (a.is_dict()) {
    const auto &x = a.as_dict(), &y = b.as_dict();
    return x.ordered == y.ordered && PairsEqual(x.items, y.items) && PtrEqual(x.attrs, y.attrs);
  }
  if (a.is_tensor()) {
    const auto &x = a.as_tensor(), &y = b.as_tensor();
    return x.is_parameter() == y.is_parameter() && x.requires_grad() == y.requires_grad() &&
           TensorEqual(x, y);
  }
  if (a.is_object()) {
    const auto &x = a.as_object(), &y = b.as_object();
    return x.cls == y.cls && x.how == y.how && PtrEqual(x.args, y.args) &&
           PtrEqual(x.kwargs, y.kwargs) && PtrEqual(x.state, y.state) &&
           ItemsEqual(x.list_items, y.list_items) && PairsEqual(x.dict_items, y.dict_items);
  }
  if (a.is_storage()) {
    const auto &x = a.as_storage(), &y = b.as_storage();
    return x.dtype == y.dtype && x.storage->nbytes() == y.storage->nbytes() &&
           std::memcmp(x.storage->data(), y.storage->data(), x.storage->nbytes()) == 0;
  }
  if (a.is_bool()) return a.as_bool() == b.as_bool();
  if (a.is_int()) return a.as_int() == b.as_int();
  if (a.is_bigint()) return std::get<BigInt>(a.raw()) == std::get<BigInt>(b.raw());
  if (a.is_str()) return a.as_str() == b.as_str();
  if (a.is_bytes()) return a.as_bytes() == b.as_bytes();
  if (a.is_global()) return a.as_global() == b.as_global();
  return true;  // None
}

double AsScalar(const Value& v) {
  if (v.is_tensor()) {
    const Tensor& t = v.as_tensor();
    if (t.numel() == 1 && (t.dtype() == DType::kFloat32 || t.dtype() == DType::kInt64)) {
      const Tensor c = t.Contiguous();
      if (c.dtype() == DType::kFloat32) return *reinterpret_cast<const float*>(c.data());
      return static_cast<double>(*reinterpret_cast<const int64_t*>(c.data()));
    }
    throw Error("expected a number, found a " + std::string(DTypeName(t.dtype())) + " tensor of shape " + ShapeString(t.shape()));
  }
  return v.as_float();
}

int64_t AsInteger(const Value& v, const std::string& what) {
  if (v.is_int()) return v.as_int();
  if (v.is_tensor() && v.as_tensor().numel() == 1 &&
      (v.as_tensor().dtype() == DType::kInt64 || v.as_tensor().dtype() == DType::kFloat32)) {
    const double d = AsScalar(v);
    if (d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
    throw Error(what + " is " + std::to_string(d) + ", not an integer");
  }
  throw Error(what + " is a " + v.kind_name() + ", not an integer");
}

namespace {

std::string KeyText(const Value& k) {
  if (k.is_str()) return k.as_str();
  if (k.is_int()) return std::to_string(k.as_int());
  return "<" + k.kind_name() + ">";
}

void RequirePlainAt(const Value& v, const std::string& where, const std::string& at) {
  auto refuse = [&](const std::string& what) {
    throw Error(where + (at.empty() ? "" : " at " + at) + ": " + what +
                " is not checkpoint data (numbers, strings, lists, dicts, tensors); refused, since torch.load of the "
                "output would call it");
  };
  if (v.is_object()) refuse("an object of class " + v.as_object().cls.full());
  if (v.is_storage()) refuse("a bare storage");
  if (v.is_global()) {
    const Global& g = v.as_global();
    if (g.module != "torch" || !DTypeFromName(g.name)) refuse("the global " + g.full());
    return;
  }
  if (v.is_seq()) {
    const auto& items = v.as_seq().items;
    for (size_t i = 0; i < items.size(); ++i) RequirePlainAt(items[i], where, at + "[" + std::to_string(i) + "]");
  } else if (v.is_dict()) {
    const Dict& d = v.as_dict();
    if (d.attrs) RequirePlainAt(*d.attrs, where, at + ".<attrs>");
    for (const auto& [k, item] : d.items) {
      RequirePlainAt(k, where, at + "<key>");
      RequirePlainAt(item, where, at + "['" + KeyText(k) + "']");
    }
  }
}

}  // namespace

void RequirePlainData(const Value& v, const std::string& where) { RequirePlainAt(v, where, ""); }

void ForEachTensor(const Value& v, const std::function<void(const Tensor&)>& f) {
  if (v.is_tensor()) {
    f(v.as_tensor());
  } else if (v.is_seq()) {
    for (const Value& c : v.as_seq().items) ForEachTensor(c, f);
  } else if (v.is_dict()) {
    for (const auto& [k, c] : v.as_dict().items) ForEachTensor(c, f);
  }
}

}  // namespace ckpt

#include "ckpt/pt/value_json.h"

#include <cstring>
#include <unordered_map>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

using ojson = nlohmann::ordered_json;

std::string HexDecode(const std::string& s) {
  if (s.size() % 2) throw Error("odd-length hex string");
  std::string out(s.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return out;
}

const char* SeqName(SeqKind k) {
  switch (k) {
    case SeqKind::kList: return "list";
    case SeqKind::kTuple: return "tuple";
    case SeqKind::kSet: return "set";
    case SeqKind::kFrozenSet: return "frozenset";
    case SeqKind::kTorchSize: return "size";
  }
  return "list";
}

class ToJson {
 public:
  explicit ToJson(const JsonOptions& o) : opts_(o) {}

  ojson Pairs(const std::vector<std::pair<Value, Value>>& items) {
    ojson a = ojson::array();
    for (const auto& [k, v] : items) a.push_back(ojson::array({Do(k), Do(v)}));
    return a;
  }
  ojson Items(const std::vector<Value>& items) {
    ojson a = ojson::array();
    for (const auto& v : items) a.push_back(Do(v));
    return a;
  }
  int64_t StorageIndex(const Storage* s) {
    auto [it, fresh] = storage_ids_.emplace(s, storage_ids_.size());
    return it->second;
  }

  ojson Do(const Value& v) {
    if (v.is_none()) return {{"t", "none"}};
    if (v.is_bool()) return {{"t", "bool"}, {"v", v.as_bool()}};
    if (v.is_int()) return {{"t", "int"}, {"v", v.as_int()}};
    if (v.is_bigint()) {
      const auto& b = std::get<BigInt>(v.raw()).le_bytes;
      return {{"t", "int"}, {"le", HexEncode(reinterpret_cast<const uint8_t*>(b.data()), b.size())}};
    }
    if (v.is_float()) {
      double d = v.as_float();
      uint8_t be[8];
      uint64_t bits;
      std::memcpy(&bits, &d, 8);
      for (int i = 0; i < 8; ++i) be[i] = static_cast<uint8_t>(bits >> (8 * (7 - i)));
      return {{"t", "float"}, {"bits", HexEncode(be, 8)}};
    }
    if (v.is_str()) return {{"t", "str"}, {"v", v.as_str()}};
    if (v.is_bytes())
      return {{"t", "bytes"}, {"hex", HexEncode(reinterpret_cast<const uint8_t*>(v.as_bytes().data()), v.as_bytes().size())}};
    if (v.is_seq()) return {{"t", SeqName(v.as_seq().kind)}, {"items", Items(v.as_seq().items)}};
    if (v.is_dict()) {
      const Dict& d = v.as_dict();
      ojson j = {{"t", d.ordered ? "odict" : "dict"}, {"items", Pairs(d.items)}};
      if (d.attrs) j["attrs"] = Do(*d.attrs);
      return j;
    }
    if (v.is_tensor()) {
      const Tensor& t = v.as_tensor();
      ojson j = {{"t", "tensor"},          {"dtype", DTypeName(t.dtype())},  {"shape", t.shape()},
                 {"stride", t.strides()},  {"offset", t.storage_offset()},   {"storage", StorageIndex(t.storage().get())},
                 {"storage_bytes", t.storage()->nbytes()}, {"param", t.is_parameter()}, {"requires_grad", t.requires_grad()}};
      if (opts_.tensor_bytes) {
        Tensor c = t.Contiguous();
        j["data"] = HexEncode(c.data(), c.nbytes());
        j["storage_hex"] = HexEncode(t.storage()->data(), t.storage()->nbytes());
      }
      return j;
    }
    if (v.is_global()) return {{"t", "global"}, {"module", v.as_global().module}, {"name", v.as_global().name}};
    if (v.is_object()) {
      const Object& o = v.as_object();
      const char* how = o.how == Object::Build::kReduce ? "reduce" : o.how == Object::Build::kNewObj ? "newobj" : "newobj_ex";
      ojson j = {{"t", "object"}, {"module", o.cls.module}, {"name", o.cls.name}, {"how", how}};
      j["args"] = o.args ? Do(*o.args) : ojson(nullptr);
      if (o.kwargs) j["kwargs"] = Do(*o.kwargs);
      j["state"] = o.state ? Do(*o.state) : ojson(nullptr);
      j["list_items"] = Items(o.list_items);
      j["dict_items"] = Pairs(o.dict_items);
      return j;
    }
    const StorageRef& s = v.as_storage();
    ojson j = {{"t", "storage"}, {"dtype", DTypeName(s.dtype)}, {"storage", StorageIndex(s.storage.get())},
               {"storage_bytes", s.storage->nbytes()}};
    if (opts_.tensor_bytes) j["storage_hex"] = HexEncode(s.storage->data(), s.storage->nbytes());
    return j;
  }

 private:
  const JsonOptions& opts_;
  std::unordered_map<const Storage*, int64_t> storage_ids_;
};

class FromJson {
 public:
  Value Do(const nlohmann::json& j) {
    const std::string t = j.at("t");
    if (t == "none") return Value();
    if (t == "bool") return Value(j.at("v").get<bool>());
    if (t == "int") {
      if (j.contains("le")) return Value(BigInt{HexDecode(j.at("le"))});
      return Value(j.at("v").get<int64_t>());
    }
    if (t == "float") {
      std::string be = HexDecode(j.at("bits"));
      if (be.size() != 8) throw Error("float bits must be 8 bytes");
      uint64_t bits = 0;
      for (unsigned char c : be) bits = (bits << 8) | c;
      double d;
      std::memcpy(&d, &bits, 8);
      return Value(d);
    }
    if (t == "str") return Value(j.at("v").get<std::string>());
    if (t == "bytes") return Value(Bytes{HexDecode(j.at("hex"))});
    for (SeqKind k : {SeqKind::kList, SeqKind::kTuple, SeqKind::kSet, SeqKind::kFrozenSet, SeqKind::kTorchSize})
      if (t == SeqName(k)) return Value::NewSeq(k, Items(j.at("items")));
    if (t == "dict" || t == "odict") {
      Value d = Value::NewDict(t == "odict");
      d.as_dict().items = Pairs(j.at("items"));
      if (j.contains("attrs")) d.as_dict().attrs = std::make_shared<Value>(Do(j.at("attrs")));
      return d;
    }
    if (t == "tensor") {
      auto dt = DTypeFromName(j.at("dtype").get<std::string>());
      if (!dt) throw Error("unknown dtype " + j.at("dtype").dump());
      Tensor tensor(*dt, j.at("shape"), j.at("stride"), j.at("offset"), StorageFor(j));
      tensor.set_parameter(j.value("param", false));
      tensor.set_requires_grad(j.value("requires_grad", false));
      return Value(std::move(tensor));
    }
    if (t == "global") return Value(Global{j.at("module"), j.at("name")});
    if (t == "object") {
      auto o = std::make_shared<Object>();
      o->cls = Global{j.at("module"), j.at("name")};
      const std::string how = j.at("how");
      o->how = how == "reduce" ? Object::Build::kReduce : how == "newobj" ? Object::Build::kNewObj : Object::Build::kNewObjEx;
      if (!j.at("args").is_null()) o->args = std::make_shared<Value>(Do(j.at("args")));
      if (j.contains("kwargs")) o->kwargs = std::make_shared<Value>(Do(j.at("kwargs")));
      if (!j.at("state").is_null()) o->state = std::make_shared<Value>(Do(j.at("state")));
      o->list_items = Items(j.at("list_items"));
      o->dict_items = Pairs(j.at("dict_items"));
      return Value(std::move(o));
    }
    if (t == "storage") {
      auto dt = DTypeFromName(j.at("dtype").get<std::string>());
      if (!dt) throw Error("unknown dtype");
      return Value(StorageRef{*dt, StorageFor(j)});
    }
    throw Error("unknown canonical JSON type '" + t + "'");
  }

 private:
  std::shared_ptr<Storage> StorageFor(const nlohmann::json& j) {
    const int64_t id = j.at("storage");
    auto& s = storages_[id];
    if (!s) {
      const std::string bytes = HexDecode(j.at("storage_hex"));
      s = Storage::Allocate(bytes.size());
      if (!bytes.empty()) std::memcpy(s->mutable_data(), bytes.data(), bytes.size());
    }
    return s;
  }
  std::vector<Value> Items(const nlohmann::json& a) {
    std::vector<Value> out;
    for (const auto& x : a) out.push_back(Do(x));
    return out;
  }
  std::vector<std::pair<Value, Value>> Pairs(const nlohmann::json& a) {
    std::vector<std::pair<Value, Value>> out;
    for (const auto& kv : a) out.emplace_back(Do(kv.at(0)), Do(kv.at(1)));
    return out;
  }
  std::unordered_map<int64_t, std::shared_ptr<Storage>> storages_;
};

}  // namespace

std::string HexEncode(const uint8_t* data, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) s[2 * i] = d[data[i] >> 4], s[2 * i + 1] = d[data[i] & 15];
  return s;
}

nlohmann::ordered_json ValueToJson(const Value& v, const JsonOptions& opts) { return ToJson(opts).Do(v); }

Value ValueFromJson(const nlohmann::json& j) {
  try {
    return FromJson().Do(j);
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("malformed canonical JSON: ") + JsonErrorText(e));
  }
}

std::string JsonErrorText(const nlohmann::json::exception& e) {
  std::string text = e.what();
  if (const size_t close = text.find("] "); text.rfind("[json.exception.", 0) == 0 && close != std::string::npos) text = text.substr(close + 2);
  if (text.rfind("cannot use at() with ", 0) == 0 || text.rfind("cannot use operator[] with ", 0) == 0)
    return "is " + text.substr(text.find(" with ") + 6) + " where an object with named fields is expected";
  if (text.rfind("key '", 0) == 0 && text.ends_with("' not found")) return "has no key " + text.substr(4, text.size() - 14);
  if (text.rfind("type must be ", 0) == 0) return "a value has the wrong type (" + text + ")";
  return text;
}

nlohmann::json ParseJsonBounded(const char* begin, const char* end, const std::string& where) {
  // The nesting is counted in a pass of its own, not with nlohmann's parser
  // callback: after every object it closes, that parser scans the enclosing
  // object for discarded members, so a header of 100,000 entries took 256 s.
  int depth = 0;
  bool in_string = false;
  for (const char* c = begin; c < end; ++c) {
    if (in_string) {
      if (*c == '\\') ++c;  // the escaped character, whatever it is
      else if (*c == '"') in_string = false;
    } else if (*c == '"') {
      in_string = true;
    } else if (*c == '[' || *c == '{') {
      if (++depth > kMaxJsonDepth) throw Error(where + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    } else if (*c == ']' || *c == '}') {
      --depth;  // unbalanced text is the parser's to refuse
    }
  }
  return nlohmann::json::parse(begin, end, nullptr, false);
}

}  // namespace ckpt

#include "ckpt/pt/plain_data.h"

#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ckpt/pt/pickle_writer.h"
#include "ckpt/util/error.h"

namespace ckpt {
namespace {

bool IsAttributeDict(const Global& c) {
  // Lightning 1.x (pytorch_lightning) and 2.x (lightning.fabric, lightning_fabric) spell the class so.
  return c.name == "AttributeDict" &&
         (c.module == "pytorch_lightning.utilities.parsing" || c.module == "lightning.pytorch.utilities.parsing" ||
          c.module == "lightning_fabric.utilities.data" || c.module == "lightning.fabric.utilities.data");
}
bool IsDictConfig(const Global& c) { return c.module == "omegaconf.dictconfig" && c.name == "DictConfig"; }
bool IsListConfig(const Global& c) { return c.module == "omegaconf.listconfig" && c.name == "ListConfig"; }
// AnyNode, StringNode, IntegerNode, FloatNode, BooleanNode, ...: one value each.
bool IsValueNode(const Global& c) { return c.module == "omegaconf.nodes"; }

class Plainer {
 public:
  explicit Plainer(const std::string& where) : where_(where) {}

  void Walk(Value& v) {
    if (v.is_object()) {
      Object& o = v.as_object();
      if (auto it = converted_.find(&o); it != converted_.end()) {
        v = it->second;
        return;
      }
      if (std::optional<Value> plain = Convert(o)) {
        pinned_.push_back(v);  // its address keys converted_: no later object may reuse it
        converted_.emplace(&o, *plain);
        v = std::move(*plain);
        return;
      }
    }
    const void* id = v.is_seq()      ? static_cast<const void*>(&v.as_seq())
                     : v.is_dict()   ? static_cast<const void*>(&v.as_dict())
                     : v.is_object() ? static_cast<const void*>(&v.as_object())
                                     : nullptr;
    if (!id || !walked_.insert(id).second) return;
    if (v.is_object()) {
      // Kept as it is (xser's TensorReference, torch.device...) when the
      // writer allows its class; the check afterwards refuses any other.
      Object& o = v.as_object();
      if (o.args) Child(*o.args, "<args>");
      if (o.state) Child(*o.state, "<state>");
      for (auto& [k, item] : o.dict_items) Child(item, "<items>");
    } else if (v.is_seq()) {
      auto& items = v.as_seq().items;
      for (size_t i = 0; i < items.size(); ++i) Child(items[i], "[" + std::to_string(i) + "]");
    } else {
      Dict& d = v.as_dict();
      if (d.attrs) Child(*d.attrs, "<attrs>");
      for (auto& [k, item] : d.items) {
        Child(k, "<key>");
        Child(item, k.is_str() ? k.as_str() : k.is_int() ? std::to_string(k.as_int()) : "<" + k.kind_name() + ">");
      }
    }
  }

 private:
  void Child(Value& v, const std::string& name) {
    path_.push_back(name);
    Walk(v);
    path_.pop_back();
  }

  [[noreturn]] void Fail(const std::string& what) {
    throw Error(where_ + " at " + ValuePathString(path_) + ": " + what);
  }

  // The state entry `key` of an omegaconf object, or null.
  static Value* StateEntry(Object& o, const char* key) { return o.state && o.state->is_dict() ? o.state->as_dict().Find(key) : nullptr; }

  // The plain value of a known container; nullopt for any other class.
  std::optional<Value> Convert(Object& o) {
    if (IsAttributeDict(o.cls)) {
      if (o.state && !(o.state->is_none() || (o.state->is_dict() && o.state->as_dict().items.empty())))
        Fail("a Lightning AttributeDict with attributes besides its items");
      Value d = Value::NewDict();
      d.as_dict().items = o.dict_items;
      Walk(d);
      return d;
    }
    if (IsDictConfig(o.cls) || IsListConfig(o.cls)) {
      Value* content = StateEntry(o, "_content");
      if (!content) Fail("an omegaconf " + o.cls.name + " with no _content");
      // None, "???" (missing) or an interpolation: the config is that value.
      if (content->is_none() || content->is_str()) return *content;
      if (IsDictConfig(o.cls) != content->is_dict() || (!content->is_dict() && !(content->is_seq() && content->as_seq().kind == SeqKind::kList)))
        Fail("an omegaconf " + o.cls.name + " whose _content is a " + content->kind_name());
      Value plain = IsDictConfig(o.cls) ? Value::NewDict() : Value::List();
      if (content->is_dict()) plain.as_dict().items = content->as_dict().items;
      else plain.as_seq().items = content->as_seq().items;
      Walk(plain);
      return plain;
    }
    if (IsValueNode(o.cls)) {
      Value* val = StateEntry(o, "_val");
      if (!val) Fail("an omegaconf " + o.cls.name + " with no _val");
      Value plain = *val;
      Walk(plain);
      return plain;
    }
    return std::nullopt;
  }

  const std::string& where_;
  std::vector<std::string> path_;
  std::unordered_map<const Object*, Value> converted_;
  std::vector<Value> pinned_;
  std::unordered_set<const void*> walked_;
};

}  // namespace

Value PlainCheckpointData(Value v, const std::string& where) {
  Plainer(where).Walk(v);
  CheckPicklable(v, where);
  return v;
}

}  // namespace ckpt

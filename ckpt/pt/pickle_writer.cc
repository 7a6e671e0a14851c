#include "ckpt/pt/pickle_writer.h"

#include <cstring>
#include <unordered_map>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

// "[j]"; built piecewise to dodge a GCC 12 -Wrestrict false positive on operator+.
std::string IndexName(size_t j) {
  std::string s(1, '[');
  s.append(std::to_string(j));
  s.push_back(']');
  return s;
}

class Pickler {
 public:
  // `where`: names the tree in errors ("cannot pickle" when empty).
  Pickler(const PickleOptions& opts, std::vector<PickledStorage>* storages, std::string where = "")
      : opts_(opts), storages_(storages), where_(std::move(where)) {}

  std::string Run(const Value& root) {
    Op(0x80);
    Op(2);
    Save(root);
    Op('.');
    return std::move(out_);
  }

 private:
  void Op(uint8_t c) { out_.push_back(static_cast<char>(c)); }
  void U(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
  }
  [[noreturn]] void Fail(const std::string& what) {
    const std::string p = ValuePathString(path_);
    if (where_.empty()) throw Error("cannot pickle " + p + ": " + what);
    throw Error(where_ + " at " + p + ": " + what + "; shardkit writes only what torch.load(weights_only=True) loads, so it does not carry that");
  }

  void Unicode(const std::string& s) {
    Op('X');
    U(s.size(), 4);
    out_ += s;
  }
  void GlobalOp(const std::string& module, const std::string& name) {
    if (opts_.weights_only && !AllowedGlobal(module + "." + name)) Fail("global " + module + "." + name + " is not allowed by torch's weights_only loader");
    if (!TorchLoadableGlobal(Global{module, name}) && !IsXserReferenceClass(Global{module, name}))
      Fail("the global " + module + "." + name + ", which torch.load(weights_only=True) refuses and plain torch.load calls");
    std::string key = module;
    key.push_back('\n');
    key.append(name);
    if (auto it = global_memo_.find(key); it != global_memo_.end()) return Get(it->second);
    Op('c');
    out_.append(key);
    out_.push_back('\n');
    global_memo_[key] = Put();
  }
  static bool AllowedGlobal(const std::string& g) {
    return g == "collections.OrderedDict" || g == "torch.Size" || g == "torch._utils._rebuild_tensor_v2" ||
           g == "torch._utils._rebuild_parameter" ||
           (g.starts_with("torch.") && g.ends_with("Storage") && g.find('.', 6) == std::string::npos);
  }
  uint32_t Put() {
    const uint32_t idx = next_memo_++;
    if (idx < 256) Op('q'), U(idx, 1);
    else Op('r'), U(idx, 4);
    return idx;
  }
  void Get(uint32_t idx) {
    if (idx < 256) Op('h'), U(idx, 1);
    else Op('j'), U(idx, 4);
  }

  void Int(int64_t v) {
    if (v >= 0 && v < 256) Op('K'), U(v, 1);
    else if (v >= 0 && v < 65536) Op('M'), U(v, 2);
    else if (v >= INT32_MIN && v <= INT32_MAX) Op('J'), U(static_cast<uint32_t>(v), 4);
    else {
      std::string le;
      for (int i = 0; i < 8; ++i) le.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i)));
      // Minimal two's complement, as Python writes it.
      while (le.size() > 1) {
        const uint8_t last = le.back(), prev = le[le.size() - 2];
        if ((last == 0 && !(prev & 0x80)) || (last == 0xff && (prev & 0x80))) le.pop_back();
        else break;
      }
      Long(le);
    }
  }
  void Long(const std::string& le) {
    if (le.size() < 256) Op(0x8a), U(le.size(), 1);
    else {
      Fail("an int this large needs LONG4, which torch's weights_only loader rejects");
    }
    out_ += le;
  }

  void Tuple(const std::vector<Value>& items) {
    if (items.empty()) return Op(')');
    if (items.size() <= 3) {
      for (const auto& v : items) Save(v);
      return Op(static_cast<uint8_t>(0x84 + items.size()));
    }
    Op('(');
    for (const auto& v : items) Save(v);
    Op('t');
  }
  void IntTuple(const std::vector<int64_t>& v) {
    std::vector<Value> items(v.begin(), v.end());
    Tuple(items);
  }
  void SetItems(const std::vector<std::pair<Value, Value>>& items) {
    for (size_t i = 0; i < items.size(); i += 1000) {
      const size_t end = std::min(items.size(), i + 1000);
      Op('(');
      for (size_t j = i; j < end; ++j) {
        Save(items[j].first);
        const Value& k = items[j].first;
        path_.push_back(k.is_str() ? k.as_str() : k.is_int() ? std::to_string(k.as_int()) : IndexName(j));
        Save(items[j].second);
        path_.pop_back();
      }
      Op('u');
    }
  }
  void Appends(const std::vector<Value>& items) {
    for (size_t i = 0; i < items.size(); i += 1000) {
      const size_t end = std::min(items.size(), i + 1000);
      Op('(');
      for (size_t j = i; j < end; ++j) {
        path_.push_back(IndexName(j));
        Save(items[j]);
        path_.pop_back();
      }
      Op('e');
    }
  }
  // Emits a memo reference if `id` was seen; otherwise returns false.
  bool Memoized(const void* id) {
    auto it = memo_.find(id);
    if (it == memo_.end()) return false;
    Get(it->second);
    return true;
  }

  void StorageId(const std::shared_ptr<Storage>& s, DType dtype) {
    auto it = storage_keys_.find(s.get());
    std::string key;
    if (it == storage_keys_.end()) {
      key = std::to_string(storages_->size());
      storage_keys_[s.get()] = {key, dtype};
      storages_->push_back({key, s});
    } else {
      if (it->second.second != dtype) Fail("one storage is viewed as both " + std::string(DTypeName(dtype)) + " and " + std::string(DTypeName(it->second.second)));
      key = it->second.first;
    }
    Op('(');
    Unicode("storage");
    GlobalOp("torch", std::string(StorageClassName(dtype)));
    Unicode(key);
    Unicode("cpu");
    Int(static_cast<int64_t>(s->nbytes() / ElementSize(dtype)));
    Op('t');
    Op('Q');
  }

  void SaveTensor(const Tensor& t) {
    if (t.is_parameter()) GlobalOp("torch._utils", "_rebuild_parameter");
    GlobalOp("torch._utils", "_rebuild_tensor_v2");
    Op('(');
    StorageId(t.storage(), t.dtype());
    Int(t.storage_offset());
    IntTuple(t.shape());
    IntTuple(t.strides());
    Op(t.requires_grad() && !t.is_parameter() ? 0x88 : 0x89);
    EmptyOrderedDict();
    Op('t');
    Op('R');
    if (t.is_parameter()) {
      Op(t.requires_grad() ? 0x88 : 0x89);
      EmptyOrderedDict();
      Op(0x87);
      Op('R');
    }
  }
  void EmptyOrderedDict() {
    GlobalOp("collections", "OrderedDict");
    Op(')');
    Op('R');
  }

  void SaveObject(const std::shared_ptr<Object>& o) {
    if (opts_.weights_only) Fail("object of class " + o->cls.full() + " is not allowed by torch's weights_only loader");
    if (Memoized(o.get())) return;
    pinned_.push_back(o);
    GlobalOp(o->cls.module, o->cls.name);  // refuses any class but torch 2's and xser's
    // What torch 2's weights-only unpickler does with an object of an allowed
    // class (_weights_only_unpickler.py Unpickler.load): REDUCE, NEWOBJ and
    // BUILD, SETITEMS only onto a dict, OrderedDict or Counter, APPENDS only
    // onto a list, and no NEWOBJ_EX at all.
    if (o->how == Object::Build::kNewObjEx) Fail("object of class " + o->cls.full() + " is built with NEWOBJ_EX, which torch's weights_only loader does not execute");
    if (!o->list_items.empty()) Fail("object of class " + o->cls.full() + " holds list items, which torch's weights_only loader appends only to a list");
    if (!o->dict_items.empty() && o->cls.full() != "collections.Counter")
      Fail("object of class " + o->cls.full() + " holds dict items, which torch's weights_only loader sets only on a dict");
    Save(o->args ? *o->args : Value::Tuple());
    Op(o->how == Object::Build::kReduce ? 'R' : 0x81);
    memo_[o.get()] = Put();
    if (!o->dict_items.empty()) SetItems(o->dict_items);
    if (o->state) {
      Save(*o->state);
      Op('b');
    }
  }

  void SaveSeq(const std::shared_ptr<Sequence>& s) {
    if (Memoized(s.get())) return;
    pinned_.push_back(s);
    switch (s->kind) {
      case SeqKind::kTuple:
        Tuple(s->items);
        break;
      case SeqKind::kList:
        Op(']');
        memo_[s.get()] = Put();
        Appends(s->items);
        return;
      case SeqKind::kTorchSize:
        GlobalOp("torch", "Size");
        Tuple({Value::Tuple(s->items)});
        Op('R');
        break;
      case SeqKind::kSet:
      case SeqKind::kFrozenSet:
        if (opts_.weights_only) Fail("sets are not allowed by torch's weights_only loader");
        if (s->kind == SeqKind::kFrozenSet) Fail("a frozenset is not one torch.load(weights_only=True) builds");
        GlobalOp("__builtin__", "set");
        Tuple({Value::List(s->items)});
        Op('R');
        break;
    }
    memo_[s.get()] = Put();
  }

  void SaveDict(const std::shared_ptr<Dict>& d) {
    if (Memoized(d.get())) return;
    pinned_.push_back(d);
    if (d->ordered) {
      EmptyOrderedDict();
    } else {
      Op('}');
    }
    memo_[d.get()] = Put();
    if (!d->items.empty()) SetItems(d->items);
    if (d->attrs && !opts_.weights_only) {  // weights_only cannot BUILD a dict; _metadata is advisory
      Save(*d->attrs);
      Op('b');
    }
  }

  void Save(const Value& v) {
    struct V {
      Pickler& p;
      void operator()(std::monostate) { p.Op('N'); }
      void operator()(bool b) { p.Op(b ? 0x88 : 0x89); }
      void operator()(int64_t i) { p.Int(i); }
      void operator()(const BigInt& b) { p.Long(b.le_bytes); }
      void operator()(double d) {
        if (p.opts_.weights_only) p.Fail("floats are rejected by torch 1.13's weights_only loader (BINFLOAT)");
        uint64_t bits;
        std::memcpy(&bits, &d, 8);
        p.Op('G');
        for (int i = 7; i >= 0; --i) p.out_.push_back(static_cast<char>(bits >> (8 * i)));
      }
      void operator()(const Str& s) { p.Unicode(s.utf8); }
      void operator()(const Bytes& b) {
        if (p.opts_.weights_only) p.Fail("bytes are not allowed by torch's weights_only loader");
        // Protocol 2 has no bytes opcode; Python writes _codecs.encode(latin1 str, 'latin1')
        // (and b'' as bytes(), which torch's weights_only loader does not call, so not here).
        std::string utf8;
        for (unsigned char c : b.data) {
          if (c < 0x80) utf8.push_back(static_cast<char>(c));
          else utf8.push_back(static_cast<char>(0xc0 | (c >> 6))), utf8.push_back(static_cast<char>(0x80 | (c & 0x3f)));
        }
        p.GlobalOp("_codecs", "encode");
        p.Unicode(utf8);
        p.Unicode("latin1");
        p.Op(0x86);
        p.Op('R');
      }
      void operator()(const std::shared_ptr<Sequence>& s) { p.SaveSeq(s); }
      void operator()(const std::shared_ptr<Dict>& d) { p.SaveDict(d); }
      void operator()(const Tensor& t) { p.SaveTensor(t); }
      void operator()(const Global& g) { p.GlobalOp(g.module, g.name); }
      void operator()(const std::shared_ptr<Object>& o) { p.SaveObject(o); }
      void operator()(const StorageRef& s) {
        if (p.opts_.weights_only) p.Fail("a bare storage is not allowed by torch's weights_only loader");
        p.StorageId(s.storage, s.dtype);
      }
    };
    std::visit(V{*this}, v.raw());
  }

  const PickleOptions& opts_;
  std::vector<PickledStorage>* storages_;
  std::string where_;
  std::string out_;
  uint32_t next_memo_ = 0;
  std::unordered_map<const void*, uint32_t> memo_;
  // The memo is keyed by address, so every memoised container (including
  // temporaries made while pickling, such as torch.Size's inner tuple) is
  // kept alive until the end: a freed address reused by a later container
  // would otherwise turn it into a reference to the first.
  std::vector<std::shared_ptr<const void>> pinned_;
  std::unordered_map<std::string, uint32_t> global_memo_;
  std::unordered_map<const Storage*, std::pair<std::string, DType>> storage_keys_;
  std::vector<std::string> path_;
};

}  // namespace

std::string Pickle(const Value& root, const PickleOptions& opts, std::vector<PickledStorage>* storages) {
  return Pickler(opts, storages).Run(root);
}

void CheckPicklable(const Value& root, const std::string& where) {
  std::vector<PickledStorage> storages;
  const PickleOptions opts;
  Pickler(opts, &storages, where).Run(root);
}

bool TorchLoadableGlobal(const Global& g) {
  // _read_global_instruction maps Python 2 names (torch._utils IMPORT_MAPPING).
  const std::string module = g.module == "__builtin__" ? "builtins" : g.module;
  const std::string& n = g.name;
  if (module == "collections") return n == "OrderedDict" || n == "Counter";
  if (module == "builtins") return n == "set" || n == "bytearray" || n == "complex";
  if (module == "_codecs") return n == "encode";
  if (module == "torch.nn.parameter") return n == "Parameter";
  if (module == "torch.serialization") return n == "_get_layout";
  if (module == "torch.storage") return n == "TypedStorage" || n == "UntypedStorage";
  if (module == "torch._tensor") return n == "_rebuild_from_type_v2";
  if (module == "torch._utils")
    return n == "_rebuild_parameter" || n == "_rebuild_parameter_with_state" || n == "_rebuild_qtensor" || n == "_rebuild_tensor" ||
           n == "_rebuild_tensor_v2" || n == "_rebuild_tensor_v3" || n == "_rebuild_sparse_tensor" ||
           n == "_rebuild_meta_tensor_no_storage" || n == "_rebuild_wrapper_subclass" || n == "_rebuild_device_tensor_from_numpy" ||
           n == "_rebuild_device_tensor_from_cpu_tensor";
  if (module != "torch") return false;
  if (n == "Size" || n == "Tensor" || n == "device") return true;
  if (n == "per_tensor_affine" || n == "per_tensor_symmetric" || n == "per_channel_affine" || n == "per_channel_symmetric" ||
      n == "per_channel_affine_float_qparams")
    return true;
  // str(dtype) and the legacy storage classes, by their own names only (torch.float32, not torch.float).
  if (auto dt = DTypeFromName(n); dt && DTypeName(*dt) == n) return true;
  if (auto dt = DTypeFromStorageClass(n); dt && StorageClassName(*dt) == n) return true;
  return false;
}

bool IsXserReferenceClass(const Global& g) {
  return g.module == "torch_xla.utils.serialization" && g.name == "TensorReference";
}

}  // namespace ckpt

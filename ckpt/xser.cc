#include "ckpt/xser.h"

#include "ckpt/error.h"

namespace ckpt {

std::string XserTensorDir(const std::string& path) { return path + ".tensors"; }

bool IsXser(const std::string& path, Env* env) { return env->IsDirectory(XserTensorDir(path)); }

Value LoadPtOrXser(const std::string& path, const LoadOptions& opts, Env* env) {
  return IsXser(path, env) ? LoadXser(path, opts, env) : LoadPt(path, opts, env);
}

int64_t TensorReferenceId(const Value& v) {
  if (!v.is_object() || v.as_object().cls.name != "TensorReference") return -1;
  const Object& o = v.as_object();
  if (o.state && o.state->is_dict())
    if (const Value* tid = o.state->as_dict().Find("tid"); tid && tid->is_int()) return tid->as_int();
  if (o.args && o.args->is_seq() && !o.args->as_seq().items.empty() && o.args->as_seq().items[0].is_int())
    return o.args->as_seq().items[0].as_int();
  throw Error("TensorReference without an integer tid");
}

namespace {

void Resolve(Value& v, const std::string& dir, const LoadOptions& opts, Env* env) {
  const int64_t tid = TensorReferenceId(v);
  if (tid >= 0) {
    const std::string file = dir + "/tensor_" + std::to_string(tid) + ".pt";
    if (!env->Exists(file)) throw Error(file + ": missing xser tensor file for tid " + std::to_string(tid));
    Value t = LoadPt(file, opts, env);
    if (!t.is_tensor()) throw Error(file + ": xser tensor file holds a " + t.kind_name() + ", not a tensor");
    // NNM's TensorReference also declares the shape (torch-xla's holds the tid alone).
    const Object& ref = v.as_object();
    if (const Value* shape = ref.state && ref.state->is_dict() ? ref.state->as_dict().Find("shape") : nullptr;
        shape && shape->is_seq()) {
      std::vector<int64_t> dims;
      for (const Value& d : shape->as_seq().items) dims.push_back(AsInteger(d, file + ": declared shape"));
      if (dims != t.as_tensor().shape())
        throw Error(file + ": holds a tensor of shape " + ShapeString(t.as_tensor().shape()) + ", but its TensorReference (tid " +
                    std::to_string(tid) + ") declares " + ShapeString(dims));
    }
    v = std::move(t);
    return;
  }
  if (v.is_seq()) {
    for (Value& c : v.as_seq().items) Resolve(c, dir, opts, env);
  } else if (v.is_dict()) {
    for (auto& [k, c] : v.as_dict().items) Resolve(c, dir, opts, env);
  }
}

}  // namespace

Value LoadXser(const std::string& path, const LoadOptions& opts, Env* env) {
  Value root = LoadPt(path, opts, env);
  try {
    Resolve(root, XserTensorDir(path), opts, env);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (referenced from " + path + ")");
  }
  return root;
}

Value MakeTensorReference(int64_t tid) {
  auto o = std::make_shared<Object>();
  o->cls = Global{"torch_xla.utils.serialization", "TensorReference"};
  o->how = Object::Build::kNewObj;
  o->args = std::make_shared<Value>(Value::Tuple());
  Value state = Value::NewDict();
  state.as_dict().Set("tid", Value(tid));
  o->state = std::make_shared<Value>(state);
  return Value(o);
}

namespace {

// A copy of the containers of `v` with tensors swapped for references.
Value Replace(const Value& v, std::vector<XserPart>& parts, Value& info, const std::string& dir) {
  if (v.is_tensor()) {
    const Tensor& t = v.as_tensor();
    const int64_t tid = static_cast<int64_t>(parts.size());
    parts.push_back({dir + "/tensor_" + std::to_string(tid) + ".pt", v});
    Value meta = Value::NewDict();
    meta.as_dict().Set("dtype", Value(Global{"torch", std::string(DTypeName(t.dtype()))}));
    std::vector<Value> dims;
    for (int64_t d : t.shape()) dims.emplace_back(d);
    meta.as_dict().Set("shape", Value::NewSeq(SeqKind::kTorchSize, std::move(dims)));
    info.as_dict().items.emplace_back(Value(tid), meta);
    return MakeTensorReference(tid);
  }
  if (v.is_seq()) {
    const Sequence& s = v.as_seq();
    std::vector<Value> items;
    for (const Value& c : s.items) items.push_back(Replace(c, parts, info, dir));
    return Value::NewSeq(s.kind, std::move(items));
  }
  if (v.is_dict()) {
    const Dict& d = v.as_dict();
    Value out = Value::NewDict(d.ordered);
    out.as_dict().attrs = d.attrs;
    for (const auto& [k, c] : d.items) out.as_dict().items.emplace_back(k, Replace(c, parts, info, dir));
    return out;
  }
  return v;
}

}  // namespace

std::vector<XserPart> SplitForXser(const std::string& path, const Value& root) {
  std::vector<XserPart> parts;
  Value info = Value::NewDict();
  Value refs = Replace(root, parts, info, XserTensorDir(path));
  parts.push_back({path, refs});
  parts.push_back({path + ".info.pt", info});
  return parts;
}

}  // namespace ckpt

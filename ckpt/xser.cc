#include "ckpt/xser.h"

#include "ckpt/error.h"

namespace ckpt {

std::string XserTensorDir(const std::string& path) { return path + ".tensors"; }

bool IsXser(const std::string& path, Env* env) { return env->IsDirectory(XserTensorDir(path)); }

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

}  // namespace ckpt

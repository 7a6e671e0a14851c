#include "ckpt/pt/xser.h"

#include <algorithm>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include "ckpt/pt/plain_data.h"
#include "ckpt/util/error.h"
#include "ckpt/util/input_guard.h"

namespace ckpt {

std::string XserTensorDir(const std::string& path) { return path + ".tensors"; }

std::string XserFileOfTensorDir(const std::string& name) {
  return name.ends_with(".pt.tensors") ? name.substr(0, name.size() - std::string(".tensors").size()) : "";
}

bool IsXser(const std::string& path, Env* env) { return env->IsDirectory(XserTensorDir(path)); }

Value LoadPtOrXser(const std::string& path, const LoadOptions& opts, Env* env) {
  return IsXser(path, env) ? LoadXser(path, opts, env) : LoadPt(path, opts, env);
}

std::vector<ContainerProblem> XserContainerProblems(const std::set<std::string>& entries) {
  std::vector<ContainerProblem> out;
  std::optional<std::string> plain, xser;
  for (const auto& e : entries) {
    if (const std::string x = XserFileOfTensorDir(e); !x.empty()) {
      if (!entries.count(x)) out.push_back({e, "an xser tensor folder with no " + x + " beside it"});
    } else if (e.ends_with(".pt") && !e.ends_with(".info.pt")) {
      (entries.count(XserTensorDir(e)) ? xser : plain) = e;
    }
  }
  if (plain && xser) out.push_back({*plain, "is plain .pt but " + *xser + " is xser; a tag is one container or the other, as NxD's loader reads it"});
  return out;
}

Value LoadTagFile(Env* env, const std::string& tag_dir, const std::string& rel, LoadOptions opts) {
  opts.confine_to = tag_dir;
  const std::string path = tag_dir + "/" + rel;
  return PlainCheckpointData(LoadPtOrXser(path, opts, env), path);
}

namespace {

bool IsTensorReference(const Value& v) { return v.is_object() && v.as_object().cls.name == "TensorReference"; }

}  // namespace

int64_t TensorReferenceId(const Value& v) {
  if (!IsTensorReference(v)) return -1;
  const Object& o = v.as_object();
  if (o.state && o.state->is_dict())
    if (const Value* tid = o.state->as_dict().Find("tid"); tid && tid->is_int()) return tid->as_int();
  if (o.args && o.args->is_seq() && !o.args->as_seq().items.empty() && o.args->as_seq().items[0].is_int())
    return o.args->as_seq().items[0].as_int();
  throw Error("TensorReference without an integer tid");
}

namespace {

std::vector<int64_t> Dims(const Value& shape, const std::string& where) {
  if (!shape.is_seq()) throw Error(where + " is a " + shape.kind_name() + ", not a shape");
  std::vector<int64_t> dims;
  for (const Value& d : shape.as_seq().items) dims.push_back(AsInteger(d, where));
  return dims;
}

// What NxD's info.pt declares of each tid (NxD trainer/checkpoint.py
// _extract_tensor_info_and_update_state_dict; _xser_load_data allocates from it).
struct Declared {
  std::vector<int64_t> shape;
  DType dtype;
  bool expert = false;  // expert_model_parallel: the file's own folder holds it, at every ep rank
};

std::map<int64_t, Declared> LoadInfo(const std::string& info_path, const LoadOptions& opts, Env* env) {
  std::map<int64_t, Declared> out;
  const Value info = LoadPt(info_path, opts, env);
  if (!info.is_dict()) throw Error(info_path + ": xser info holds a " + info.kind_name() + ", not a dict of tid -> {dtype, shape}");
  for (const auto& [k, v] : info.as_dict().items) {
    if (!k.is_int()) throw Error(info_path + ": holds a key that is not a tid (an integer)");
    const std::string where = info_path + ": tid " + std::to_string(k.as_int());
    if (!v.is_dict()) throw Error(where + " is a " + v.kind_name() + ", not a dict");
    const Value* dt = v.as_dict().Find("dtype");
    const Value* sh = v.as_dict().Find("shape");
    if (!dt || !sh) throw Error(where + " lacks its dtype or shape");
    std::optional<DType> d;
    if (dt->is_global() && dt->as_global().module == "torch") d = DTypeFromName(dt->as_global().name);
    if (!d) throw Error(where + ": dtype is not a torch dtype shardkit knows");
    const Value* ep = v.as_dict().Find("expert_model_parallel");
    if (ep && !ep->is_bool()) throw Error(where + ": expert_model_parallel is not True or False");
    out[k.as_int()] = {Dims(*sh, where + " shape"), *d, ep && ep->as_bool()};
  }
  return out;
}

struct Resolver {
  std::string dir;
  const LoadOptions& opts;
  Env* env;
  const std::map<int64_t, Declared>* info;  // null without info.pt
  std::string info_path;
  std::set<int64_t> seen;
  std::map<int64_t, std::shared_ptr<const MappedFile>> mapped;  // tid -> its tensor file, mapped ahead
  std::optional<ConfinedFolder> confined, confined_shared;  // the folders under opts.confine_to, resolved once
  std::string shared_dir = {};  // XserSharedTensorDir: where tids info.pt does not mark expert-parallel lie

  bool Shared(int64_t tid) const {
    if (shared_dir.empty() || !info) return false;
    auto it = info->find(tid);
    return it != info->end() && !it->second.expert;
  }
  const std::string& DirOf(int64_t tid) const { return Shared(tid) ? shared_dir : dir; }

  // Maps every referenced tensor file and asks for its head (zip directory, pickle) ahead of
  // parsing, so a tag of many small files is read by the disk at once, not one file at a time.
  void MapAll(const Value& v) {
    if (IsTensorReference(v)) {
      const int64_t tid = TensorReferenceId(v);
      const std::string name = "tensor_" + std::to_string(tid) + ".pt", file = DirOf(tid) + "/" + name;
      if (tid < 0 || mapped.count(tid) || !env->Exists(file)) return;  // Resolve names the problem
      if (!opts.confine_to.empty()) {
        auto& c = Shared(tid) ? confined_shared : confined;
        if (!c) c.emplace(opts.confine_to, DirOf(tid));
        c->Require(name);
      }
      auto f = env->MapFile(file);
      f->Prefetch(f->data(), std::min<uint64_t>(f->size(), 64 << 10));
      if (f->size() > (64 << 10)) f->Prefetch(f->data() + f->size() - 4096, 4096);  // the zip directory at the end
      mapped.emplace(tid, std::move(f));
      return;
    }
    if (v.is_seq()) {
      for (const Value& c : v.as_seq().items) MapAll(c);
    } else if (v.is_dict()) {
      for (const auto& [k, c] : v.as_dict().items) MapAll(c);
    }
  }

  void Resolve(Value& v) {
    if (IsTensorReference(v)) {
      const int64_t tid = TensorReferenceId(v);
      if (tid < 0) throw Error(dir + ": a TensorReference has the negative tid " + std::to_string(tid));
      if (!seen.insert(tid).second)
        throw Error(dir + ": tid " + std::to_string(tid) + " is referenced twice; each tensor of an xser file has its own tid");
      const Declared* declared = nullptr;
      if (info) {
        auto it = info->find(tid);
        if (it == info->end())
          throw Error(dir + ": tid " + std::to_string(tid) + " is out of range: " + info_path + " declares no such tensor");
        declared = &it->second;
      }
      const std::string file = DirOf(tid) + "/tensor_" + std::to_string(tid) + ".pt";
      auto m = mapped.find(tid);
      if (m == mapped.end()) throw Error(file + ": missing xser tensor file for tid " + std::to_string(tid));
      Value t = LoadPtFromFile(std::move(m->second), opts);
      mapped.erase(m);
      if (!t.is_tensor()) throw Error(file + ": xser tensor file holds a " + t.kind_name() + ", not a tensor");
      const Tensor& x = t.as_tensor();
      // NNM's TensorReference also declares the shape (torch-xla's holds the tid alone).
      const Object& ref = v.as_object();
      if (const Value* shape = ref.state && ref.state->is_dict() ? ref.state->as_dict().Find("shape") : nullptr; shape && shape->is_seq()) {
        const auto dims = Dims(*shape, file + ": declared shape");
        if (dims != x.shape())
          throw Error(file + ": holds a tensor of shape " + ShapeString(x.shape()) + ", but its TensorReference (tid " +
                      std::to_string(tid) + ") declares " + ShapeString(dims));
      }
      if (declared && (declared->shape != x.shape() || declared->dtype != x.dtype()))
        throw Error(file + ": holds a " + std::string(DTypeName(x.dtype())) + " tensor of shape " + ShapeString(x.shape()) + ", but " +
                    info_path + " declares tid " + std::to_string(tid) + " " + std::string(DTypeName(declared->dtype)) + " " +
                    ShapeString(declared->shape));
      v = std::move(t);
      return;
    }
    if (v.is_seq()) {
      for (Value& c : v.as_seq().items) Resolve(c);
    } else if (v.is_dict()) {
      for (auto& [k, c] : v.as_dict().items) Resolve(c);
    }
  }
};

}  // namespace

Value LoadXser(const std::string& path, const LoadOptions& opts, Env* env) {
  Value root = LoadPt(path, opts, env);
  const std::string info_path = path + ".info.pt";
  try {
    std::map<int64_t, Declared> info;
    const bool has_info = env->Exists(info_path);
    if (has_info) info = LoadInfo(info_path, opts, env);
    Resolver r{XserTensorDir(path), opts, env, has_info ? &info : nullptr, info_path, {}, {}, std::nullopt, std::nullopt, XserSharedTensorDir(path)};
    r.MapAll(root);
    r.Resolve(root);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (referenced from " + path + ")");
  }
  return root;
}

std::string XserSharedTensorDir(const std::string& path) {
  const size_t slash = path.find_last_of('/'), base = slash == std::string::npos ? 0 : slash + 1;
  static const std::regex ep(R"(ep_rank_\d{2})");
  const std::string name = path.substr(base), shared = std::regex_replace(name, ep, "ep_rank_00");
  return shared == name ? "" : XserTensorDir(path.substr(0, base) + shared);
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
Value Replace(const Value& v, std::vector<XserPart>& parts, Value& info, const std::string& dir, bool expert = false) {
  if (v.is_tensor()) {
    const Tensor& t = v.as_tensor();
    const int64_t tid = static_cast<int64_t>(parts.size());
    parts.push_back({dir + "/tensor_" + std::to_string(tid) + ".pt", v, expert});
    Value meta = Value::NewDict();
    meta.as_dict().Set("dtype", Value(Global{"torch", std::string(DTypeName(t.dtype()))}));
    std::vector<Value> dims;
    for (int64_t d : t.shape()) dims.emplace_back(d);
    meta.as_dict().Set("shape", Value::NewSeq(SeqKind::kTorchSize, std::move(dims)));
    meta.as_dict().Set("expert_model_parallel", Value(expert));
    info.as_dict().items.emplace_back(Value(tid), meta);
    return MakeTensorReference(tid);
  }
  if (v.is_seq()) {
    const Sequence& s = v.as_seq();
    std::vector<Value> items;
    for (const Value& c : s.items) items.push_back(Replace(c, parts, info, dir, expert));
    return Value::NewSeq(s.kind, std::move(items));
  }
  if (v.is_dict()) {
    const Dict& d = v.as_dict();
    Value out = Value::NewDict(d.ordered);
    out.as_dict().attrs = d.attrs;
    for (const auto& [k, c] : d.items) out.as_dict().items.emplace_back(k, Replace(c, parts, info, dir, expert));
    return out;
  }
  return v;
}

}  // namespace

std::vector<XserPart> SplitForXser(const std::string& path, const Value& root, const std::function<bool(const std::string&)>& expert) {
  std::vector<XserPart> parts;
  Value info = Value::NewDict();
  Value refs;
  if (expert && root.is_dict()) {  // a model file: its top-level keys are the parameters NxD marks or not
    const Dict& d = root.as_dict();
    refs = Value::NewDict(d.ordered);
    refs.as_dict().attrs = d.attrs;
    for (const auto& [k, c] : d.items)
      refs.as_dict().items.emplace_back(k, Replace(c, parts, info, XserTensorDir(path), k.is_str() && expert(k.as_str())));
  } else {
    refs = Replace(root, parts, info, XserTensorDir(path));
  }
  parts.push_back({path, refs});
  parts.push_back({path + ".info.pt", info});
  return parts;
}

std::vector<int> XserBins(const std::vector<uint64_t>& bytes, int bins) {
  std::vector<size_t> order(bytes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes[a] < bytes[b]; });
  std::vector<uint64_t> total(static_cast<size_t>(std::max(bins, 1)), 0);
  std::vector<int> bin(bytes.size(), 0);
  for (size_t tid : order) {
    const size_t b = static_cast<size_t>(std::min_element(total.begin(), total.end()) - total.begin());  // the first minimum
    bin[tid] = static_cast<int>(b);
    total[b] += bytes[tid];
  }
  return bin;
}

}  // namespace ckpt

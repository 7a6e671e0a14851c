#include "ckpt/store/snapshot.h"

#include <tbb/parallel_for.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "ckpt/pt/dtype_cast.h"
#include "ckpt/util/error.h"

namespace ckpt {

namespace {
// The dtype a snapshot stores `t` in: `floats_to` for the float types it
// converts, else t's own.
DType SnapshotDType(const Tensor& t, std::optional<DType> floats_to) {
  return floats_to && CanCast(t.dtype(), *floats_to) ? *floats_to : t.dtype();
}

}  // namespace

void SnapshotPool::Reserve(const Value& like, std::optional<DType> floats_to, const TensorFilter& copies) {
  std::vector<std::shared_ptr<Storage>> held;  // released into the pool at the end
  std::vector<const Tensor*> tensors;
  ForEachTensor(like, [&](const Tensor& t) { tensors.push_back(&t); });
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (copies && !copies(i)) continue;
    held.push_back(Acquire(static_cast<size_t>(tensors[i]->numel()) * ElementSize(SnapshotDType(*tensors[i], floats_to))));
    std::memset(held.back()->mutable_data(), 0, held.back()->nbytes());
  }
}

namespace {

// Copies the containers; tensors are still shared here and copied after.
Value CopyContainers(const Value& v) {
  if (v.is_seq()) {
    Value out = Value::NewSeq(v.as_seq().kind);
    for (const Value& c : v.as_seq().items) out.as_seq().items.push_back(CopyContainers(c));
    return out;
  }
  if (v.is_dict()) {
    Value out = Value::NewDict(v.as_dict().ordered);
    for (const auto& [k, c] : v.as_dict().items) out.as_dict().items.emplace_back(k, CopyContainers(c));
    out.as_dict().attrs = v.as_dict().attrs;
    return out;
  }
  return v;  // tensors (copied below), scalars, objects (shared: snapshots never mutate them)
}

void CollectTensors(Value& v, std::vector<Tensor*>& out) {
  if (v.is_tensor()) out.push_back(&v.as_tensor());
  else if (v.is_seq()) for (Value& c : v.as_seq().items) CollectTensors(c, out);
  else if (v.is_dict()) for (auto& [k, c] : v.as_dict().items) CollectTensors(c, out);
}

Tensor CopyInto(const Tensor& t, SnapshotPool* pool, std::optional<DType> floats_to) {
  const DType dtype = SnapshotDType(t, floats_to);
  if (!pool) return dtype == t.dtype() ? t.Clone() : CastTensor(t, dtype);
  const Tensor src = t.Contiguous();
  Tensor out(dtype, src.shape(), Tensor::ContiguousStrides(src.shape()), 0,
             pool->Acquire(static_cast<size_t>(src.numel()) * ElementSize(dtype)));
  out.set_parameter(t.is_parameter());
  out.set_requires_grad(t.requires_grad());
  if (dtype != src.dtype()) CastInto(src, out);
  else if (src.nbytes()) std::memcpy(out.mutable_data(), src.data(), src.nbytes());
  return out;
}

}  // namespace

Value CopyForSnapshot(const Value& v, SnapshotPool* pool, std::optional<DType> floats_to, const TensorFilter& copies) {
  Value out = CopyContainers(v);
  std::vector<Tensor*> tensors;
  CollectTensors(out, tensors);
  tbb::parallel_for(size_t{0}, tensors.size(), [&](size_t i) {
    if (!copies || copies(i)) {
      *tensors[i] = CopyInto(*tensors[i], pool, floats_to);
      return;
    }
    const Tensor& t = *tensors[i];
    const DType dtype = SnapshotDType(t, floats_to);
    const std::string shape = ShapeString(t.shape());
    *tensors[i] = Tensor(dtype, t.shape(), Tensor::ContiguousStrides(t.shape()), 0,
                         Storage::Generated(static_cast<size_t>(t.numel()) * ElementSize(dtype), [shape](uint64_t, std::span<uint8_t>) {
                           throw Error("a snapshot placeholder of shape " + shape + " was written: another rank writes this tensor");
                         }));
  });
  return out;
}

std::vector<uint64_t> SnapshotTensorBytes(const Value& v, std::optional<DType> floats_to) {
  std::vector<uint64_t> out;
  ForEachTensor(v, [&](const Tensor& t) { out.push_back(static_cast<uint64_t>(t.numel()) * ElementSize(SnapshotDType(t, floats_to))); });
  return out;
}

}  // namespace ckpt

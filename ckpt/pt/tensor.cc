#include "ckpt/pt/tensor.h"

#include <cstring>
#include <string>

#include "ckpt/util/error.h"

namespace ckpt {

int64_t ShapeNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

namespace {

// Multiplies with an overflow check, for numel of hostile shapes.
int64_t CheckedMul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw Error("tensor size overflows int64");
  return r;
}

}  // namespace

Tensor::Tensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
               int64_t storage_offset, std::shared_ptr<Storage> storage)
    : dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)),
      offset_(storage_offset), storage_(std::move(storage)) {
  if (!storage_) throw Error("tensor has no storage");
  if (shape_.size() != strides_.size())
    throw Error("tensor shape " + ShapeString(shape_) + " and stride " + ShapeString(strides_) +
                " differ in rank");
  if (offset_ < 0) throw Error("tensor storage offset is negative");
  // The furthest element the view touches must lie inside the storage.
  int64_t last = offset_;
  bool empty = false;
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (shape_[i] < 0) throw Error("tensor shape " + ShapeString(shape_) + " has a negative size");
    if (strides_[i] < 0) throw Error("tensor stride " + ShapeString(strides_) + " is negative");
    if (shape_[i] == 0) empty = true;
    else last += CheckedMul(shape_[i] - 1, strides_[i]);
  }
  const int64_t elements = static_cast<int64_t>(storage_->nbytes() / ElementSize(dtype_));
  if (!empty && last >= elements)
    throw Error("tensor view (shape " + ShapeString(shape_) + ", stride " + ShapeString(strides_) +
                ", offset " + std::to_string(offset_) + ") is larger than its storage of " +
                std::to_string(elements) + " " + std::string(DTypeName(dtype_)) + " elements");
}

std::vector<int64_t> Tensor::ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s = CheckedMul(s, std::max<int64_t>(shape[i], 1));
  }
  return st;
}

namespace {
Tensor NewContiguous(DType dtype, std::vector<int64_t> shape, bool zero) {
  int64_t n = 1;
  for (int64_t d : shape) n = CheckedMul(n, d);
  auto st = Tensor::ContiguousStrides(shape);
  return Tensor(dtype, std::move(shape), std::move(st), 0,
                Storage::Allocate(static_cast<size_t>(n) * ElementSize(dtype), zero));
}
}  // namespace

Tensor Tensor::Zeros(DType dtype, std::vector<int64_t> shape) { return NewContiguous(dtype, std::move(shape), true); }
Tensor Tensor::Empty(DType dtype, std::vector<int64_t> shape) { return NewContiguous(dtype, std::move(shape), false); }

Tensor Tensor::FromBytes(DType dtype, std::vector<int64_t> shape, std::span<const uint8_t> bytes) {
  Tensor t = Empty(dtype, std::move(shape));
  if (bytes.size() != t.nbytes())
    throw Error("tensor of " + std::to_string(t.nbytes()) + " bytes given " +
                std::to_string(bytes.size()) + " bytes");
  if (!bytes.empty()) std::memcpy(t.mutable_data(), bytes.data(), bytes.size());
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 0) return true;
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

Tensor Tensor::Contiguous() const {
  if (is_contiguous()) return *this;
  return Clone();
}

Tensor Tensor::Clone() const {
  Tensor out = Empty(dtype_, shape_);
  out.requires_grad_ = requires_grad_;
  out.is_parameter_ = is_parameter_;
  const size_t es = ElementSize(dtype_);
  if (is_contiguous()) {
    if (nbytes()) std::memcpy(out.mutable_data(), data(), nbytes());
    return out;
  }
  // Strided gather: walk the index odometer, copying the innermost run.
  const int64_t n = numel();
  if (n == 0) return out;
  const size_t nd = shape_.size();
  std::vector<int64_t> idx(nd, 0);
  const uint8_t* base = storage_->data();
  uint8_t* dst = out.mutable_data();
  const int64_t inner = shape_[nd - 1], inner_stride = strides_[nd - 1];
  for (int64_t done = 0; done < n; done += inner) {
    int64_t off = offset_;
    for (size_t d = 0; d + 1 < nd; ++d) off += idx[d] * strides_[d];
    for (int64_t j = 0; j < inner; ++j)
      std::memcpy(dst + (done + j) * es, base + (off + j * inner_stride) * es, es);
    for (size_t d = nd - 1; d-- > 0;) {
      if (++idx[d] < shape_[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

Tensor Tensor::Narrow0(int64_t begin, int64_t end) const {
  if (shape_.empty() || begin < 0 || end < begin || end > shape_[0])
    throw Error("narrow [" + std::to_string(begin) + ", " + std::to_string(end) +
                ") out of range for shape " + ShapeString(shape_));
  auto shape = shape_;
  shape[0] = end - begin;
  Tensor t(dtype_, shape, strides_, offset_ + begin * strides_[0], storage_);
  t.requires_grad_ = requires_grad_;
  t.is_parameter_ = is_parameter_;
  return t;
}

}  // namespace ckpt

// Tensor is a typed, strided view of a shared Storage, exactly as torch models
// it: shape, strides and storage offset are in elements. Copying a Tensor
// copies the view, never the bytes. Several tensors may view one storage, and
// the .pt writer keeps that sharing.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ckpt/pt/dtype.h"
#include "ckpt/pt/storage.h"

namespace ckpt {

class Tensor {
 public:
  Tensor() = default;
  // Throws ckpt::Error if the view reaches outside the storage.
  Tensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
         int64_t storage_offset, std::shared_ptr<Storage> storage);

  // A new contiguous, zero-filled tensor with its own storage.
  static Tensor Zeros(DType dtype, std::vector<int64_t> shape);
  // The same, with contents left uninitialised (for callers that fill it all).
  static Tensor Empty(DType dtype, std::vector<int64_t> shape);
  // A contiguous tensor holding a copy of `bytes` (size must match).
  static Tensor FromBytes(DType dtype, std::vector<int64_t> shape, std::span<const uint8_t> bytes);

  static std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t storage_offset() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * ElementSize(dtype_); }
  bool is_contiguous() const;
  bool defined() const { return storage_ != nullptr; }

  // Parameter-ness survives a round trip (torch._utils._rebuild_parameter).
  bool requires_grad() const { return requires_grad_; }
  bool is_parameter() const { return is_parameter_; }
  void set_requires_grad(bool v) { requires_grad_ = v; }
  void set_parameter(bool v) { is_parameter_ = v; }

  // Pointer to the first element; valid for nbytes() when is_contiguous().
  const uint8_t* data() const { return storage_->data() + offset_ * ElementSize(dtype_); }
  uint8_t* mutable_data() { return storage_->mutable_data() + offset_ * ElementSize(dtype_); }

  // Element bytes in row-major order: the view itself when contiguous,
  // otherwise a compact copy.
  Tensor Contiguous() const;
  // A compact copy with its own storage (e.g. to detach from a mapped file).
  Tensor Clone() const;
  // Rows [begin, end) of dim 0: a view, no copy.
  Tensor Narrow0(int64_t begin, int64_t end) const;

 private:
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_, strides_;
  int64_t offset_ = 0;
  std::shared_ptr<Storage> storage_;
  bool requires_grad_ = false;
  bool is_parameter_ = false;
};

// "[2, 3]": a shape (or strides) for messages and listings.
std::string ShapeString(const std::vector<int64_t>& shape);
// Elements of a tensor of this shape (1 for a 0-d shape).
int64_t ShapeNumel(const std::vector<int64_t>& shape);

}  // namespace ckpt

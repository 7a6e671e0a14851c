// Tensor element types as torch names them, with the facts the .pt format
// needs: element size, the typed-storage class name and the dtype global.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace ckpt {

enum class DType {
  kFloat32, kFloat64, kFloat16, kBFloat16,
  kInt64, kInt32, kInt16, kInt8, kUInt8, kBool,
  kComplex64, kComplex128,
};

size_t ElementSize(DType t);
// "float32", "bfloat16", ...: the name torch prints after "torch.".
std::string_view DTypeName(DType t);
// "FloatStorage", "BFloat16Storage", ...: torch's legacy typed storage class.
std::string_view StorageClassName(DType t);

std::optional<DType> DTypeFromName(std::string_view name);
std::optional<DType> DTypeFromStorageClass(std::string_view cls);

}  // namespace ckpt

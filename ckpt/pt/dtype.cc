#include "ckpt/pt/dtype.h"

#include <array>

namespace ckpt {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
  std::string_view storage;
  std::string_view alias;  // torch's other name for the same dtype global
};

constexpr std::array<DTypeInfo, 12> kInfo = {{
    {DType::kFloat32, 4, "float32", "FloatStorage", "float"},
    {DType::kFloat64, 8, "float64", "DoubleStorage", "double"},
    {DType::kFloat16, 2, "float16", "HalfStorage", "half"},
    {DType::kBFloat16, 2, "bfloat16", "BFloat16Storage", ""},
    {DType::kInt64, 8, "int64", "LongStorage", "long"},
    {DType::kInt32, 4, "int32", "IntStorage", "int"},
    {DType::kInt16, 2, "int16", "ShortStorage", "short"},
    {DType::kInt8, 1, "int8", "CharStorage", ""},
    {DType::kUInt8, 1, "uint8", "ByteStorage", ""},
    {DType::kBool, 1, "bool", "BoolStorage", ""},
    {DType::kComplex64, 8, "complex64", "ComplexFloatStorage", "cfloat"},
    {DType::kComplex128, 16, "complex128", "ComplexDoubleStorage", "cdouble"},
}};

const DTypeInfo& Info(DType t) { return kInfo[static_cast<size_t>(t)]; }

}  // namespace

size_t ElementSize(DType t) { return Info(t).size; }
std::string_view DTypeName(DType t) { return Info(t).name; }
std::string_view StorageClassName(DType t) { return Info(t).storage; }

std::optional<DType> DTypeFromName(std::string_view name) {
  for (const auto& i : kInfo)
    if (name == i.name || (!i.alias.empty() && name == i.alias)) return i.dtype;
  return std::nullopt;
}

std::optional<DType> DTypeFromStorageClass(std::string_view cls) {
  for (const auto& i : kInfo)
    if (cls == i.storage) return i.dtype;
  return std::nullopt;
}

}  // namespace ckpt

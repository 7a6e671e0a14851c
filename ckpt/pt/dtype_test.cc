#include "ckpt/pt/dtype.h"

#include <gtest/gtest.h>

namespace ckpt {

TEST(DType, SizesNamesAndStorageClassesRoundTrip) {
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt64, DType::kInt32,
                  DType::kInt16, DType::kInt8, DType::kUInt8, DType::kBool, DType::kComplex64, DType::kComplex128}) {
    EXPECT_EQ(DTypeFromName(DTypeName(t)), t);
    EXPECT_EQ(DTypeFromStorageClass(StorageClassName(t)), t);
  }
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2u);
  EXPECT_EQ(ElementSize(DType::kComplex128), 16u);
  EXPECT_EQ(DTypeFromName("half"), DType::kFloat16);  // torch.half is torch.float16
  EXPECT_EQ(DTypeFromStorageClass("CharStorage"), DType::kInt8);
  EXPECT_FALSE(DTypeFromName("float8_e4m3fn").has_value());
}

}  // namespace ckpt

#include "ckpt/pt/tensor.h"

#include <gtest/gtest.h>

#include <numeric>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

Tensor Iota(int64_t n) {
  Tensor t = Tensor::Zeros(DType::kInt32, {n});
  std::iota(reinterpret_cast<int32_t*>(t.mutable_data()), reinterpret_cast<int32_t*>(t.mutable_data()) + n, 0);
  return t;
}

TEST(Tensor, TransposedViewClonesToRowMajorOrder) {
  Tensor base = Iota(6);  // [[0,1,2],[3,4,5]] viewed transposed: [[0,3],[1,4],[2,5]]
  Tensor t(DType::kInt32, {3, 2}, {1, 3}, 0, base.storage());
  EXPECT_FALSE(t.is_contiguous());
  Tensor c = t.Contiguous();
  EXPECT_TRUE(c.is_contiguous());
  const int32_t* p = reinterpret_cast<const int32_t*>(c.data());
  EXPECT_EQ(std::vector<int32_t>(p, p + 6), (std::vector<int32_t>{0, 3, 1, 4, 2, 5}));
  EXPECT_NE(c.storage(), base.storage());
}

TEST(Tensor, ViewsShareStorageWithoutCopy) {
  Tensor base = Iota(10);
  Tensor v = base.Narrow0(2, 5);
  EXPECT_EQ(v.storage(), base.storage());
  EXPECT_EQ(v.storage_offset(), 2);
  EXPECT_EQ(reinterpret_cast<const int32_t*>(v.data())[0], 2);
}

TEST(Tensor, ViewLargerThanStorageIsRejected) {
  auto s = Storage::Allocate(4 * 4);
  EXPECT_THROW(Tensor(DType::kFloat32, {5}, {1}, 0, s), Error);
  EXPECT_THROW(Tensor(DType::kFloat32, {2}, {1}, 3, s), Error);
  EXPECT_THROW(Tensor(DType::kFloat32, {2, 2}, {3, 1}, 0, s), Error);
  EXPECT_THROW(Tensor(DType::kFloat32, {-1}, {1}, 0, s), Error);
  EXPECT_NO_THROW(Tensor(DType::kFloat32, {0, 100}, {100, 1}, 0, s));  // empty views fit anywhere
  try {
    Tensor(DType::kFloat32, {5}, {1}, 0, s);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("larger than its storage of 4 float32 elements"), std::string::npos);
  }
}

TEST(Tensor, ZeroDimAndEmpty) {
  Tensor s = Tensor::Zeros(DType::kFloat64, {});
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.nbytes(), 8u);
  Tensor e = Tensor::Zeros(DType::kFloat32, {0, 3});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(e.Clone().nbytes(), 0u);
}

TEST(Tensor, BorrowedStorageIsReadOnly) {
  auto owner = std::make_shared<int>(0);
  static const uint8_t bytes[8] = {};
  Tensor t(DType::kFloat32, {2}, {1}, 0, Storage::Borrow(owner, bytes, 8));
  EXPECT_THROW(t.mutable_data(), Error);
  Tensor c = t.Clone();
  EXPECT_NO_THROW(c.mutable_data());
}

}  // namespace
}  // namespace ckpt

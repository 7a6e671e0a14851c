#include "ckpt/pt/dtype_cast.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

float Bits(uint32_t b) { return std::bit_cast<float>(b); }

TEST(BFloat16, ExactValuesRoundTrip) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 0.15625f, 3.3895314e38f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(f)), f) << f;
    EXPECT_EQ(std::signbit(RoundToBFloat16(f)), std::signbit(f));
  }
}

TEST(BFloat16, RoundsToNearestWithTiesToEven) {
  // 1.0 has an even last bfloat16 bit, 1 + 2^-7 an odd one; halfway cases go to the even neighbour.
  EXPECT_EQ(FloatToBFloat16(Bits(0x3f808000)), 0x3f80);  // halfway above 1.0: down to even
  EXPECT_EQ(FloatToBFloat16(Bits(0x3f818000)), 0x3f82);  // halfway above 1+2^-7: up to even
  EXPECT_EQ(FloatToBFloat16(Bits(0x3f808001)), 0x3f81);  // just past halfway: up
  EXPECT_EQ(FloatToBFloat16(Bits(0x3f807fff)), 0x3f80);  // just below halfway: down
  EXPECT_EQ(FloatToBFloat16(Bits(0xbf808001)), 0xbf81);  // the same for negatives
  EXPECT_EQ(FloatToBFloat16(Bits(0x3fffffff)), 0x4000);  // a carry into the exponent
  EXPECT_EQ(FloatToBFloat16(Bits(0x00000001)), 0x0000);  // the smallest subnormal rounds to zero
  EXPECT_EQ(FloatToBFloat16(Bits(0x00018000)), 0x0002);  // subnormals round like any value
}

TEST(BFloat16, OverflowIsInfinityAndNaNStaysNaN) {
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()), 0x7fc0);
  EXPECT_EQ(FloatToBFloat16(Bits(0xff800001)), 0x7fc0);  // a signalling NaN whose payload would truncate to infinity
  EXPECT_TRUE(std::isnan(RoundToBFloat16(Bits(0x7f800001))));
}

TEST(CastTensor, ConvertsEveryElementOfAStridedView) {
  Tensor base = Tensor::Zeros(DType::kFloat32, {2, 3});
  float* p = reinterpret_cast<float*>(base.mutable_data());
  for (int i = 0; i < 6; ++i) p[i] = 1.0f + static_cast<float>(i) / 1024.0f;  // rows [0,1,2], [3,4,5]
  const Tensor transposed(DType::kFloat32, {3, 2}, {1, 3}, 0, base.storage());
  const Tensor b = CastTensor(transposed, DType::kBFloat16);
  ASSERT_EQ(b.shape(), (std::vector<int64_t>{3, 2}));
  const uint16_t* q = reinterpret_cast<const uint16_t*>(b.data());
  const int order[6] = {0, 3, 1, 4, 2, 5};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(q[i], FloatToBFloat16(p[order[i]])) << i;
  const Tensor back = CastTensor(b, DType::kFloat64);
  const double* d = reinterpret_cast<const double*>(back.data());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(d[i], static_cast<double>(BFloat16ToFloat(q[i])));
  const Tensor f = CastTensor(back, DType::kFloat32);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(reinterpret_cast<const float*>(f.data())[i], BFloat16ToFloat(q[i]));
}

TEST(CastTensor, LargeTensorsSplitAcrossThreadsGiveTheSameBits) {
  const int64_t n = (1 << 18) + 7;
  Tensor t = Tensor::Empty(DType::kFloat32, {n});
  float* p = reinterpret_cast<float*>(t.mutable_data());
  for (int64_t i = 0; i < n; ++i) p[i] = std::sin(static_cast<float>(i)) * 1e3f;
  const Tensor b = CastTensor(t, DType::kBFloat16);
  const uint16_t* q = reinterpret_cast<const uint16_t*>(b.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(q[i], FloatToBFloat16(p[i])) << i;
}

TEST(CastTensor, NonFloatTypesAreRefusedByName) {
  const Tensor ints = Tensor::Zeros(DType::kInt64, {2});
  try {
    CastTensor(ints, DType::kFloat32);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "cannot convert int64 to float32 (float32, float64 and bfloat16 convert)");
  }
  EXPECT_FALSE(CanCast(DType::kFloat16, DType::kFloat32));
}

}  // namespace
}  // namespace ckpt

// Converting floating-point tensors between float32, float64 and bfloat16 as
// torch's Tensor.to(dtype) does: round to nearest, ties to even; NaN becomes
// the quiet NaN 0x7fc0 (torch's scalar path; its vector path writes 0xffff);
// values past bfloat16's range become infinities. Mixed precision training
// keeps bfloat16 parameters and writes them this way, and loading a
// checkpoint of another float type converts through here.
#pragma once

#include <cstdint>

#include "ckpt/pt/tensor.h"

namespace ckpt {

uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t b);
// f rounded to the nearest bfloat16, as a float.
inline float RoundToBFloat16(float f) { return BFloat16ToFloat(FloatToBFloat16(f)); }

// Whether CastTensor converts between the two: float32, float64, bfloat16.
bool CanCast(DType from, DType to);

// A new contiguous tensor of dtype `to` (a copy even when the dtype is the
// same). Throws ckpt::Error unless CanCast.
Tensor CastTensor(const Tensor& t, DType to);
// Converts every element of `src` into `dst`, a contiguous tensor of the same
// number of elements (parallel over blocks). Throws unless CanCast.
void CastInto(const Tensor& src, Tensor& dst);

}  // namespace ckpt

#include "ckpt/pt/dtype_cast.h"

#include <tbb/parallel_for.h>

#include <bit>
#include <cstring>
#include <string>

#include "ckpt/util/error.h"

namespace ckpt {

uint16_t FloatToBFloat16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // c10::BFloat16's canonical NaN
  // Round to nearest even on the 16 dropped bits; a carry into the exponent
  // rounds up to the next binade or to infinity, as it should.
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float BFloat16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

bool CanCast(DType from, DType to) {
  auto ok = [](DType t) { return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kBFloat16; };
  return ok(from) && ok(to);
}

namespace {

// Element i of a contiguous tensor, widened to double.
double Load(const uint8_t* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DType::kFloat64: return reinterpret_cast<const double*>(p)[i];
    default: return BFloat16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
  }
}

}  // namespace

void CastInto(const Tensor& src_view, Tensor& dst) {
  if (!CanCast(src_view.dtype(), dst.dtype()))
    throw Error("cannot convert " + std::string(DTypeName(src_view.dtype())) + " to " + std::string(DTypeName(dst.dtype())) +
                " (float32, float64 and bfloat16 convert)");
  if (src_view.numel() != dst.numel() || !dst.is_contiguous())
    throw Error("cast of " + ShapeString(src_view.shape()) + " into " + ShapeString(dst.shape()) + ": sizes differ");
  const Tensor src = src_view.Contiguous();
  const uint8_t* in = src.data();
  uint8_t* out = dst.mutable_data();
  const DType from = src.dtype(), to = dst.dtype();
  if (from == to) {
    if (src.nbytes()) std::memcpy(out, in, src.nbytes());
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, src.numel(), 1 << 16), [&](const tbb::blocked_range<int64_t>& r) {
    if (from == DType::kFloat32 && to == DType::kBFloat16) {  // the hot path: one rounding, no detour through double
      const float* f = reinterpret_cast<const float*>(in);
      uint16_t* b = reinterpret_cast<uint16_t*>(out);
      for (int64_t i = r.begin(); i < r.end(); ++i) b[i] = FloatToBFloat16(f[i]);
      return;
    }
    for (int64_t i = r.begin(); i < r.end(); ++i) {
      const double v = Load(in, from, i);
      switch (to) {
        case DType::kFloat32: reinterpret_cast<float*>(out)[i] = static_cast<float>(v); break;
        case DType::kFloat64: reinterpret_cast<double*>(out)[i] = v; break;
        // float64 -> bfloat16 goes through float32, as torch does; bfloat16 -> bfloat16 is exact.
        default: reinterpret_cast<uint16_t*>(out)[i] = FloatToBFloat16(static_cast<float>(v)); break;
      }
    }
  });
}

Tensor CastTensor(const Tensor& t, DType to) {
  Tensor out = Tensor::Empty(to, t.shape());
  CastInto(t, out);
  out.set_parameter(t.is_parameter());
  out.set_requires_grad(t.requires_grad());
  return out;
}

}  // namespace ckpt

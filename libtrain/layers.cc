#include "libtrain/layers.h"

#include <tbb/parallel_for.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>

namespace train {
namespace {
using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<Mat>;
using CMap = Eigen::Map<const Mat>;
}  // namespace

// Eigen runs a product on one thread here; these split it into row blocks
// across TBB tasks. Each output row is computed by the same code whatever the
// split, so results do not depend on the thread count.
namespace {
template <typename F>
void RowBlocks(int64_t rows, const F& f) {
  const int64_t block = std::max<int64_t>(16, rows / 16);
  tbb::parallel_for(int64_t{0}, (rows + block - 1) / block, [&](int64_t b) {
    const int64_t r0 = b * block;
    f(r0, std::min(rows, r0 + block) - r0);
  });
}
}  // namespace

void LinearForward(float* out, const float* x, const float* w, const float* bias, int64_t N, int64_t K, int64_t C) {
  RowBlocks(N, [&](int64_t r0, int64_t n) {
    Map(out + r0 * C, n, C).noalias() = CMap(x + r0 * K, n, K) * CMap(w, C, K).transpose();
    if (bias)
      for (int64_t r = r0; r < r0 + n; ++r)
        for (int64_t c = 0; c < C; ++c) out[r * C + c] += bias[c];
  });
}

void LinearBackward(float* dx, float* dw, float* dbias, const float* dout, const float* x, const float* w, int64_t N,
                    int64_t K, int64_t C) {
  if (dbias)  // serial over rows, so the sum order is fixed
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) dbias[c] += dout[n * C + c];
  if (dx)
    RowBlocks(N, [&](int64_t r0, int64_t n) {
      Map(dx + r0 * K, n, K).noalias() = CMap(dout + r0 * C, n, C) * CMap(w, C, K);
    });
  // dw rows c0..c1 need dout's columns c0..c1: a strided block of dout.
  using Stride = Eigen::OuterStride<>;
  RowBlocks(C, [&](int64_t c0, int64_t n) {
    Eigen::Map<const Mat, 0, Stride> dcols(dout + c0, N, n, Stride(C));
    Map(dw + c0 * K, n, K).noalias() += dcols.transpose() * CMap(x, N, K);
  });
}

void EmbeddingForward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t H, int64_t v0, int64_t V) {
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const int64_t row = int64_t{tokens[n]} - v0;
    if (row >= 0 && row < V) std::memcpy(out + n * H, wte + row * H, H * sizeof(float));
    else std::fill(out + n * H, out + (n + 1) * H, 0.0f);
  });
}

void EmbeddingBackward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t H, int64_t v0, int64_t V) {
  for (int64_t n = 0; n < N; ++n) {  // serial: tokens repeat
    const int64_t r = int64_t{tokens[n]} - v0;
    if (r < 0 || r >= V) continue;
    float* row = dwte + r * H;
    for (int64_t i = 0; i < H; ++i) row[i] += dout[n * H + i];
  }
}

void RmsNormForward(float* out, float* rstd, const float* x, const float* w, float eps, int64_t N, int64_t H) {
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const float* xn = x + n * H;
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += double{xn[i]} * xn[i];
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / H) + eps);
    rstd[n] = r;
    for (int64_t i = 0; i < H; ++i) out[n * H + i] = xn[i] * r * w[i];
  });
}

void RmsNormBackward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                     int64_t N, int64_t H) {
  // dw: reduce over positions (serial over n to keep the sum order fixed).
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < H; ++i) dw[i] += dout[n * H + i] * x[n * H + i] * rstd[n];
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const float* xn = x + n * H;
    const float* dn = dout + n * H;
    const float r = rstd[n];
    double dot = 0;  // sum_i dout_i * w_i * x_i
    for (int64_t i = 0; i < H; ++i) dot += double{dn[i]} * w[i] * xn[i];
    const float c = static_cast<float>(dot / H) * r * r * r;
    for (int64_t i = 0; i < H; ++i) dx[n * H + i] = dn[i] * w[i] * r - xn[i] * c;
  });
}

void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b, float eps,
                      int64_t N, int64_t H) {
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const float* xn = x + n * H;
    double sum = 0;
    for (int64_t i = 0; i < H; ++i) sum += xn[i];
    const float m = static_cast<float>(sum / H);
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += double{xn[i] - m} * (xn[i] - m);
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / H) + eps);
    mean[n] = m, rstd[n] = r;
    for (int64_t i = 0; i < H; ++i) out[n * H + i] = (xn[i] - m) * r * w[i] + b[i];
  });
}

void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                       const float* mean, const float* rstd, int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n)  // parameter gradients: serial over n to keep the sum order fixed
    for (int64_t i = 0; i < H; ++i) {
      dw[i] += dout[n * H + i] * (x[n * H + i] - mean[n]) * rstd[n];
      db[i] += dout[n * H + i];
    }
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const float* xn = x + n * H;
    const float* dn = dout + n * H;
    const float m = mean[n], r = rstd[n];
    // dx = r * (g - mean(g) - xhat * mean(g * xhat)), g = dout * w
    double gsum = 0, gxsum = 0;
    for (int64_t i = 0; i < H; ++i) {
      const double g = double{dn[i]} * w[i];
      gsum += g;
      gxsum += g * ((xn[i] - m) * r);
    }
    const float gmean = static_cast<float>(gsum / H), gxmean = static_cast<float>(gxsum / H);
    for (int64_t i = 0; i < H; ++i) dx[n * H + i] = r * (dn[i] * w[i] - gmean - (xn[i] - m) * r * gxmean);
  });
}

void RopeApply(float* x, int64_t t, const float* inv_freq, int64_t rot, bool inverse) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(t) * inv_freq[i];
    const float c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
    const float a = x[i], b = x[i + half];
    x[i] = a * c - b * s;      // rotate_half: [-x2, x1]
    x[i + half] = b * c + a * s;
  }
}

void SwiGluForward(float* out, const float* fc, int64_t N, int64_t F) {
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const float* g = fc + n * 2 * F;
    const float* u = g + F;
    for (int64_t i = 0; i < F; ++i) out[n * F + i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
}

void SwiGluBackward(float* dfc, const float* dout, const float* fc, int64_t N, int64_t F) {
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const float* g = fc + n * 2 * F;
    const float* u = g + F;
    float* dg = dfc + n * 2 * F;
    float* du = dg + F;
    for (int64_t i = 0; i < F; ++i) {
      const float sig = 1.0f / (1.0f + std::exp(-g[i]));
      const float d = dout[n * F + i];
      du[i] = d * g[i] * sig;
      dg[i] = d * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    }
  });
}

void GeluForward(float* out, const float* x, int64_t n) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 14), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) out[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * static_cast<float>(M_SQRT1_2)));
  });
}

void GeluBackward(float* dx, const float* dout, const float* x, int64_t n) {
  // d/dx x*Phi(x) = Phi(x) + x * phi(x)
  const float inv_sqrt_2pi = static_cast<float>(0.5 * M_2_SQRTPI * M_SQRT1_2);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 14), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t i = r.begin(); i < r.end(); ++i) {
      const float cdf = 0.5f * (1.0f + std::erf(x[i] * static_cast<float>(M_SQRT1_2)));
      const float pdf = inv_sqrt_2pi * std::exp(-0.5f * x[i] * x[i]);
      dx[i] = dout[i] * (cdf + x[i] * pdf);
    }
  });
}

namespace {
// splitmix64's finalizer: a bijection of 64-bit words that mixes every bit.
uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

uint64_t DropoutStream(uint64_t key, uint64_t site) { return Mix(Mix(key) ^ site); }

bool DropoutKeep(uint64_t stream, uint64_t i, float p) {
  // The top 24 bits as a uniform in [0, 1): exact in float.
  return static_cast<float>(Mix(stream + i) >> 40) * (1.0f / 16777216.0f) >= p;
}

float DropoutFactor(uint64_t stream, uint64_t i, float p) {
  if (p <= 0) return 1.0f;
  return DropoutKeep(stream, i, p) ? 1.0f / (1.0f - p) : 0.0f;
}

void DropoutApply(float* x, int64_t n, float p, uint64_t stream) {
  if (p <= 0) return;
  const float scale = 1.0f / (1.0f - p);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 14), [&](const tbb::blocked_range<int64_t>& r) {
    // A dropped element becomes +0, whatever its sign (x * 0 would keep it).
    for (int64_t i = r.begin(); i < r.end(); ++i) x[i] = DropoutKeep(stream, static_cast<uint64_t>(i), p) ? x[i] * scale : 0.0f;
  });
}

void DropoutApplyColumns(float* x, int64_t rows, int64_t cols, int64_t col0, int64_t total_cols, float p, uint64_t stream) {
  if (p <= 0) return;
  const float scale = 1.0f / (1.0f - p);
  tbb::parallel_for(int64_t{0}, rows, [&](int64_t r) {
    const uint64_t base = static_cast<uint64_t>(r * total_cols + col0);
    for (int64_t c = 0; c < cols; ++c) {
      float& v = x[r * cols + c];
      v = DropoutKeep(stream, base + static_cast<uint64_t>(c), p) ? v * scale : 0.0f;
    }
  });
}

void CrossEntropyRowMax(float* row_max, const float* logits, int64_t N, int64_t V) {
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) { row_max[n] = *std::max_element(logits + n * V, logits + (n + 1) * V); });
}

void CrossEntropySums(double* sum_exp, double* target_logit, float* probs, const float* logits, const float* row_max,
                      const int32_t* targets, int64_t v0, int64_t N, int64_t V) {
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    const float* l = logits + n * V;
    float* p = probs + n * V;
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += p[v] = std::exp(l[v] - row_max[n]);
    sum_exp[n] = sum;
    const int64_t t = int64_t{targets[n]} - v0;
    target_logit[n] = t >= 0 && t < V ? double{l[t]} : 0.0;
  });
}

float CrossEntropyFinish(float* probs, const double* sum_exp, const double* target_logit, const float* row_max, int64_t N,
                         int64_t V) {
  std::vector<double> losses(N);
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    float* p = probs + n * V;
    for (int64_t v = 0; v < V; ++v) p[v] = static_cast<float>(p[v] / sum_exp[n]);
    losses[n] = -(target_logit[n] - row_max[n] - std::log(sum_exp[n]));
  });
  double total = 0;
  for (double x : losses) total += x;
  return static_cast<float>(total / N);
}

void CrossEntropyBackward(float* dlogits, const float* probs, const int32_t* targets, int64_t v0, int64_t N, int64_t V) {
  const float inv = 1.0f / static_cast<float>(N);
  tbb::parallel_for(int64_t{0}, N, [&](int64_t n) {
    for (int64_t v = 0; v < V; ++v) dlogits[n * V + v] = probs[n * V + v] * inv;
    const int64_t t = int64_t{targets[n]} - v0;
    if (t >= 0 && t < V) dlogits[n * V + t] -= inv;
  });
}

}  // namespace train

// The decoder's layers as plain forward/backward function pairs over
// row-major float buffers (llm.c style), in the Megatron Llama layout NxDT
// and NNM use. N is the number of token positions (batch * sequence).
// Backward functions accumulate (+=) into parameter gradients and write
// (=) input gradients unless noted. Matrix products go through Eigen.
#pragma once

#include <cstdint>

namespace train {

// out[N,C] = x[N,K] * w[C,K]^T (+ bias[C] when bias is not null)
void LinearForward(float* out, const float* x, const float* w, const float* bias, int64_t N, int64_t K, int64_t C);
// dx[N,K] = dout * w   (dx may be null); dw[C,K] += dout^T * x;
// dbias[C] += column sums of dout (when dbias is not null)
void LinearBackward(float* dx, float* dw, float* dbias, const float* dout, const float* x, const float* w, int64_t N,
                    int64_t K, int64_t C);

// Rows [v0, v0 + V) of a vocab-parallel embedding, wte[V,H] (v0 = 0 and V
// the whole vocabulary in one process): out[n,:] = wte[tokens[n] - v0,:] for
// the tokens in those rows, 0 for the others (the ranks' outputs sum to the
// lookup). Backward accumulates the rows of the tokens in range.
void EmbeddingForward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t H, int64_t v0, int64_t V);
void EmbeddingBackward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t H, int64_t v0, int64_t V);

// out = x / sqrt(mean(x^2) + eps) * w; rstd[N] is saved for backward.
void RmsNormForward(float* out, float* rstd, const float* x, const float* w, float eps, int64_t N, int64_t H);
void RmsNormBackward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                     int64_t N, int64_t H);

// out = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var(x) + eps) (biased
// variance, as torch.nn.LayerNorm); mean[N] and rstd[N] are saved for backward.
void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b, float eps,
                      int64_t N, int64_t H);
void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                       const float* mean, const float* rstd, int64_t N, int64_t H);

// Rotary embedding, Megatron's non-interleaved form, on the first `rot` dims
// of a head vector at position t: x*cos + rotate_half(x)*sin. `inv_freq` has
// rot/2 entries. Backward is the rotation by -angle.
void RopeApply(float* x, int64_t t, const float* inv_freq, int64_t rot, bool inverse);

// SwiGLU on the fused [gate; up] projection: fc[N,2F] -> out[N,F] = silu(gate) * up
void SwiGluForward(float* out, const float* fc, int64_t N, int64_t F);
void SwiGluBackward(float* dfc, const float* dout, const float* fc, int64_t N, int64_t F);

// out = gelu(x) = x * Phi(x), the exact (erf) form torch.nn.functional.gelu
// computes by default
void GeluForward(float* out, const float* x, int64_t n);
void GeluBackward(float* dx, const float* dout, const float* x, int64_t n);

// Dropout with counter-based masks: element i of stream `stream` is kept
// when a hash of (stream, i) lands at or above p, and kept elements are scaled
// by 1/(1-p). A mask is a pure function of its stream and index, so backward
// (and activation recompute, and a resumed run) regenerates it instead of
// storing it. DropoutKeep is the mask of one element; DropoutFactor what
// dropout multiplies it by (0, or 1/(1-p) when kept; 1 when p is 0).
uint64_t DropoutStream(uint64_t key, uint64_t site);
bool DropoutKeep(uint64_t stream, uint64_t i, float p);
float DropoutFactor(uint64_t stream, uint64_t i, float p);
// x[i] = keep ? x[i] / (1 - p) : 0 for i in [0, n): forward on activations
// and backward on their gradients alike.
void DropoutApply(float* x, int64_t n, float p, uint64_t stream);

// Dropout on columns [col0, col0 + cols) of a [rows, total_cols] tensor held
// as x[rows, cols]: element (r, c) draws the mask of index r * total_cols +
// col0 + c, as DropoutApply on the whole tensor would.
void DropoutApplyColumns(float* x, int64_t rows, int64_t cols, int64_t col0, int64_t total_cols, float p, uint64_t stream);

// Mean cross-entropy over N positions of logits whose vocabulary columns
// [v0, v0 + V) are held here (Megatron's vocab_parallel_cross_entropy), in
// three steps with reductions over the ranks holding the other columns in
// between (none in one process):
//   1. row_max[N]: the row maxima here; the caller takes the maximum over ranks;
//   2. sum_exp[N] (of exp(logit - max), kept unnormalized in probs[N,V]) and
//      target_logit[N] (0 when the target is not here); the caller sums both;
//   3. the mean loss; probs becomes the softmax.
void CrossEntropyRowMax(float* row_max, const float* logits, int64_t N, int64_t V);
void CrossEntropySums(double* sum_exp, double* target_logit, float* probs, const float* logits, const float* row_max,
                      const int32_t* targets, int64_t v0, int64_t N, int64_t V);
float CrossEntropyFinish(float* probs, const double* sum_exp, const double* target_logit, const float* row_max, int64_t N,
                         int64_t V);
// dlogits = (probs - onehot(target)) / N on the columns held here.
void CrossEntropyBackward(float* dlogits, const float* probs, const int32_t* targets, int64_t v0, int64_t N, int64_t V);

}  // namespace train

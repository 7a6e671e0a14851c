#include "libtrain/moe_layer.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "ckpt/util/error.h"
#include "libtrain/layers.h"

namespace train {
namespace {
using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<Mat>;
using CMap = Eigen::Map<const Mat>;

// Step 1, the router (routing.py RouterBase.get_router_logits,
// apply_activation_fn, RouterTopK.forward): logits = x @ router^T; the
// affinities are softmax(logits) taken in fp64 and cast back to the input's
// float; the top-k experts are picked on the logits, best first (ties to
// the lower expert index).
void Route(MoeActivations* a, const float* x, const MoeWeights& w, const MoeShape& s) {
  const int64_t T = s.tokens, E = s.experts;
  a->logits.assign(T * E, 0.0f);
  LinearForward(a->logits.data(), x, w.router, nullptr, T, s.hidden, E);
  a->affinities.assign(T * E, 0.0f);
  a->expert_index.assign(T * s.top_k, 0);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = &a->logits[t * E];
    const double max = *std::max_element(l, l + E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double{l[e]} - max);
    for (int64_t e = 0; e < E; ++e) a->affinities[t * E + e] = static_cast<float>(std::exp(double{l[e]} - max) / sum);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return l[i] > l[j]; });
    std::copy_n(order.begin(), s.top_k, &a->expert_index[t * s.top_k]);
  }
}

// Step 2, dispatch (expert_mlps_v2.py forward_capacity_factor): a token's
// position in expert e is the count of tokens up to and including it, in
// token order, that chose e (cumsum of the top-k mask over tokens); the
// expert takes positions 1..C and drops the rest, whatever rank e had in the
// token's top-k. With C = T (dropless, forward_all_experts) every choice is kept.
void Dispatch(MoeActivations* a, const MoeShape& s, int64_t capacity) {
  const int64_t T = s.tokens, E = s.experts;
  a->kept.assign(T * E, 0);
  a->experts.assign(E, {});
  std::vector<int64_t> position(E, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < s.top_k; ++k) {
      const int64_t e = a->expert_index[t * s.top_k + k];
      if (++position[e] > capacity) continue;
      a->kept[t * E + e] = 1;
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      if (a->kept[t * E + e]) a->experts[e].tokens.push_back(t);
}

// Step 3, the combine weights (ExpertMLPsV2.get_expert_affinities_masked):
// the affinities of the kept experts only, then, with
// normalize_top_k_affinities, F.normalize(p=1): divided by their sum (at
// least 1e-12, so a token that lost every expert gets all zeros).
void CombineWeights(MoeActivations* a, const MoeShape& s, const MoeOptions& o) {
  const int64_t T = s.tokens, E = s.experts;
  a->combine.assign(T * E, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    float sum = 0;
    for (int64_t e = 0; e < E; ++e)
      if (a->kept[t * E + e]) sum += a->combine[t * E + e] = a->affinities[t * E + e];
    if (o.normalize_top_k_affinities)
      for (int64_t e = 0; e < E; ++e) a->combine[t * E + e] /= std::max(sum, 1e-12f);
  }
}

// Step 4, the experts (experts.py Experts.forward, glu_mlp): per expert, its
// tokens' rows, gathered in token order.
void ExpertsForward(MoeActivations* a, const float* x, const MoeWeights& w, const MoeShape& s) {
  const int64_t H = s.hidden, I = s.intermediate;
  for (int64_t e = 0; e < s.experts; ++e) {
    MoeExpertBatch& b = a->experts[e];
    const int64_t n = static_cast<int64_t>(b.tokens.size());
    Mat xe(n, H);
    for (int64_t r = 0; r < n; ++r) xe.row(r) = CMap(x + b.tokens[r] * H, 1, H);
    ExpertMlpForward(&b, xe.data(), n, w.gate_up + e * H * 2 * I, w.down + e * I * H, H, I);
  }
}

// Where token t's row sits in expert e's batch (tokens are in token order).
int64_t RowOf(const MoeExpertBatch& b, int64_t t) {
  return std::lower_bound(b.tokens.begin(), b.tokens.end(), t) - b.tokens.begin();
}
}  // namespace

void CheckMoeSettings(const MoeShape& s, const MoeOptions& o) {
  if (s.tokens < 1 || s.hidden < 1 || s.intermediate < 1 || s.experts < 1)
    throw ckpt::Error("MoE layer: tokens, hidden, intermediate and experts must be positive");
  if (s.top_k < 1 || s.top_k > s.experts)
    throw ckpt::Error("MoE layer: top_k " + std::to_string(s.top_k) + " must be in [1, num_experts " +
                      std::to_string(s.experts) + "]");
  if (o.normalize_top_k_affinities && s.top_k == 1)
    throw ckpt::Error("MoE layer: normalize_top_k_affinities needs top_k > 1 (as NxD's ExpertMLPs)");
}

int64_t MoeExpertCapacity(const MoeShape& s, double capacity_factor) {
  const bool full = capacity_factor <= 0 || capacity_factor >= static_cast<double>(s.experts) / s.top_k;
  if (full) return s.tokens;
  const auto c = static_cast<int64_t>(std::ceil(s.tokens * s.top_k * capacity_factor / s.experts));
  return std::min(s.tokens, c);
}

void MoeForward(float* out, MoeActivations* acts, const float* x, const MoeWeights& w, const MoeShape& s,
                const MoeOptions& o) {
  MoeRoute(acts, x, w, s, o);
  ExpertsForward(acts, x, w, s);
  MoeCombine(out, *acts, s);
}

void MoeRoute(MoeActivations* acts, const float* x, const MoeWeights& w, const MoeShape& s, const MoeOptions& o) {
  CheckMoeSettings(s, o);
  Route(acts, x, w, s);
  Dispatch(acts, s, MoeExpertCapacity(s, o.capacity_factor));
  CombineWeights(acts, s, o);
}

void ExpertMlpForward(MoeExpertBatch* b, const float* xe, int64_t n, const float* gate_up, const float* down, int64_t H, int64_t I) {
  b->fc.resize(n * 2 * I);
  b->act.resize(n * I);
  b->out.resize(n * H);
  Map(b->fc.data(), n, 2 * I).noalias() = CMap(xe, n, H) * CMap(gate_up, H, 2 * I);
  SwiGluForward(b->act.data(), b->fc.data(), n, I);
  Map(b->out.data(), n, H).noalias() = CMap(b->act.data(), n, I) * CMap(down, I, H);
}

void MoeCombine(float* out, const MoeActivations& a, const MoeShape& s) {
  // Step 5, the combine (forward_capacity_factor's loop over k): out[t] =
  // sum over the token's choices, best first, of combine * expert output;
  // dropped choices add nothing.
  const int64_t H = s.hidden, E = s.experts;
  std::fill_n(out, s.tokens * H, 0.0f);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t k = 0; k < s.top_k; ++k) {
      const int64_t e = a.expert_index[t * s.top_k + k];
      if (!a.kept[t * E + e]) continue;
      const float c = a.combine[t * E + e];
      const float* y = &a.experts[e].out[RowOf(a.experts[e], t) * H];
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += c * y[h];
    }
}

void AddMoeAuxStats(MoeAuxStats* stats, const MoeActivations& acts, const MoeShape& s) {
  const int64_t T = s.tokens, E = s.experts;
  if (stats->chosen.empty()) stats->experts = E, stats->top_k = s.top_k, stats->chosen.assign(E, 0), stats->affinity_sum.assign(E, 0);
  if (stats->experts != E || stats->top_k != s.top_k) throw ckpt::Error("internal: MoE layers of different expert counts in one auxiliary loss");
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < s.top_k; ++k) stats->chosen[acts.expert_index[t * s.top_k + k]] += 1;
    for (int64_t e = 0; e < E; ++e) stats->affinity_sum[e] += acts.affinities[t * E + e];
  }
  stats->rows += T;
}

int64_t MoeAuxStatsFloats(int64_t experts) { return static_cast<int64_t>((2 * experts + 1) * sizeof(double) / sizeof(float)); }

void PackMoeAuxStats(float* out, const MoeAuxStats& stats, int64_t experts) {
  std::vector<double> values(2 * experts + 1, 0.0);
  values[0] = static_cast<double>(stats.rows);
  if (stats.rows > 0) {
    std::copy(stats.chosen.begin(), stats.chosen.end(), values.begin() + 1);
    std::copy(stats.affinity_sum.begin(), stats.affinity_sum.end(), values.begin() + 1 + experts);
  }
  std::memcpy(out, values.data(), values.size() * sizeof(double));
}

void UnpackMoeAuxStats(MoeAuxStats* stats, const float* in, int64_t experts, int64_t top_k) {
  std::vector<double> values(2 * experts + 1);
  std::memcpy(values.data(), in, values.size() * sizeof(double));
  *stats = {};
  if (values[0] == 0) return;
  stats->experts = experts, stats->top_k = top_k, stats->rows = static_cast<int64_t>(values[0]);
  stats->chosen.assign(values.begin() + 1, values.begin() + 1 + experts);
  stats->affinity_sum.assign(values.begin() + 1 + experts, values.end());
}

// loss_function.py load_balancing_loss_func: expert e's share of the rows * k
// choices (before any capacity drop) times its mean affinity, summed, times E / k.
float MoeAuxLossOf(const MoeAuxStats& st) {
  if (st.rows == 0) return 0;
  const double rows = static_cast<double>(st.rows);
  double sum = 0;
  for (int64_t e = 0; e < st.experts; ++e) sum += st.chosen[e] / rows * (st.affinity_sum[e] / rows);
  return static_cast<float>(sum * st.experts / st.top_k);
}

std::vector<double> MoeAuxAffinityGrad(const MoeAuxStats& st, double coef) {
  std::vector<double> g(st.experts, 0.0);
  const double rows = static_cast<double>(st.rows);
  for (int64_t e = 0; e < st.experts; ++e) g[e] = coef * double(st.experts) / st.top_k * st.chosen[e] / rows / rows;
  return g;
}

float MoeAuxLoss(const MoeActivations& acts, const MoeShape& s) {
  MoeAuxStats st;
  AddMoeAuxStats(&st, acts, s);
  return MoeAuxLossOf(st);
}

namespace {
// Backward of steps 5 and 4: each kept choice's combine weight gets
// dot(dout, expert output); the expert output gets combine * dout, which
// flows back through down, SwiGLU and gate_up into the weights and x.
void ExpertsBackward(float* dx, std::vector<float>* dcombine, const MoeGrads& g, const float* dout, const float* x,
                     const MoeWeights& w, const MoeActivations& a, const MoeShape& s) {
  const int64_t H = s.hidden, I = s.intermediate;
  std::vector<float> dy;
  for (int64_t e = 0; e < s.experts; ++e) {
    const MoeExpertBatch& b = a.experts[e];
    const int64_t n = static_cast<int64_t>(b.tokens.size());
    Mat xe(n, H), dxe(n, H);
    for (int64_t r = 0; r < n; ++r) xe.row(r) = CMap(x + b.tokens[r] * H, 1, H);
    MoeCombineBackward(&dy, dcombine, e, dout, a, s);
    ExpertMlpBackward(dxe.data(), g.gate_up + e * H * 2 * I, g.down + e * I * H, dy.data(), xe.data(), b, n, w.gate_up + e * H * 2 * I,
                      w.down + e * I * H, H, I);
    for (int64_t r = 0; r < n; ++r) Map(dx + b.tokens[r] * H, 1, H) += dxe.row(r);
  }
}

// Backward of step 3 into the affinities: F.normalize's y = a / sum(a) gives
// da = (dy - sum(dy * y)) / sum(a) on the kept experts; masked ones get 0.
void CombineWeightsBackward(std::vector<double>* daff, const std::vector<float>& dcombine, const MoeActivations& a,
                            const MoeShape& s, const MoeOptions& o) {
  const int64_t E = s.experts;
  for (int64_t t = 0; t < s.tokens; ++t) {
    double sum = 0, dot = 0;
    for (int64_t e = 0; e < E; ++e)
      if (a.kept[t * E + e]) sum += a.affinities[t * E + e], dot += dcombine[t * E + e] * double{a.combine[t * E + e]};
    for (int64_t e = 0; e < E; ++e) {
      if (!a.kept[t * E + e]) continue;
      const double d = dcombine[t * E + e];
      (*daff)[t * E + e] += o.normalize_top_k_affinities ? (d - dot) / std::max(sum, 1e-12) : d;
    }
  }
}
}  // namespace

void MoeCombineBackward(std::vector<float>* dy, std::vector<float>* dcombine, int64_t e, const float* dout, const MoeActivations& a,
                        const MoeShape& s) {
  const int64_t H = s.hidden, E = s.experts;
  const MoeExpertBatch& b = a.experts[e];
  dy->resize(b.tokens.size() * H);
  for (size_t r = 0; r < b.tokens.size(); ++r) {
    const int64_t t = b.tokens[r];
    Map(&(*dy)[r * H], 1, H) = CMap(dout + t * H, 1, H) * a.combine[t * E + e];
    (*dcombine)[t * E + e] = (CMap(dout + t * H, 1, H).array() * CMap(&b.out[r * H], 1, H).array()).sum();
  }
}

void ExpertMlpBackward(float* dxe, float* dgate_up, float* ddown, const float* dy, const float* xe, const MoeExpertBatch& b, int64_t n,
                       const float* gate_up, const float* down, int64_t H, int64_t I) {
  const CMap dy_rows(dy, n, H), down_w(down, I, H), gate_up_w(gate_up, H, 2 * I);
  Mat dact = dy_rows * down_w.transpose();
  Map(ddown, I, H).noalias() += CMap(b.act.data(), n, I).transpose() * dy_rows;
  Mat dfc(n, 2 * I);
  SwiGluBackward(dfc.data(), dact.data(), b.fc.data(), n, I);
  Map(dgate_up, H, 2 * I).noalias() += CMap(xe, n, H).transpose() * dfc;
  Map(dxe, n, H).noalias() = dfc * gate_up_w.transpose();
}

void MoeBackward(float* dx, const MoeGrads& g, const float* dout, const std::vector<double>& aux_affinity_grad, const float* x,
                 const MoeWeights& w, const MoeActivations& a, const MoeShape& s, const MoeOptions& o) {
  const int64_t T = s.tokens, E = s.experts, H = s.hidden;
  std::fill_n(dx, T * H, 0.0f);
  std::vector<float> dcombine(T * E, 0.0f);
  ExpertsBackward(dx, &dcombine, g, dout, x, w, a, s);
  MoeRouteBackward(dx, g.router, dcombine, aux_affinity_grad, x, w, a, s, o);
}

void MoeRouteBackward(float* dx, float* drouter, const std::vector<float>& dcombine, const std::vector<double>& aux_affinity_grad,
                      const float* x, const MoeWeights& w, const MoeActivations& a, const MoeShape& s, const MoeOptions& o) {
  const int64_t T = s.tokens, E = s.experts, H = s.hidden;
  std::vector<double> daff(T * E, 0.0);
  CombineWeightsBackward(&daff, dcombine, a, s, o);
  if (!aux_affinity_grad.empty())
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) daff[t * E + e] += aux_affinity_grad[e];
  // Backward of step 1: softmax (in fp64, as NxD's), then the router linear.
  std::vector<float> dlogits(T * E);
  for (int64_t t = 0; t < T; ++t) {
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += daff[t * E + e] * a.affinities[t * E + e];
    for (int64_t e = 0; e < E; ++e)
      dlogits[t * E + e] = static_cast<float>(a.affinities[t * E + e] * (daff[t * E + e] - dot));
  }
  std::vector<float> dx_router(T * H);
  LinearBackward(dx_router.data(), drouter, nullptr, dlogits.data(), x, w.router, T, H, E);
  for (int64_t i = 0; i < T * H; ++i) dx[i] += dx_router[i];
}

void MoeBackward(float* dx, const MoeGrads& g, const float* dout, float aux_coef, const float* x, const MoeWeights& w,
                 const MoeActivations& a, const MoeShape& s, const MoeOptions& o) {
  MoeAuxStats st;
  AddMoeAuxStats(&st, a, s);
  MoeBackward(dx, g, dout, MoeAuxAffinityGrad(st, aux_coef), x, w, a, s, o);
}

}  // namespace train

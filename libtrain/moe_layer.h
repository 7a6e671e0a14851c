// One mixture-of-experts feed-forward layer as NxD computes it in training
// (neuronx_distributed/modules/moe, as NxDT's HF Mixtral builds it in
// models/hf_models/modeling_mixtral.py initialize_mixtral_moe_layer): a top-k
// softmax router (RouterTopK), SwiGLU experts (ExpertMLPs, glu_mlp, silu),
// optional capacity-factor token dropping, and the load-balancing auxiliary
// loss (modules/moe/loss_function.py). One process: every expert is here
// (tp 1, ep 1). Plain forward/backward functions over row-major float
// buffers, in the style of layers.h; backward accumulates (+=) into weight
// gradients and writes (=) the input gradient.
#pragma once

#include <cstdint>
#include <vector>

namespace train {

struct MoeShape {
  int64_t tokens;        // T (batch * sequence, in NxD's flattened token order)
  int64_t hidden;        // H
  int64_t intermediate;  // I, per expert
  int64_t experts;       // E
  int64_t top_k;         // k
};

// The layer's weights in NxD's orientation (what its checkpoints hold):
struct MoeWeights {
  const float* router;   // [E, H]      router.linear_router.weight
  const float* gate_up;  // [E, H, 2I]  expert_mlps.mlp_op.gate_up_proj.weight, last dim [gate || up]
  const float* down;     // [E, I, H]   expert_mlps.mlp_op.down_proj.weight
};

// Their gradients, same shapes, accumulated into.
struct MoeGrads {
  float* router;
  float* gate_up;
  float* down;
};

struct MoeOptions {
  // NxD's capacity_factor: <= 0 (the dropless configs) or >= E / k (full
  // capacity) drops no token; otherwise each expert takes at most
  // MoeExpertCapacity tokens.
  double capacity_factor = 0.0;
  bool normalize_top_k_affinities = true;
};

// Throws ckpt::Error naming the setting unless 0 < top_k <= experts, and
// top_k > 1 when normalizing (ExpertMLPsV2.validate_routed_experts_configs),
// and every size is positive. MoeForward calls it.
void CheckMoeSettings(const MoeShape& s, const MoeOptions& o);

// Tokens an expert can take: T when no token drops, else
// min(T, ceil(T * k * capacity_factor / E))
// (expert_mlps_v2.py ExpertMLPsV2.forward_capacity_factor).
int64_t MoeExpertCapacity(const MoeShape& s, double capacity_factor);

// The tokens one expert processes, in token order, and its activations.
struct MoeExpertBatch {
  std::vector<int64_t> tokens;
  std::vector<float> fc;   // [n, 2I] x @ gate_up[e]
  std::vector<float> act;  // [n, I]  silu(gate) * up
  std::vector<float> out;  // [n, H]  act @ down[e]
};

// What forward keeps for backward.
struct MoeActivations {
  std::vector<float> logits;          // [T, E]
  std::vector<float> affinities;      // [T, E] softmax of the logits (fp64, stored as float as NxD casts it)
  std::vector<int64_t> expert_index;  // [T, k] top-k experts, best first
  std::vector<uint8_t> kept;          // [T, E] 1 where the token is routed to and taken by the expert
  std::vector<float> combine;         // [T, E] the weight of each kept expert's output
  std::vector<MoeExpertBatch> experts;
};

// out[T, H] = sum over the token's kept experts e of combine[t, e] * expert_e(x[t]).
void MoeForward(float* out, MoeActivations* acts, const float* x, const MoeWeights& w, const MoeShape& s,
                const MoeOptions& o);

// What load_balancing_loss_func (modules/moe/loss_function.py) reads of the
// router logits it is given: NxDT's MixtralForCausalLM gives it every MoE
// layer's logits concatenated (modeling_mixtral.py, past_router_logits), so
// the counts are summed over the layers (AddMoeAuxStats once per layer).
struct MoeAuxStats {
  int64_t experts = 0, top_k = 0;
  int64_t rows = 0;                   // tokens times layers
  std::vector<double> chosen;         // [E] top-k choices of each expert (before any capacity drop)
  std::vector<double> affinity_sum;   // [E] sum over rows of softmax[row, e]
};
void AddMoeAuxStats(MoeAuxStats* stats, const MoeActivations& acts, const MoeShape& s);
// E / k * sum_e (chosen[e] / rows) * (affinity_sum[e] / rows), unscaled by the coefficient.
float MoeAuxLossOf(const MoeAuxStats& stats);
// d(coef * MoeAuxLossOf) / d softmax[row, e] for any row: the same for every
// row, coef * E / k * chosen[e] / rows / rows (the top-k mask has no gradient).
std::vector<double> MoeAuxAffinityGrad(const MoeAuxStats& stats, double coef);

// The statistics as MoeAuxStatsFloats(experts) floats holding the bytes of
// 2 * experts + 1 doubles (rows, chosen, affinity_sum), the tail of a
// pipeline message: under pipeline parallelism the MoE layers' router logits
// travel with the hidden state to the last stage's loss (NxDT's decoder layers
// concatenate them onto past_router_logits, models/megatron/transformer.py and
// modeling_mixtral.py), and here their statistics do, bit for bit, so every
// stage sums what one process sums, in its order. Stats without rows pack as
// zeros and unpack empty (AddMoeAuxStats starts them).
int64_t MoeAuxStatsFloats(int64_t experts);
void PackMoeAuxStats(float* out, const MoeAuxStats& stats, int64_t experts);
void UnpackMoeAuxStats(MoeAuxStats* stats, const float* in, int64_t experts, int64_t top_k);

// load_balancing_loss_func of this layer's router logits alone (unscaled by
// the coefficient): E / k * sum_e (tokens choosing e / T) * mean_t softmax[t, e].
float MoeAuxLoss(const MoeActivations& acts, const MoeShape& s);

// Gradients of sum(out * dout) + sum_{t,e} aux_affinity_grad[e] * softmax[t, e]
// (MoeAuxAffinityGrad; empty: no auxiliary loss).
void MoeBackward(float* dx, const MoeGrads& g, const float* dout, const std::vector<double>& aux_affinity_grad, const float* x,
                 const MoeWeights& w, const MoeActivations& acts, const MoeShape& s, const MoeOptions& o);
// Gradients of sum(out * dout) + aux_coef * MoeAuxLoss (this layer's loss alone).
void MoeBackward(float* dx, const MoeGrads& g, const float* dout, float aux_coef, const float* x, const MoeWeights& w,
                 const MoeActivations& acts, const MoeShape& s, const MoeOptions& o);

// MoeForward's and MoeBackward's steps, for an expert-parallel layer
// (libtrain/expert_exchange.h) that runs the experts on other ranks' tokens:
// MoeForward = MoeRoute, ExpertMlpForward of each expert on its tokens' rows,
// MoeCombine; MoeBackward = MoeCombineBackward and ExpertMlpBackward of each
// expert, then MoeRouteBackward.
//
// Routing, dispatch (capacity MoeExpertCapacity of s.tokens) and combine
// weights: fills acts but the experts' fc, act and out (their tokens are set).
void MoeRoute(MoeActivations* acts, const float* x, const MoeWeights& w, const MoeShape& s, const MoeOptions& o);
// One expert's SwiGLU MLP on the n rows xe [n, H] (gate_up [H, 2I], down
// [I, H]): sets b's fc, act and out, not its tokens.
void ExpertMlpForward(MoeExpertBatch* b, const float* xe, int64_t n, const float* gate_up, const float* down, int64_t H, int64_t I);
// Its backward from dy [n, H]: accumulates into dgate_up and ddown, writes dxe [n, H].
void ExpertMlpBackward(float* dxe, float* dgate_up, float* ddown, const float* dy, const float* xe, const MoeExpertBatch& b, int64_t n,
                       const float* gate_up, const float* down, int64_t H, int64_t I);
// out[T, H] from each expert's out, row r that of its r-th token.
void MoeCombine(float* out, const MoeActivations& acts, const MoeShape& s);
// Backward of MoeCombine for expert e: dy [n_e, H] (combine * dout of its
// tokens' rows) and dcombine[t, e] = dot(dout[t], out row) of its tokens.
void MoeCombineBackward(std::vector<float>* dy, std::vector<float>* dcombine, int64_t e, const float* dout, const MoeActivations& a,
                        const MoeShape& s);
// Backward of the combine weights, the auxiliary loss (aux_affinity_grad as
// MoeBackward's) and the router from dcombine [T, E]: adds into dx [T, H],
// accumulates into drouter [E, H].
void MoeRouteBackward(float* dx, float* drouter, const std::vector<float>& dcombine, const std::vector<double>& aux_affinity_grad,
                      const float* x, const MoeWeights& w, const MoeActivations& a, const MoeShape& s, const MoeOptions& o);

}  // namespace train

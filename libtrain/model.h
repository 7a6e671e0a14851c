// A Megatron-style decoder as NxDT's model_source: megatron and NNM build it.
// Llama style: RMSNorm, RoPE, attention with the fused per-head
// [q_h; k_h; v_h] query_key_value weight (or, with GQA, query plus
// key_value laid out [k_g; v_g] per KV head), causal softmax, SwiGLU with the
// fused [gate; up] dense_h_to_4h, no biases, untied output layer. GPT style
// swaps in LayerNorm (weight and bias), GeLU on an unfused dense_h_to_4h,
// biases on every linear layer, learned absolute position embeddings and an
// output layer tied to the word embeddings, each separately. Computes
// in float32; with bf16_params (mixed precision) every parameter holds a
// bfloat16 value and checkpoints store bfloat16, as NxDT's do.
//
// Parameters carry NxDT's state-dict names; their partition rules (split dim,
// fused layout, stage, optimizer group) come from ckpt/spec/partition.h, the one
// copy the checkpoint tools read too.
//
// Tensor parallelism (Megatron's; sequence parallelism below): a model built
// for tp rank r of tp holds that rank's slice of every parameter as the
// partition rules cut it (ckpt::LocalShape/LocalRuns): whole heads of
// query_key_value (or query, and key_value groups, replicated over tp /
// kv_heads ranks when there are fewer groups than ranks), [gate_r; up_r] of
// dense_h_to_4h, columns of the row-parallel dense and dense_4h_to_h, and
// vocabulary rows of the embedding and output layer. Activations between the
// blocks are whole on every rank: a row-parallel output is all-reduced
// before its (whole) bias, a column-parallel input's gradient after its
// backward; the embedding sums the ranks' rows and cross-entropy is
// vocab-parallel (Megatron's vocab_parallel_cross_entropy). Dropout masks are
// keyed on global coordinates (global head, global FFN column), so every
// layout draws the masks one process draws.
//
// Pipeline parallelism: a model built for stage s holds layers [bounds[s],
// bounds[s+1]) (numbered globally, as in the checkpoint; with virtual stages
// the layers of each of its chunks, chunk after chunk), the embeddings on
// the first stage and the final norm and output layer on the last (GPT's
// tied output there is `language_model.output_layer.weight`, as NxDT names
// it, a copy of the embedding whose gradient is summed with the embedding's,
// on the same stage when pp = 1). ForwardStage takes the
// tokens or the previous stage's hidden states and gives the next stage's
// input or the loss, returning the micro-batch's activations; BackwardStage
// consumes them, so a pipeline schedule can keep several in flight.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/spec/model_family.h"
#include "ckpt/spec/partition.h"
#include "ckpt/pt/tensor.h"
#include "ckpt/pt/value.h"
#include "libtrain/expert_exchange.h"
#include "libtrain/moe_layer.h"

namespace train {

struct ModelConfig {
  int64_t vocab = 256;  // already padded to make_vocab_size_divisible_by
  int64_t vocab_size = 0;                    // before padding (0: vocab)
  int64_t make_vocab_size_divisible_by = 1;
  int64_t hidden = 64, ffn = 172, heads = 4, kv_heads = 4, layers = 2;
  float eps = 1e-5f;
  double norm_eps() const;  // eps as the config wrote it (1e-5, not 9.99999974737875e-06)
  double rope_theta = 10000.0;
  double rotary_percentage = 1.0;
  bool layernorm = false;          // normalization: layernorm (else rmsnorm)
  bool gelu = false;               // activation: gelu (else swiglu)
  bool bias = false;               // has_bias: every linear layer has a bias
  bool learned_positions = false;  // position_embedding_type: learned_absolute (else rope)
  int64_t max_positions = 0;       // max_position_embeddings (rows of the learned table)
  bool tied_output = false;        // share_embeddings_and_output_weights
  // Dropout probabilities, at Megatron's places: hidden_dropout on the
  // embeddings and on each block's output before its residual add,
  // attention_dropout on the attention probabilities, ffn_dropout on the MLP's
  // activation. Masks come from Forward's dropout_key (layers.h).
  float hidden_dropout = 0, attention_dropout = 0, ffn_dropout = 0;
  float init_std = 0.02f;
  bool scaled_init = true;
  // activations_checkpoint_granularity: "" keeps every activation; "full"
  // keeps each layer's input and recomputes the layer in backward;
  // "selective" drops the attention probabilities ([B, heads, T, T]) and
  // recomputes them. Gradients are bit-identical either way.
  std::string recompute;
  // precision.type mixed_precision: parameters are bfloat16 (the optimizer
  // keeps float32 master weights); activations and gradients stay float32.
  bool bf16_params = false;
  uint64_t seed = 1234;
  // The model family (ckpt/spec/model_family.h): the names the parameters carry
  // and, for the HF-style family (NxDT's model_source: hf), its attention
  // tensors (model.fuse_qkv, model.qkv_linear) and NxD's KV replication
  // (distributed_strategy.kv_replicator, and the backend's rule).
  ckpt::ModelFamily family = ckpt::ModelFamily::kMegatron;
  bool fuse_qkv = true, qkv_linear = false;
  int64_t kv_size_multiplier = 1;
  ckpt::HwBackend hw_backend = ckpt::HwBackend::kTrn1;
  // Mixtral (MoE, either family: NxDT's HF-style and Megatron-style Mixtral): the layers ckpt::IsMoeLayer picks
  // run NxD's MoE layer (libtrain/moe_layer.h) in place of the dense MLP, with
  // `experts` experts of width ffn each, `moe_top_k` per token; 0 experts: dense.
  // The loss adds router_aux_loss_coef times load_balancing_loss_func of every
  // MoE layer's router logits together (0: no auxiliary loss).
  int64_t experts = 0, moe_top_k = 0, moe_frequency = 1;
  double capacity_factor = 0.0;
  bool normalize_top_k_affinities = true;
  double router_aux_loss_coef = 0.0;
  int64_t head_dim() const { return hidden / heads; }
  int64_t rotary_dim() const {
    return learned_positions ? 0 : static_cast<int64_t>(head_dim() * rotary_percentage) / 2 * 2;
  }
  bool gqa() const { return kv_heads != heads; }
  // Rows of dense_h_to_4h: [gate; up] for SwiGLU, one projection for GeLU.
  int64_t ffn_in_width() const { return gelu ? ffn : 2 * ffn; }
  // The checkpoint format this model reads and writes; `vocab` must be the
  // vocabulary padded for `tp` (ModelFormat::PaddedVocab(tp)).
  ckpt::ModelFormat format(int tp = 1) const;
};

class Comm;

// The tensor-parallel ranks holding the same KV heads as tp rank `rank`
// (replicated: Megatron's kv_heads < tp, consecutive ranks; the HF-style
// family's kv_size_multiplier > 1, by NxD's rule); empty when not replicated.
std::vector<int> KvHolders(const ModelConfig& c, int tp, int rank);

// This model's place in a tensor-parallel group.
struct TensorParallel {
  int size = 1, rank = 0;
  // Megatron's sequence parallelism: between the tensor-parallel blocks
  // (norms, dropout, the residual stream) each rank holds T / size positions
  // of every sequence; all-gathers feed the column-parallel layers and
  // reduce-scatters replace the row-parallel all-reduces.
  bool sequence_parallel = false;
  Comm* comm = nullptr;     // the tensor-parallel group; nullptr when size is 1
  Comm* kv_comm = nullptr;  // replicated KV heads: the ranks holding this rank's (KvHolders)
};


// This model's place in a pipeline. With `chunks` > 1 (the interleaved
// schedule's virtual stages) the pipeline has size * chunks stages and this
// rank holds chunk c = stage stage + c * size of them, as NxD's NxDPPModel
// places them (pipeline/model.py: stage_to_pipeline_parallel_rank).
struct PipelineStage {
  int size = 1, stage = 0;
  std::vector<int64_t> bounds;     // ckpt::StageBounds of size * chunks stages; empty: NxD's even split
  Comm* comm = nullptr;            // the pipeline group (stage = rank); nullptr when size is 1
  Comm* embedding_comm = nullptr;  // tied output with size > 1: the first and last stages
  int chunks = 1;
  bool first() const { return stage == 0; }  // holds the first (virtual) stage
  bool last() const { return stage == size - 1; }  // holds the last (virtual) stage
};

class Model {
 public:
  // Everything one layer's backward needs from its forward.
  struct LayerCache {
    std::vector<float> x, ln1, mean1, rstd1;  // layer input, its norm (mean: LayerNorm only)
    std::vector<float> proj, kvproj;          // qkv projection (MHA), or q and kv (GQA)
    std::vector<float> q, k, v;               // [B, heads|kv, T, hd], RoPE applied to q and k
    std::vector<float> att;                   // [B, heads, T, T] softmax probabilities
    std::vector<float> y;                     // [N, H] attention output before dense
    std::vector<float> x2, ln2, mean2, rstd2;  // after the attention residual, its norm
    std::vector<float> fc, act;               // [N, 2F] (SwiGLU) or [N, F] (GeLU), and [N, F]
    MoeActivations moe;                       // an MoE layer's, in place of fc and act
    ExpertExchangeCache moe_ep;               // and under expert parallelism, its local experts' rows
  };
  // One micro-batch's activations on this stage, from its forward to its backward.
  struct Activations {
    int64_t B = 0, T = 0;
    int chunk = 0;  // the model chunk that ran it
    uint64_t dropout_key = 0;
    std::vector<int32_t> tokens, targets;
    std::vector<LayerCache> layers;  // this stage's, first layer first
    std::vector<float> x_final, lnf, meanf, rstdf, logits, probs;  // last stage
    MoeAuxStats moe_aux;  // the MoE layers' routing, for the auxiliary loss and its gradient
    size_t bytes() const;
  };

  // Throws ckpt::Error when tp does not divide the model (heads, KV heads,
  // FFN width, padded vocabulary).
  // Under expert parallelism (ep.size > 1) this rank holds E / ep.size
  // contiguous experts of each MoE layer (ckpt::ExpertSpec's ep cut) and its
  // MoE layers exchange tokens with the ep group (libtrain/expert_exchange.h).
  explicit Model(const ModelConfig& c, const TensorParallel& tp = {}, const PipelineStage& pp = {}, const ExpertParallel& ep = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Normal(0, init_std) weights and position embeddings; output projections
  // of each layer (dense, dense_4h_to_h) scaled by 1/sqrt(2 * layers) with
  // scaled_init; norm weights 1; biases 0. Drawn for the whole logical tensor
  // and sliced (Megatron's use_cpu_initialization), so every layout starts
  // from the weights one process does. Rounded to bfloat16 with bf16_params.
  void InitWeights();
  // This stage's (or its chunk `chunk`'s) forward over B sequences of T
  // tokens. The first stage reads
  // `tokens`, the others `x_in` [B*T, hidden] from the stage before; the last
  // stage reads `targets` and returns the mean cross-entropy, the others write
  // `x_out` for the next and return 0. `dropout_key` seeds the micro-batch's
  // dropout masks (the trainer derives it from the seed and the batch's
  // position in the data). With virtual stages "first" and "last" mean the
  // first and last of all of them.
  float ForwardStage(Activations& a, const int32_t* tokens, const int32_t* targets, const float* x_in, int64_t B, int64_t T,
                     uint64_t dropout_key, std::vector<float>* x_out, int chunk = 0);
  // Accumulates gradients of a's loss: the last stage from the loss, the
  // others from `dx_out` (the next stage's gradient at x_out); all but the
  // first write the gradient at x_in to `dx_in`. Frees what recompute drops.
  void BackwardStage(Activations& a, const float* dx_out, std::vector<float>* dx_in);
  // Activations objects for a schedule to keep micro-batches in flight: a
  // returned one is handed out again, its buffers reused.
  std::unique_ptr<Activations> TakeActivations();
  void ReturnActivations(std::unique_ptr<Activations> a);
  // One stage: Forward returns the mean cross-entropy, Backward accumulates
  // its gradients (the activations in between are kept here).
  float Forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, uint64_t dropout_key = 0);
  void Backward();
  void ZeroGrad();
  // Sums the gradients of copies of one tensor on several ranks: KV groups
  // replicated over tensor-parallel ranks (kv_heads < tp) and the tied
  // embedding of the first and last stages, so the copies take the same step.
  // Once per step, after the last Backward.
  void ReduceReplicaGrads();
  // How many leading rows of this rank's copy of `name` count in global
  // norms: a tensor replicated over the tensor-parallel ranks counts on one of
  // them only, the tied output copy not at all (the first stage counts the
  // embedding), and an HF-style fused weight_qkv whose KV heads are
  // replicated counts its query rows on every rank and its KV rows on one.
  int64_t CountedRows(const std::string& name) const;
  // Sums x over the ranks holding the other parts of the model (tensor, then
  // pipeline parallel).
  void SumOverModel(double* x, size_t n) const;
  const TensorParallel& tensor_parallel() const { return tp_; }
  const PipelineStage& pipeline() const { return pp_; }
  const ExpertParallel& expert_parallel() const { return ep_; }
  // Whether `name` is an expert weight: this rank's experts only under
  // expert parallelism, its gradient summed over the expert-data-parallel group.
  bool IsExpertWeight(const std::string& name) const;
  // The floats of a hidden state passed between stages for B sequences of T
  // tokens: B * T * hidden, or this rank's sequence part of it.
  int64_t HiddenStateFloats(int64_t B, int64_t T) const;

  const ModelConfig& config() const { return c_; }
  ckpt::Tensor& param(const std::string& name);
  const ckpt::Tensor& param(const std::string& name) const;
  ckpt::Tensor& grad(const std::string& name);
  // This rank's parameters and gradients, each one contiguous buffer in
  // layout() order (params and grads view them): what the optimizer and the
  // data-parallel collectives walk.
  float* flat_params() { return reinterpret_cast<float*>(flat_params_->mutable_data()); }
  float* flat_grads() { return reinterpret_cast<float*>(flat_grads_->mutable_data()); }
  size_t flat_size() const { return flat_params_->nbytes() / sizeof(float); }
  // This stage's parameters in module order, under the names of its
  // checkpoint file, with their logical shapes (tp 1); param() and grad() hold
  // this rank's slices of them.
  // The checkpoint format this model reads and writes (its family, heads, KV replication).
  const ckpt::ModelFormat& format() const { return format_; }
  const std::vector<ckpt::ParamRule>& layout() const { return layout_; }
  // GPT's tied output copy when this stage also holds the embedding it
  // copies (pp = 1), else "".
  std::string SameStageTiedCopy() const { return pp_.size == 1 ? tied_copy_ : std::string(); }
  // This rank's vocabulary columns of the last Forward's logits [N, vocab / tp].
  const std::vector<float>& logits() const { return last_.logits; }
  // Bytes of activations held for backward after the last Forward.
  size_t activation_bytes() const { return last_.bytes(); }

  // name -> float32 tensor (this rank's slice), viewing the model's own memory (no copy).
  ckpt::Value StateDict() const;
  // What a checkpoint's model file holds: StateDict plus the family's
  // buffers, in NxDT's module order (the Megatron family's rotary inv_freq in
  // every layer: ckpt::RotaryBufferName), the keys and tids of NxDT's own tags;
  // under expert parallelism each MoE layer's SPMDRank tensors too
  // (ckpt::SetSpmdRanksAfter), which LoadStateDict passes over.
  ckpt::Value CheckpointDict() const;
  ckpt::Value GradDict() const;
  // The dtype a checkpoint stores the parameters in: bfloat16 with
  // bf16_params, else float32.
  ckpt::DType checkpoint_dtype() const;
  // Copies matching tensors in, converting float64 or bfloat16 (and rounding
  // to bfloat16 with bf16_params); throws ckpt::Error naming a missing,
  // mis-shaped or non-float key.
  void LoadStateDict(const ckpt::Value& sd);

 private:
  float* W(const std::string& n) { return reinterpret_cast<float*>(param(n).mutable_data()); }
  float* Dw(const std::string& n) { return reinterpret_cast<float*>(grad(n).mutable_data()); }
  // RMSNorm or LayerNorm of x[N, H] with the module `prefix`'s parameters.
  void NormForward(const std::string& prefix, const float* x, float* out, std::vector<float>& mean, std::vector<float>& rstd);
  void NormBackward(const std::string& prefix, const float* dout, const float* x, const std::vector<float>& mean,
                    const std::vector<float>& rstd, float* dx);
  // The linear layer `prefix` (its weight, and its bias with has_bias).
  void Linear(const std::string& prefix, const float* x, float* out, int64_t K, int64_t C);
  // A row-parallel linear layer on all B*T rows: this rank's K input columns,
  // the partial products summed over the tensor-parallel ranks into out's
  // Rows() (ReduceRows), then the whole bias.
  void RowParallelLinear(const std::string& prefix, const float* x, float* out, int64_t K, int64_t C);
  // The local group of local head h.
  int64_t LocalGroup(int64_t h) const { return local_group_[h]; }
  void LinearGrad(const std::string& prefix, const float* dout, const float* x, float* dx, int64_t K, int64_t C);
  // Runs layer l on lc.x, filling lc and writing the layer output to `out`
  // (hidden states of Rows() rows; lc.ln1 and lc.ln2 hold all B*T rows).
  void LayerForward(int l, LayerCache& lc, float* out);
  // The name of the output layer's weight on this stage.
  std::string OutputWeight() const;
  // The name of module m's weight (of layer l) in this model's family.
  std::string Name(ckpt::Module m, int l = -1) const { return ckpt::ParamName(format_, m, l); }
  void AttentionForward(int l, LayerCache& lc);
  // An MoE layer's MLP block on lc.ln2 into mlp_out [N, hidden], and its backward
  // from dmlp_out into dln2 (the auxiliary loss's part from a's routing).
  // This rank's place on the axes that cut an expert weight (tp and ep).
  ckpt::AxisCoords ExpertCoords() const;
  // Copies this rank's boxes (ckpt::BoxesOf of p.spec) of the 3-D expert weight `whole` into `local`.
  void CopyExpertBoxes(float* local, const std::vector<int64_t>& local_shape, const float* whole, const ckpt::ParamRule& p) const;
  // Throws ckpt::Error naming what this build does not do with MoE layers.
  void CheckMoe() const;
  MoeShape MoeShapeOf() const;
  MoeOptions MoeOptionsOf() const;
  void MoeMlpForward(int l, LayerCache& lc, float* mlp_out);
  void MoeMlpBackward(int l, LayerCache& lc, const Activations& a, const float* dmlp_out, float* dln2);
  // Softmax attention of layer l from lc.q/k/v into lc.att and lc.y.
  void AttentionCore(int l, LayerCache& lc);
  // Where local head h's q and local group g's k and v lie in the projections.
  int64_t QCol(int64_t h) const;
  int64_t KCol(int64_t g) const;
  int64_t VCol(int64_t g) const;
  // Sums x over the tensor-parallel ranks (no-op with one).
  void TpSum(float* x, int64_t n);
  // Sequence parallelism: a hidden state here holds Rows() of the B*T rows
  // (this rank's T / tp positions of each sequence), else all of them.
  bool SequenceParallel() const { return tp_.sequence_parallel && tp_.size > 1; }
  int64_t Rows() const { return SequenceParallel() ? B_ * T_ / tp_.size : B_ * T_; }
  // The whole [B*T, hidden] from every rank's rows (returns `local` itself
  // without sequence parallelism).
  const float* GatherRows(const float* local, std::vector<float>& whole);
  // Sums the ranks' partial [B*T, hidden] in `whole` and leaves this rank's
  // Rows() in `local` (which may be `whole` without sequence parallelism).
  void ReduceRows(float* whole, float* local);
  // Hidden dropout on a hidden state of Rows() rows, keyed on global positions.
  void HiddenDropout(float* x, uint64_t stream);
  void AttentionBackward(int l, LayerCache& lc, const float* dy, float* dln1);
  // The dropout mask stream of `site` in layer l (l = -1: the embeddings).
  uint64_t DropoutSite(int l, int site) const;
  // Frees what the recompute granularity does not keep.
  void Drop(LayerCache& lc);

  ModelConfig c_;
  TensorParallel tp_;
  PipelineStage pp_;
  ExpertParallel ep_;
  // Each chunk's layers [first, end), chunk 0 first (one chunk without virtual stages).
  std::vector<std::pair<int, int>> chunk_layers_;
  bool FirstStage(int chunk) const { return pp_.first() && chunk == 0; }
  bool LastStage(int chunk) const { return pp_.last() && chunk == pp_.chunks - 1; }
  std::vector<int> Layers() const;  // every layer this rank holds, chunk after chunk
  // This rank's share: nh_ query heads and G_ KV groups (which ones: global_head_ and
  // local_group_ below), FFN columns [f0_, f0_ + F_), vocabulary rows [v0_, v0_ + V_).
  int64_t nh_ = 0, G_ = 0, F_ = 0, f0_ = 0, V_ = 0, v0_ = 0;
  // Local head h's global head (dropout masks are keyed on it) and the local KV group it attends with.
  std::vector<int64_t> global_head_, local_group_;
  bool kv_first_holder_ = true;  // KV heads not replicated, or this rank the first of their holders (CountedRows)
  ckpt::AttentionTensors attention_ = ckpt::AttentionTensors::kFused;
  ckpt::ModelFormat format_;
  std::vector<ckpt::ParamRule> logical_;  // every parameter of the model
  std::vector<ckpt::ParamRule> layout_;   // this stage's
  std::map<std::string, size_t> index_;   // name -> position in layout_
  std::string tied_copy_;                 // GPT's tied output copy on this stage, if it holds one
  // Flat buffers of this rank's parameters and gradients (module order); params_ and grads_ view them.
  std::shared_ptr<ckpt::Storage> flat_params_, flat_grads_;
  std::map<std::string, ckpt::Tensor> params_, grads_;
  std::vector<float> inv_freq_;
  // CheckpointDict's buffers: the parameter each follows -> its name, and the rotary values.
  std::map<std::string, std::string> buffer_after_;
  ckpt::Tensor rotary_buffer_;
  // The micro-batch being run (set by ForwardStage and BackwardStage).
  int64_t B_ = 0, T_ = 0;
  uint64_t dropout_key_ = 0;
  Activations last_;  // Forward's, for Backward
  std::vector<std::unique_ptr<Activations>> spare_;
};

}  // namespace train

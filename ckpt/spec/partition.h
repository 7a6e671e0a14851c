// The partition rules of a Megatron-style decoder checkpoint: for every
// parameter name, how tensor parallelism splits it, how its fused rows are
// laid out, which pipeline stage owns it and which optimizer group holds it.
// This is the one copy of the rules (Megatron-LM core tensor_parallel/layers.py
// and NxD's parallel layers state them per layer); the training core,
// nnm2nxdt-ckpt, ckpt-reshard and export all read them from here.
//
// A rule maps each tensor-parallel rank's local tensor to pieces of the
// logical (tp = 1) tensor along the split dim, so any two layouts can be
// matched piece by piece without ever assembling the whole tensor:
//   - rows (dim 0): vocab-parallel embedding and output layer, column-parallel
//     linears (query_key_value, query, key_value, GPT's dense_h_to_4h) and
//     their biases;
//   - columns (dim 1): row-parallel linears (dense, dense_4h_to_h); their
//     biases are whole;
//   - replicated: norms and the learned position table.
// The fused layout is an explicit kind, not Megatron's bare stride, because
// the stride alone is ambiguous (key_value and dense_h_to_4h both say 2):
//   - per-head [q_h; k_h; v_h] and per-group [k_g; v_g] rows are whole heads
//     (groups) in the logical tensor, so a rank's rows are one contiguous run;
//   - SwiGLU's [gate; up] logically: rank r holds [gate_r; up_r], two runs;
//   - with fewer KV groups than tp ranks, each group is replicated over
//     tp / kv_heads consecutive ranks: rank r holds group r / (tp / kv_heads),
//     the group of its own query heads, so every layout computes the same
//     model. This is shardkit's rule for Megatron's fused `key_value`, which
//     neither NNM (Megatron requires kv_heads % tp == 0) nor NxD writes. NxD's
//     own replication (GQAQKVColumnParallelLinear, modules/qkv_linear.py,
//     _initialize_affine_weight: master_weight.repeat(kv_size_multiplier, 1))
//     tiles the heads instead, so its rank r holds group r % kv_heads, on its
//     separate weight_q/k/v; tags in that form are not read here yet.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/spec/shard_spec.h"

namespace ckpt {

// The model family a checkpoint's names and partitioning follow
// (ckpt/spec/model_family.h states each): Megatron-style
// (`language_model.encoder.layers.N...`, NNM and NxDT's megatron models) or
// HF-style Llama (`model.layers.N...`, NxDT's `model_source: hf`).
enum class ModelFamily { kMegatron, kHfLlama };
// NxD's hardware backend, which decides how KV heads are replicated over tp
// ranks (ckpt/spec/model_family.h); kUnknown when the data cannot tell and it does
// not matter for the layout at hand.
enum class HwBackend { kUnknown, kTrn1, kTrn2 };

// LoRA (NxD modules/lora/): low-rank adapters on some linear layers of the
// HF-style family, and which of NxD's three save modes a tag holds
// (model.py LoraModel._get_lora_adapter_state_dict): the base (targets renamed
// `<module>.base_layer.<weight>`) with the adapters, the adapters alone, or
// the base with the adapters merged in (no adapters). rank 0: no LoRA. The
// rules are ckpt/spec/lora.h's.
enum class LoraSaved { kBaseAndAdapter, kAdapterOnly, kMerged };
struct LoraFormat {
  int64_t rank = 0;    // LoraConfig.lora_rank
  double alpha = 0;    // LoraConfig.lora_alpha
  bool use_rslora = false;
  std::vector<std::string> targets;  // LoraConfig.target_modules, as saved
  LoraSaved saved = LoraSaved::kBaseAndAdapter;
  bool on() const { return rank > 0; }
  bool operator==(const LoraFormat&) const = default;
};

// What describes a checkpoint's model format, as NxDT's model config names
// it; nothing about training (dropout, recompute, seeds). A manifest carries
// it, so a tag can be resharded without its training config.
struct ModelFormat {
  int64_t hidden = 0, ffn = 0, heads = 0, kv_heads = 0, layers = 0;
  int64_t vocab_size = 0;                    // the tokenizer's, before padding
  int64_t make_vocab_size_divisible_by = 1;  // padded to a multiple of this times tp
  bool layernorm = false;          // normalization: layernorm (else rmsnorm)
  bool gelu = false;               // activation: gelu (else swiglu, fused [gate; up])
  bool bias = false;               // has_bias: every linear layer has a bias
  bool learned_positions = false;  // position_embedding_type: learned_absolute (else rope)
  int64_t max_positions = 0;       // rows of the learned position table; with rope, the longest sequence
  bool tied_output = false;        // share_embeddings_and_output_weights
  // What the forward pass depends on beyond the tensors, so that an export
  // describes the model that was trained (HF's config.json): the rotary base
  // (HF rope_theta; NxDT megatron and NNM call it position_freq_base), the
  // norm epsilon (layernorm_epsilon; HF rms_norm_eps / layer_norm_epsilon)
  // and the share of each head's dimensions rope rotates. Manifests written
  // before these were recorded read as the defaults, the values they were
  // trained with.
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double rotary_percentage = 1.0;
  // The family, and what only the HF-style family varies: NxDT's
  // model.fuse_qkv and model.qkv_linear (which attention tensors exist) and
  // distributed_strategy.kv_replicator with the backend (how KV heads are
  // replicated over tp ranks). Megatron-style tags keep the defaults.
  ModelFamily family = ModelFamily::kMegatron;
  bool fuse_qkv = true, qkv_linear = false;
  int64_t kv_size_multiplier = 1;
  HwBackend hw_backend = HwBackend::kUnknown;
  // Mixtral (MoE): the routed experts of NxD's MoE layer (modules/moe/model.py
  // MoE: a RouterTopK and ExpertMLPs), `experts` of them, each token sent to
  // `moe_top_k`, in the layers moe_frequency picks (IsMoeLayer in
  // ckpt/spec/model_family.h); 0 experts: a dense model. NxDT's
  // num_local_experts / num_experts_per_tok / moe_frequency (HF-style) and
  // num_moe_experts / moe_top_k / moe_frequency (Megatron-style).
  int64_t experts = 0, moe_top_k = 0, moe_frequency = 1;
  bool moe() const { return experts > 0; }
  // LoRA fine-tuning (the HF-style family only; off by default).
  LoraFormat lora;

  int64_t head_dim() const { return hidden / heads; }
  int64_t PaddedVocab(int tp) const;  // Megatron's _vocab_size_with_padding
  // The make_vocab_size_divisible_by that pads `vocab` to exactly `rows` at
  // `tp`, for files that record no rule (NNM's HF -> NNM converter writes no
  // hyper_parameters): NNM's default, 128 (megatron_llama_config.yaml), when
  // it fits, else the smallest rule that does; nullopt when none does. Any
  // rule that fits gives the same rows at this tp; they differ at others.
  static std::optional<int64_t> PaddingRuleGiving(int64_t vocab, int64_t rows, int tp);
  static constexpr int64_t kNnmDefaultPaddingRule = 128;
  std::string Describe() const;       // "llama-style, 4 layers, hidden 64, 4 heads (2 KV), vocab 250"
  // Why the degrees cannot hold this model ("" when they can): tp must divide
  // heads, KV heads (or be a multiple of them), ffn; pp at most the layers.
  std::string CheckTensorParallel(int tp) const;
  // Why expert parallel degree `ep` cannot hold this model ("" when it can):
  // NxD gives each ep rank experts / ep whole experts (moe_parallel_layers.py
  // ExpertFusedColumnParallelLinear: utils.divide(num_experts, ep size)); a
  // dense model takes ep 1 only.
  std::string CheckExpertParallel(int ep) const;
  // Why the sizes are beyond any model ("" when they are not): at most
  // kMaxLayers layers, hidden and FFN widths up to 2^20, a vocabulary up to
  // 2^24. The largest published dense models have under 200 layers, widths
  // under 2^17 and vocabularies under 2^18, so these refuse only hostile or
  // mistyped input, before anything is planned or allocated for it.
  std::string CheckSizes() const;
  static constexpr int64_t kMaxLayers = 1 << 14;
  static constexpr int64_t kMaxVocab = 1 << 24, kMaxPositions = 1 << 24;
  static constexpr int64_t kMaxPaddingRule = 1 << 20;  // make_vocab_size_divisible_by
  nlohmann::ordered_json ToJson() const;
  // Throws ckpt::Error naming `where` and the field.
  static ModelFormat FromJson(const nlohmann::json& j, const std::string& where);
  bool operator==(const ModelFormat&) const = default;
};

// kExperts: a Mixtral expert weight, 3-D (experts first); its shard spec says
// how tp and ep cut it (ExpertSpec), not a row or column split.
enum class SplitDim { kReplicated, kRows, kColumns, kExperts };
// kQueryHeads, kKvHeads and kQkvHeads are the HF-style family's, whose head
// placement over tp ranks follows NxD's KV replication (ckpt/spec/model_family.h):
// head blocks of head_dim rows (o_proj: columns) of the query, of K or V, or of
// the logical [Q; K; V] (rank r holds [its q heads; its k heads; its v heads]).
enum class FusedRows { kPlain, kPerHeadQkv, kPerGroupKv, kGateUp, kQueryHeads, kKvHeads, kQkvHeads };
// Which pipeline stage holds a parameter outside the decoder layers.
enum class StagePlace { kLayer, kFirst, kLast };

// One logical parameter.
struct ParamRule {
  std::string name;             // NxDT's state-dict name
  std::vector<int64_t> shape;   // logical: tp = 1, vocab padded for the tp it was made for
  SplitDim split = SplitDim::kReplicated;
  FusedRows fused = FusedRows::kPlain;
  bool vocab = false;           // rows are the (padded) vocabulary
  int layer = -1;               // the decoder layer it belongs to; -1 for embeddings, final norm, output
  StagePlace place = StagePlace::kLayer;  // embeddings: the first stage; final norm and output: the last
  bool norm = false;            // a norm's weight or bias
  // How the parameter is cut over the parallel axes: the family's table
  // declares it (TensorParallelSpec of the split and fused layout above);
  // every layout question is asked of it (ckpt/spec/shard_spec.h).
  ShardSpec spec = {};
};

// The shard spec of a parameter of logical `shape` that tensor parallelism
// cuts by `split` and `fused`, with f's heads and KV replication; replicated
// over dp, and over tp too when not split. Pipeline stages place it
// (StagePlace), they do not cut it.
ShardSpec TensorParallelSpec(const std::vector<int64_t>& shape, SplitDim split, FusedRows fused, const ModelFormat& f);
// The shard spec of a Mixtral expert weight of logical (experts, in, out)
// `shape`: experts contiguous over ep (dim 0), and over tp dim 2 with stride 2
// for the fused [gate || up] input (ExpertFusedColumnParallelLinear:
// weight_partition_dim 2, stride 2), dim 1 for the output
// (ExpertFusedRowParallelLinear: weight_partition_dim 1); replicated over dp.
enum class ExpertWeight { kGateUp, kDown };
ShardSpec ExpertSpec(const std::vector<int64_t>& shape, ExpertWeight which);
// The KV replication of f's head splits, no regions yet: NxD's rule
// (ckpt/spec/model_family.h), kv_size_multiplier and the backend's order.
HeadSplit KvReplicationOf(const ModelFormat& f);

// Every logical parameter in module (state-dict) order, vocab padded for `tp`.
std::vector<ParamRule> LogicalParameters(const ModelFormat& f, int tp = 1);
// The parameters a tag's optimizer files list, in their order: f's
// LogicalParameters, but the training's (base and adapters) for an
// adapter-only LoRA tag: NxD saves the same optimizer file in every save
// mode (trainer/checkpoint.py save_checkpoint saves optimizer.state_dict()
// whatever _get_lora_adapter_state_dict left out), whose param_groups list
// the frozen base and whose state holds the adapters'.
std::vector<ParamRule> OptimizerParameters(const ModelFormat& f, int tp = 1);

// The runs (ckpt/spec/shard_spec.h: `count` indices along the split dim from
// local index `local` are logical indices from `logical`) of tp rank `rank`
// in local order (one whole run of dim 0 when replicated): its boxes
// (BoxesOf of p.spec) along the split dim. p.spec carries f's heads and KV
// replication, so `f` is that of the table p came from. Not for an expert
// weight (SplitDim::kExperts), cut on two dims: its boxes are LocalBoxes.
std::vector<Run> LocalRuns(const ParamRule& p, const ModelFormat& f, int tp, int rank);
// The boxes the rank at `at` holds of p (BoxesOf of p.spec), in local row-major order.
std::vector<Box> LocalBoxes(const ParamRule& p, const AxisCoords& at);
// The local shape of tp rank `rank`'s slice (LocalShapeOf of p.spec).
std::vector<int64_t> LocalShape(const ParamRule& p, const ModelFormat& f, int tp, int rank);
// The local shape of the rank at `at` (every axis: an expert weight's ep too).
std::vector<int64_t> LocalShape(const ParamRule& p, const AxisCoords& at);

// With fewer KV groups than tp ranks (kv_heads < tp), the KV group tp rank
// `rank` holds, and the tp ranks [first, first + count) holding it with it.
struct KvReplicas {
  int64_t group;
  int first, count;
};
KvReplicas KvReplicasOf(int64_t kv_heads, int tp, int rank);

// Pipeline stages: the first layer of each stage and, last, the layer count.
// No cuts: NxD's even split with the remainder on the last stages (10 layers
// on 3 stages: 3, 3, 4). Cuts: the first layer of stages 1..pp-1, ascending.
// Throws ckpt::Error naming what does not fit.
std::vector<int64_t> StageBounds(int64_t layers, int pp, const std::vector<int64_t>& cuts = {});
// The cuts of a stage split (StageBounds without its first and last entries).
std::vector<int64_t> CutsOf(const std::vector<int64_t>& bounds);

// Virtual pipeline stages (NxD's NxDPPModel virtual_pipeline_size V): the
// model is cut in pp * V stages as StageBounds cuts pp (pipeline/model.py
// calls create_partitions(pp * V, layers)), and stage s runs on pp rank
// s % pp (pipeline/partition.py stage_to_pipeline_parallel_rank) as its model
// chunk s / pp (model.py get_current_stage: stage = pp * chunk + pp_rank). So
// pp rank p holds stages p, p + pp, p + 2 pp, ..., with global layer names.
// `bounds` below are StageBounds over all pp * V stages; V = 1 is the plain
// pipeline, where stage and pp rank are one.
//
// StageBounds(layers, pp * V, cuts), refusing a V that leaves a stage without
// a layer, naming the virtual pipeline. Throws ckpt::Error.
std::vector<int64_t> VirtualStageBounds(int64_t layers, int pp, int virtual_stages, const std::vector<int64_t>& cuts = {});
// The [first, end) layer ranges pp rank `rank` holds, in the order it runs them.
std::vector<std::pair<int64_t, int64_t>> RankLayerRanges(const std::vector<int64_t>& bounds, int virtual_stages, int rank);
// The layer of what every pp rank's files hold (LoRA's lora_config entry):
// RankHoldsLayer answers true for it.
inline constexpr int64_t kEveryStageLayer = -2;
// Whether pp rank `rank` holds `layer` (kEveryStageLayer: every rank does).
bool RankHoldsLayer(const std::vector<int64_t>& bounds, int virtual_stages, int rank, int64_t layer);
// "0..1" for one range, "0..0, 2..2" for several (messages).
std::string LayerRangesString(const std::vector<std::pair<int64_t, int64_t>>& ranges);

// A parameter as one pipeline stage holds it: its name in that stage's file
// and the logical parameter it is a slice of. GPT's tied output layer is a
// copy of the embedding held under another name (TiedCopyNaming).
struct StageParam {
  std::string name;
  const ParamRule* rule;
  bool tied_copy() const { return name != rule->name; }
};

// How a tag names GPT's tied output layer (share_embeddings_and_output_weights).
enum class TiedCopyNaming {
  // NxDT's megatron GPT ties `language_model.output_layer.weight =
  // word_embeddings_weight()` (NxDT models/megatron/gpt_model.py): torch's
  // state_dict keeps both names of the shared parameter, so the last stage,
  // pp = 1 included, holds it as language_model.output_layer.weight where an
  // untied output layer would be; NxD's pipeline names a stage's parameters by
  // their original names (pipeline/model.py local_state_dict), so at pp > 1
  // the first stage holds the embedding and the last the output layer
  // (run and read: tests/data/upstream/nxdt_megatron).
  kNxdt,
  // Megatron-LM and NNM (initialize_word_embeddings): with pp > 1 only, the
  // last stage holds `word_embeddings.weight`. Read; shardkit wrote it before.
  kMegatronLm,
};
inline constexpr const char* kTiedOutputCopy = "language_model.output_layer.weight";
inline constexpr const char* kMegatronLmTiedCopy = "word_embeddings.weight";

// The parameters pp rank `stage` holds (the stages of `bounds` it runs, with
// `virtual_stages` per rank), in module order. This is also the order of the
// rank's optimizer ids (ckpt/spec/optimizer_groups.h numbers each group in
// the order given): NxD's optimizer takes NxDModel.named_parameters(), which
// at pp > 1 is NxDPPModel.local_named_parameters() (trainer/model.py): the
// rank's model chunks in stage order (local_stage_modules, appended by
// partition() for stages p, p + pp, ...), each chunk's parameters in its
// order; chunks hold ascending layers, the embedding is in stage 0's and the
// final norm and output layer in the last stage's, so that is module order.
std::vector<StageParam> StageParameters(const std::vector<ParamRule>& logical, const std::vector<int64_t>& bounds, int stage,
                                        TiedCopyNaming naming = TiedCopyNaming::kNxdt, int virtual_stages = 1);

// GPT's tied output copy when `stage` also holds the embedding it copies
// (pp = 1), else "".
std::string SameStageTiedCopy(const std::vector<StageParam>& stage);

// The layer a parameter name belongs to ("...layers.17.mlp..." -> 17), or -1.
int LayerOfName(const std::string& name);

// ZeRO-1 (torch-xla's ZeroRedundancyOptimizer as NxD runs it): a parameter's
// state is padded on dim 0 to a multiple of dp and cut in dp equal chunks;
// dp rank d keeps chunk d. Returns the rows per chunk (dim 0 of every shard).
int64_t Zero1ShardRows(int64_t rows, int dp);

}  // namespace ckpt

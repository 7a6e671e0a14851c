// Model families: the one place that knows a family's parameter names, how
// each is partitioned (ckpt/spec/partition.h's rules are built from here), how KV
// heads are replicated over tensor-parallel ranks, and how its tensors map to
// Hugging Face's. Tools and the trainer ask these functions. (Still outside:
// ShardedTag finds a manifest-less tag's sizes by name suffixes, and the NNM
// converter and HF import have their own Megatron name knowledge.)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/pt/dtype.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/pt/tensor.h"
#include "ckpt/pt/value.h"
#include "ckpt/spec/partition.h"

namespace ckpt {

// The model format an HF config.json describes (LlamaForCausalLM,
// MixtralForCausalLM or GPT2LMHeadModel; transformers' defaults for what it
// leaves out), the
// vocabulary unpadded, Megatron-style family. Throws ckpt::Error naming
// `cpath` and the key.
ModelFormat FormatOfHfConfig(const nlohmann::json& c, const std::string& cpath);
// The same for a MixtralForCausalLM config.json (transformers'
// MixtralConfig: LlamaConfig's fields with its own defaults (rope_theta 1e6,
// rms_norm_eps 1e-5, max_position_embeddings 131072), num_local_experts
// (default 8) and num_experts_per_tok (2) as experts and moe_top_k;
// hidden_act must be silu and router_jitter_noise 0, as NxD's experts and
// RouterTopK compute). What NxDT's HF Mixtral reads
// (lightning_modules/model/hf_models/mixtral_model.py _get_model);
// FormatOfHfConfig adds the import's sliding_window refusal.
ModelFormat FormatOfHfMixtralConfig(const nlohmann::json& c, const std::string& cpath);

// The modules a decoder is built from, and the names of their weights in
// each family, so the trainer computes one model under either family's names.
enum class Module {
  kEmbedding, kPositionEmbedding, kFinalNorm, kOutput,  // outside the layers
  kInputNorm, kPostAttentionNorm, kAttentionOut, kMlpIn, kMlpOut,
  kQkv,                    // fused attention: Megatron's per-head [q_h; k_h; v_h], HF-style [Q; K; V] (weight_qkv, stride-3 weight)
  kQuery, kKeyValue,       // Megatron GQA: query, and key_value per group [k_g; v_g]
  kKey, kValue,            // HF-style separate q (kQuery), k, v
  // Mixtral's MoE layer (NxD modules/moe/model.py MoE: router, expert_mlps):
  // the router (RouterBase.linear_router, experts x hidden) and the 3-D
  // expert weights (Experts.gate_up_proj: experts x hidden x 2 ffn, [gate || up];
  // Experts.down_proj: experts x ffn x hidden). HF-style under
  // `model.layers.N.mlp.` (NxDT modeling_mixtral.py MixtralDecoderLayer),
  // Megatron-style under `language_model.encoder.layers.N.mlp.moe.` (NxDT
  // models/megatron/transformer.py NeuronSwitchMLP.moe).
  kRouter, kExpertsIn, kExpertsOut,
};
// The weight's name of module `m` (of layer `layer` inside the layers).
std::string ParamName(const ModelFormat& f, Module m, int layer = -1);
// Whether decoder layer `layer` (0-based, as names number it) is an MoE
// layer of f (false for a dense f). HF-style: NxDT modeling_mixtral.py
// MixtralDecoderLayer.__init__, `layer_index % moe_frequency == 0` on the
// 0-based index; Megatron-style: NxDT models/megatron/transformer.py
// ParallelTransformerLayer.__init__, `num_moe_experts > 1 and layer_number %
// moe_frequency == 0` on the 1-based layer_number.
bool IsMoeLayer(const ModelFormat& f, int64_t layer);
// NxD's SPMDRank of an MoE layer at ep > 1 (parallel_layers/layers.py
// SPMDRank, which ExpertMLPsV2 builds with enable_spmd_rank; expert
// parallelism requires it): int32 parameters outside the optimizer, `rank`
// (1,) and `local_expert_indices` (1, experts / ep), zeros as __init__ and
// initialize_expert_indices make them (only inference's create_spmd_ranks
// fills them; training never sets them). Their names and shapes in layer
// `layer`, in state-dict order (right after the router); none at ep 1 or in a
// dense layer. A reader checks them (zeros of these shapes) and drops them; a
// writer makes them for its own ep, so they follow the target ep.
struct SpmdRankTensor {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<SpmdRankTensor> SpmdRankTensors(const ModelFormat& f, int layer, int ep);
// A writer's step (the reshard engine's, the trainer's): when `key` is an MoE
// layer's router, sets that layer's SpmdRankTensors for `ep` into `d` (int32
// zeros), so they follow the router as in NxD's state dict; else nothing.
void SetSpmdRanksAfter(const ModelFormat& f, int ep, const std::string& key, Dict& d);
// Whether `name` is an SPMDRank tensor's (spmd_rank.rank, spmd_rank.local_expert_indices)
// in an MoE layer of either style, as SpmdRankTensors names them at ep > 1.
bool IsSpmdRankName(const std::string& name);
// Whether `name` is an expert weight of f (gate_up_proj or down_proj of an MoE
// layer): what NxD marks expert_model_parallel at ep > 1, so an xser ep rank
// above 0 writes those tensor files alone (ckpt/pt/xser.h SplitForXser).
bool IsExpertWeight(const ModelFormat& f, const std::string& name);
// The names of the MoE tensors in a layer's state dict, past
// "<layer prefix>." ("mlp.router.linear_router.weight", ...), of each family;
// what a reader looks for to tell a Mixtral tag from a Llama one.
std::vector<std::string> MoeLeaves(ModelFamily family);
// The first of `names` (model-file keys) inside an MoE layer's module (the
// router, expert_mlps or shared experts: NxD modules/moe/model.py MoE), or
// nullopt. What tells a Mixtral tag from a Llama one, whatever its style.
std::optional<std::string> FirstMoeName(const std::vector<std::string>& names);
// The first of `names` inside an MoE layer's module that shardkit's Mixtral
// family does not hold (shared experts, router or expert biases, spmd ranks:
// not MoeLeaves), or nullopt. A reader refuses such a tag (MoeRefusal) at any ep.
std::optional<std::string> FirstUnheldMoeName(const std::vector<std::string>& names);
// Why a model file whose keys are `names` holds an MoE that shardkit does not
// read at ep 1 ("" when it reads it, or when it holds no MoE): a part outside
// the family (MoeRefusal), or an MoE layer lacking its router or an expert
// weight. What ckpt-verify tells of a model file's MoE on its own.
std::string MoeFileProblem(const std::vector<std::string>& names);
// What a reader tells of a tag whose model files hold MoE tensor `moe_name`
// (FirstMoeName): which MoE it is, and why it refuses a part outside the
// family (FirstUnheldMoeName), else what shardkit reads of it and what not yet.
std::string MoeRefusal(const std::string& moe_name);
// "an MoE (Mixtral) model, HF-style (NxDT modeling_mixtral.py)" (or its
// Megatron-style twin) for an MoE name of either style: how messages name it.
std::string MoeModelOf(const std::string& moe_name);
// "hf_mixtral" for an HF-style MoE format, "megatron_mixtral" for a
// Megatron-style one, else FamilyName(f.family): what inspect and messages call it.
std::string FamilyLabel(const ModelFormat& f);
// --- Mixtral (MoE), both styles (issue #38) ---
// Why NxD's MoE layer as f describes it is not one the family table holds (""
// when it is, or when f is dense): experts need SwiGLU without biases in a
// Llama (NxDT NeuronSwitchMLP asserts activation == "swiglu" and bias False;
// modeling_mixtral.py passes glu_mlp=True), and a Megatron-style MoE layer
// more than one expert. CheckTensorParallel refuses with it.
std::string MoeUnsupported(const ModelFormat& f);
// Why an MoE f has no Hugging Face MixtralForCausalLM ("" when it has one, or
// when f is dense): MoeUnsupported, or a dense layer (HF's Mixtral makes every
// layer MoE).
std::string MoeHfUnsupported(const ModelFormat& f);
// The Hugging Face architecture f's tensors map to: MixtralForCausalLM,
// GPT2LMHeadModel or LlamaForCausalLM.
const char* HfArchitecture(const ModelFormat& f);

// NxDT's Megatron-style models keep RoPE's inverse frequencies as a
// persistent buffer of every layer (NxDT models/megatron/rotary_pos_embedding.py
// RotaryEmbedding.__init__: register_buffer("inv_freq", ...)), so the tags
// NxDT writes hold it, after the layer's attention input weights
// (ParallelAttention registers core_attention, which holds rotary_emb, after
// query_key_value). NxDT's own load lets it be missing (nlp_overrides.py
// _key_patterns_to_be_ignored); NxD's load_checkpoint, strict by default, does
// not. Its name in layer `layer`; empty when the format has none (learned
// positions, or the HF-style family).
std::string RotaryBufferName(const ModelFormat& f, int layer);
// Its values, as that line computes them in float32:
// 1.0 / (base ** (arange(0, rot, 2).float() / rot)), rot = int(head_dim * rotary_percentage).
std::vector<float> RotaryInvFreq(const ModelFormat& f);
// A weight's bias ("x.weight" -> "x.bias"; Megatron's GPT has them).
std::string BiasOf(const std::string& weight);
// Which attention tensors the format has: one fused, query and key_value (Megatron GQA), or separate q, k, v (HF-style).
enum class AttentionTensors { kFused, kQueryAndKeyValue, kSeparate };
AttentionTensors AttentionTensorsOf(const ModelFormat& f);

const char* FamilyName(ModelFamily f);  // "megatron", "hf_llama" (as manifests record it)
std::optional<ModelFamily> ParseFamily(const std::string& s);
const char* BackendName(HwBackend b);   // "trn1", "trn2", "unknown"
std::optional<HwBackend> ParseBackend(const std::string& s);  // "trn1", "trn2"

// The family model-file keys belong to: Megatron-style names start with
// `language_model.`, HF-style ones with `model.` or `lm_head.`; other keys
// (buffers) say nothing. Throws ckpt::Error naming `where` and one key of each
// family when they mix, or when no key tells.
ModelFamily FamilyOfNames(const std::vector<std::string>& names, const std::string& where);
// The family one key belongs to (nullopt: a buffer or a stranger's name).
std::optional<ModelFamily> FamilyOfName(const std::string& name);
// Sets f.qkv_linear and f.fuse_qkv from the attention tensors an HF-style
// model file holds, and returns the name, past "model.layers.N.", of the
// tensor holding K (weight_qkv, the stride-3 weight, weight_k or k_proj);
// nullopt when the names hold no attention of NxDT's HF-style Llama.
std::optional<std::string> HfAttentionOfNames(const std::vector<std::string>& names, ModelFormat& f);

// Every logical parameter of the HF-style Llama family (NxDT
// models/hf_models/modeling_llama.py LlamaForCausalLM), in named_parameters
// order, for `tp` (the vocabulary is not padded: tp must divide it).
// Attention follows LlamaAttention.__init__:
//   - qkv_linear (NxD GQAQKVColumnParallelLinear, modules/qkv_linear.py):
//     `qkv_proj.weight_qkv` with fuse_qkv, else `weight_q`/`weight_k`/`weight_v`;
//   - fuse_qkv without qkv_linear, with as many KV heads as heads: the
//     stride-3 `qkv_proj.weight`;
//   - otherwise `q_proj`/`k_proj`/`v_proj`.
// Fused attention is one logical tensor [Q; K; V] (HF's q_proj, k_proj,
// v_proj rows concatenated); rank r holds [its q heads; its k heads; its v
// heads]. Layer numbers are global under pipeline parallelism (NxD
// NxDPPModel.local_state_dict keeps the original names).
std::vector<ParamRule> HfLlamaParameters(const ModelFormat& f, int tp);

// --- Mixtral (MoE), both styles (issue #38) ---
// Appends the MoE parameters of MoE layer `layer` of f (IsMoeLayer) in NxD's
// module order (modules/moe/model.py MoE: router, then expert_mlps' gate_up_proj
// and down_proj), under f's family's names (ParamName): what replaces the dense
// MLP in both styles' tables (HfLlamaParameters, and LogicalParameters'
// Megatron-style table for NxDT's NeuronSwitchMLP).
void AppendMoeParameters(const ModelFormat& f, int layer, std::vector<ParamRule>& p);

// NxD's KV replication (HF-style family). With m = kv_size_multiplier, KV
// heads are repeated m times and split over tp ranks, n = kv_heads * m / tp
// per rank (qkv_linear.py _initialize_affine_weight):
//   - Trn1 (every backend but Trn2): master.repeat(m, 1), so rank r holds KV
//     head r % kv_heads (n = 1) and ranks r, r + kv_heads, ... share it
//     (parallel_state.py arrange_kv_groups). Queries are permuted to match:
//     rank r holds query block (r % kv_heads) * m + r / kv_heads
//     (scripts/checkpoint_converter.py convert_full_state_to_tp, the
//     `weights[indicies + i]` reordering); o_proj's columns alike.
//   - Trn2: repeat_interleave, so rank r holds KV head r / m, consecutive
//     ranks share it, and queries keep their order. (The runtime repeats rows,
//     not heads, and the converter writes Trn2 with the Trn1 rule; both are
//     NxD bugs, see tests/data/upstream/hf_llama/README.md. This is the
//     head-level rule the runtime's comment, arrange_kv_groups' Trn2 groups
//     and the converter's Trn2 query order all state.)
//   - m = 1: rank r holds KV heads [r n, r n + n) and query heads in order.
// Why f cannot be laid out at tp ("" when it can).
std::string KvReplicationProblem(const ModelFormat& f, int tp);
// For a Megatron-style format with fewer KV heads than tp ranks: why the tag
// loads only in shardkit (NNM's and NxDT's megatron models assert that tp
// divides the KV heads; the replication is shardkit's, KvReplicasOf). "" otherwise.
std::string MegatronKvReplicationNote(const ModelFormat& f, int tp);
// Whether the backend changes which tp ranks hold which KV heads at tp (1 < m < tp).
bool BackendMatters(const ModelFormat& f, int tp);
// The KV heads and query heads tp rank `rank` holds, in local order (the
// head split of the family's spec: KvHeadsOf, QueryHeadsOf in ckpt/spec/shard_spec.h).
std::vector<int64_t> KvHeadsOfRank(const ModelFormat& f, int tp, int rank);
std::vector<int64_t> QueryHeadsOfRank(const ModelFormat& f, int tp, int rank);

// What the data of an HF-style tag says about its KV replication: the tp
// ranks holding equal KV rows (`same(a, b)`) form NxD's KV groups; their size
// is m, interleaved groups mean Trn1, consecutive ones Trn2. `backend` is
// kUnknown when the groups fit both (m = 1 or m = tp). Throws ckpt::Error,
// naming the groups, when they fit neither rule.
struct KvReplicationSeen {
  int64_t multiplier = 1;
  HwBackend backend = HwBackend::kUnknown;
  std::string groups;  // "[[0, 2], [1, 3]]"
};
KvReplicationSeen InferKvReplication(int tp, const std::function<bool(int, int)>& same);

// The optimizer grouping a rule gives the family's parameters: NxdtGrouping
// for Megatron-style models, NxdtHfGrouping for HF-style ones, each with
// do_layer_norm_weight_decay as NxDT means it for that family; or
// NameSplit (Megatron-style names; NxD's llama example, shardkit before).
Grouping FamilyGrouping(const ModelFormat& f, const std::vector<std::string>& params, GroupingRule rule);

// Where an HF tensor's rows come from: `rows` rows of logical tensor `name`
// from `row`, concatenated in order; `transpose`: the concatenation is
// transposed (GPT-2's Conv1D stores [in, out]). The one mapping both
// directions use (export in tools/hf_export.h, import in tools/hf_state.h).
// `step` > 1 (Mixtral's experts): the rows are row, row + step, ... of the
// logical tensor seen as rows of the spec's width (gate_up_proj[e]'s gate half
// is every other row of width ffn).
struct HfRowBlock {
  std::string name;
  int64_t row, rows;
  int64_t step = 1;
};
struct HfTensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // HF's
  DType dtype = DType::kFloat32;
  std::vector<HfRowBlock> blocks;
  int64_t width = 1;  // elements per logical row
  bool transpose = false;

  uint64_t numel() const { return static_cast<uint64_t>(ShapeNumel(shape)); }
  uint64_t bytes() const { return numel() * ElementSize(dtype); }
};
// The HF tensors of a supported format (HfUnsupported empty), in HF's order.
std::vector<HfTensorSpec> HfTensorsFor(const ModelFormat& f, DType dtype);

// Where each logical tensor of format `to` lies in those of `from`, for two
// formats of one Llama whose logical tensors differ: HF-style attention fused
// or separate, or one format of each family. Each target tensor's rows
// [row, row + from.rows) are rows [from.row, ...) of `from`'s logical tensor
// from.name; rows no piece covers (vocabulary padding) read as zero. Derived
// through the HF tensors both map to (HfTensorsFor), so it is exact by
// construction. Throws ckpt::Error when the formats are of different models,
// or GPT-style (whose HF tensors are transposed).
// What a format says of the model alone: the family, attention tensors, KV
// replication and vocabulary padding reset (they say how tensors are cut and
// named, not what the model computes).
ModelFormat LayoutFree(const ModelFormat& f);
// Whether two formats name their logical tensors alike (else one is read
// under the other's names through LogicalRowsIn: RenamedState).
bool SameLogicalNames(const ModelFormat& a, const ModelFormat& b);
struct RowsFrom {
  int64_t row;
  HfRowBlock from;
};
std::map<std::string, std::vector<RowsFrom>> LogicalRowsIn(const ModelFormat& from, const ModelFormat& to);

// Why the format has no Hugging Face architecture here ("" when it has one).
std::string HfUnsupported(const ModelFormat& f);

}  // namespace ckpt

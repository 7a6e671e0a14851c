// A checkpoint's weights as a Hugging Face model folder (ckpt-export
// --format hf), streamed from any LogicalState:
//   config.json           LlamaForCausalLM (the llama-style format: RMSNorm,
//                         SwiGLU, RoPE), MixtralForCausalLM (its MoE form)
//                         or GPT2LMHeadModel (the GPT format:
//                         LayerNorm, GeLU, biases, learned positions)
//   pytorch_model.bin     torch's zip format, or pytorch_model-0000k-of-0000n.bin
//                         with pytorch_model.bin.index.json past --max_shard_size
//   model.safetensors     the same tensors (model-0000k-of-0000n.safetensors
//                         with model.safetensors.index.json past the size)
//
// HF's names and layouts, from NxDT's logical tensors (ckpt/spec/partition.h):
//   - Llama: query_key_value is per head [q_h; k_h; v_h]: NNM's HF converter
//     (neuronx-nemo-megatron, convert_hf_checkpoint_to_nemo_llama.py,
//     convert_state_dict_for_pp_rank) concatenates q, k, v and reorders them
//     with fix_query_key_value_ordering(..., 2.0, 3, heads, head_dim), i.e.
//     (3, heads, hd) -> (heads, 3, hd); its rows are gathered back into
//     q_proj, k_proj, v_proj. With GQA, `query` is q_proj and key_value, per
//     group [k_g; v_g], gives k_proj and v_proj. dense_h_to_4h is [gate; up]
//     (the same converter concatenates gate_proj and up_proj per tp rank).
//     No row permutation for RoPE: that converter copies q and k rows as
//     they are, and the training core rotates halves (rotate_half) as HF's
//     Llama does. config.json's rms_norm_eps, rope_theta and
//     max_position_embeddings are the tag's (ModelFormat, recorded in its
//     manifest); partial rotary, which LlamaForCausalLM cannot express, is
//     refused.
//   - GPT-2: Conv1D weights are [in, out], so every linear weight is
//     transposed; c_attn is [q; k; v] over all heads (de-interleaved).
//   - Mixtral (MoE, either style; MixtralForCausalLM): the router is
//     block_sparse_moe.gate; expert e's w1 and w3 are gate_up_proj[e]'s gate
//     and up halves transposed, w2 is down_proj[e] transposed (NxD keeps
//     them input-major; ckpt::HfTensorsFor states the mapping). Each expert
//     matrix is held whole while it is written, as GPT-2's are. A tag whose
//     recorded job config routes otherwise than HF's softmax top-k with
//     renormalised weights (Sinkhorn, normalize_top_k_affinities off) is
//     refused naming the key; without a job config the routing is not known.
//   - Vocab padding rows are dropped; a tied output layer is HF's tie
//     (tie_word_embeddings, no lm_head tensor).
// Memory: Llama tensors stream a chunk at a time (threads + 1 chunks in
// flight, HfExportOptions::threads); GPT-2's and Mixtral's transposed ones
// hold one logical matrix more, one at a time whatever the threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/shard/fingerprint.h"
#include "ckpt/shard/logical_state.h"
#include "ckpt/spec/model_family.h"

namespace tools {

using ckpt::HfRowBlock;
using ckpt::HfTensorSpec;

struct HfExportOptions {
  uint64_t max_shard_size = uint64_t{10} << 30;  // bytes per weights file
  size_t chunk = size_t{16} << 20;               // streaming granularity
  // Threads reading (and re-laying) the safetensors files' next chunks while
  // this one writes the current one, into a ring of threads + 1 chunks
  // (ckpt/shard/stream_budget.h sizes the chunk for threads + 1 streams).
  int threads = 1;
  // Also write torch's pytorch_model*.bin beside model*.safetensors (which
  // transformers prefers, and which alone is written by default).
  bool bin = false;
  // Instead of the weights files: one torch state dict, checkpoint.pt, HF's
  // names and order, as NxD's checkpoint_converter.py --convert_to_full_state
  // writes it (save_full), with config.json beside it for its --config.
  // A Mixtral's full state follows HF's orientation (w1, w3 (I, H); w2 (H, I)):
  // the same tensors as the folder's. NxD's training converter
  // (examples/training/mixtral/convert_checkpoints.py) writes them transposed
  // (w1 (H, I)); ckpt-import refuses such a file by its shapes, which cannot
  // tell the two apart when I == H.
  bool full_state = false;
  // When set, every logical byte read as it is (not merged with LoRA
  // adapters) is summed into it as it passes, so the caller checks the
  // source's recorded fingerprints from the pass that wrote, not from a pass
  // of its own. A tensor read twice (--bin) or merged leaves it partial or
  // doubled, which FingerprintCollector::Finish reports.
  ckpt::FingerprintCollector* fingerprints = nullptr;
};

struct HfExportSummary {
  std::string architecture;
  int shards = 0;
  uint64_t tensors = 0, bytes = 0;
};

// Writes the folder's files into `dir` (an existing, empty folder the caller
// publishes). Throws ckpt::Error.
HfExportSummary WriteHfFolder(const ckpt::LogicalState& src, const std::string& dir, const HfExportOptions& o, ckpt::Env* env);

// The LoRA adapters of a tag holding base and adapters as a peft folder
// (ckpt-export --format peft): adapter_config.json (peft's LoraConfig: r,
// lora_alpha, use_rslora, target_modules in HF's names) and
// adapter_model.safetensors, peft's names
// (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight, ...), in
// the adapters' dtype. NxD's one lora_A of qkv_proj (gate_up_proj) is each
// of q, k, v (gate, up)'s; lora_B's rows are split as the base's are for HF
// (HfTensorsFor: HF's head order). Throws ckpt::Error.
HfExportSummary WritePeftFolder(const ckpt::LogicalState& src, const std::string& dir, const HfExportOptions& o, ckpt::Env* env);

}  // namespace tools

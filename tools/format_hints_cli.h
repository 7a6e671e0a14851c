// The command-line options that describe a tag without a manifest (NxD's own
// tags): what tensor shapes cannot tell. One definition for every tool that
// reads such tags (ckpt-reshard, ckpt-export, ckpt-verify --against).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>

#include "ckpt/shard/logical_state.h"
#include "ckpt/spec/model_family.h"

namespace tools {

struct FormatHintOptions {
  int64_t heads = 0, kv_heads = 0, vocab = 0, divisible = 0;
  double rope_theta = 0, norm_eps = 0, rotary = 0;
  int64_t kv_size_multiplier = 0, moe_top_k = 0;
  std::string hw_backend, model_config, config;

  void AddTo(CLI::App& app) {
    app.add_option("--heads", heads, "num_attention_heads, for a tag without a manifest (NxD's)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--kv_heads", kv_heads, "num_kv_heads, when shapes cannot tell")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--vocab_size", vocab, "the unpadded vocabulary, for a tag without a manifest")->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
    app.add_option("--make_vocab_size_divisible_by", divisible, "the vocabulary padding rule")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--rope_theta", rope_theta, "the rotary base (position_freq_base), for a tag that does not record it (default 10000)")
        ->check(CLI::Range(1e-30, 1e12));
    app.add_option("--layernorm_epsilon", norm_eps, "the norm epsilon, for a tag that does not record it (default 1e-5)")
        ->check(CLI::Range(1e-30, 0.5));
    app.add_option("--rotary_percentage", rotary, "the share of each head rope rotates, for a tag that does not record it (default 1)")
        ->check(CLI::Range(1e-9, 1.0));
    // Named as NxD's checkpoint_converter.py names them.
    app.add_option("--kv_size_multiplier", kv_size_multiplier,
                   "HF-style tags: NxDT's distributed_strategy.kv_replicator (default: inferred from which tp ranks hold equal KV rows)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--hw_backend", hw_backend, "HF-style tags: how KV heads are replicated, when the data cannot tell (trn1: interleaved, trn2: consecutive)")
        ->check(CLI::IsMember({"trn1", "trn2"}));
    app.add_option("--moe_top_k", moe_top_k, "HF-style Mixtral tags without a manifest: experts per token (num_experts_per_tok)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
    app.add_option("--model_config", model_config,
                   "an HF config.json (NxDT's model.model_config): heads, KV heads, sizes, rope_theta and rms_norm_eps, checked against the tensors");
    app.add_option("--config", config,
                   "the NxDT job config (YAML) the tag was trained with: its model (model.model_config, or the megatron keys), "
                   "distributed_strategy.kv_replicator, model.fuse_qkv and model.qkv_linear, checked against the tensors");
  }

  // Throws ckpt::Error for a --model_config or --config that cannot be read, or that a flag contradicts.
  ckpt::FormatHints Hints() const;
};

}  // namespace tools

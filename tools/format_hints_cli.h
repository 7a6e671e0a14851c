// The command-line options that describe a tag without a manifest (NxD's own
// tags): what tensor shapes cannot tell. One definition for every tool that
// reads such tags (ckpt-reshard, ckpt-export, ckpt-verify --against).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>

#include "ckpt/logical_state.h"

namespace tools {

struct FormatHintOptions {
  int64_t heads = 0, kv_heads = 0, vocab = 0, divisible = 0;
  double rope_theta = 0, norm_eps = 0, rotary = 0;

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
  }

  ckpt::FormatHints Hints() const {
    ckpt::FormatHints h;
    if (heads) h.heads = heads;
    if (kv_heads) h.kv_heads = kv_heads;
    if (vocab) h.vocab_size = vocab;
    if (divisible) h.make_vocab_size_divisible_by = divisible;
    if (rope_theta) h.rope_theta = rope_theta;
    if (norm_eps) h.norm_eps = norm_eps;
    if (rotary) h.rotary_percentage = rotary;
    return h;
  }
};

}  // namespace tools

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

  void AddTo(CLI::App& app) {
    app.add_option("--heads", heads, "num_attention_heads, for a tag without a manifest (NxD's)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--kv_heads", kv_heads, "num_kv_heads, when shapes cannot tell")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    app.add_option("--vocab_size", vocab, "the unpadded vocabulary, for a tag without a manifest")->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
    app.add_option("--make_vocab_size_divisible_by", divisible, "the vocabulary padding rule")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  }

  ckpt::FormatHints Hints() const {
    ckpt::FormatHints h;
    if (heads) h.heads = heads;
    if (kv_heads) h.kv_heads = kv_heads;
    if (vocab) h.vocab_size = vocab;
    if (divisible) h.make_vocab_size_divisible_by = divisible;
    return h;
  }
};

}  // namespace tools

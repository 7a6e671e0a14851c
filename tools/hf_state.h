// A Hugging Face model folder read as a LogicalState (ckpt-import --format
// hf), so teams that start from an HF model get an NxDT tag in any layout.
//
// config.json names the architecture: LlamaForCausalLM (hidden_size,
// intermediate_size, num_attention_heads, num_key_value_heads,
// num_hidden_layers, vocab_size, tie_word_embeddings) or GPT2LMHeadModel
// (n_embd, n_inner, n_head, n_layer, n_positions, vocab_size,
// activation_function "gelu", the training core's). Weights come from
// model.safetensors (or its sharded index) when present, else from
// pytorch_model.bin (or its index), neither read whole: a safetensors
// tensor's rows are read with pread into the caller's chunk (an
// OpenFileCache), a .bin's from its mapped storage.
// Logical tensors are rebuilt by inverting ckpt-export's mapping
// (ckpt::HfTensorsFor in ckpt/spec/model_family.h): q/k/v back into per-head [q;k;v]
// (or query and per-group [k;v]), gate/up into [gate; up], GPT-2's Conv1D
// transposed back, a Mixtral's experts (w1, w3,
// w2 per expert; MixtralForCausalLM, num_local_experts, num_experts_per_tok)
// transposed back into gate_up_proj and down_proj: each transpose streamed in
// tiles into the caller's chunk, no matrix held whole. A Read of a small piece
// (a column split's row piece, a transposed matrix's clipped row) is copied out of
// a band of the matrix each thread keeps (HfState::ReadThroughBand). Vocab rows past vocab_size
// read as zero padding. No optimizer state: the tag is weights only.
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/util/open_file_cache.h"
#include "ckpt/shard/logical_state.h"
#include "ckpt/shard/source_registry.h"
#include "ckpt/pt/value.h"
#include "tools/hf_export.h"

namespace tools {

using ckpt::FormatOfHfConfig;  // ckpt/spec/model_family.h
// A JSON file read through `env`. Throws ckpt::Error naming it.
nlohmann::json ReadJson(ckpt::Env* env, const std::string& path);

// One tensor of a safetensors file: its dtype, shape and byte range in the
// file (past the header).
struct SafetensorsEntry {
  ckpt::DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;  // absolute offsets in the file
};
// Parses a safetensors file's header (8-byte little-endian length, JSON) and
// checks every entry against the file's size. Throws ckpt::Error naming
// `where` and the tensor.
std::map<std::string, SafetensorsEntry> ParseSafetensors(std::span<const uint8_t> file, const std::string& where);

// How an HF model is imported: into the Megatron-style family (NNM's and
// NxDT's megatron models, vocabulary padded) or the HF-style one (NxDT's
// model_source: hf, whose attention tensors NxDT's model.fuse_qkv and
// model.qkv_linear name; no padding).
struct HfImportOptions {
  int64_t make_vocab_size_divisible_by = 128;
  ckpt::ModelFamily family = ckpt::ModelFamily::kMegatron;
  bool fuse_qkv = true, qkv_linear = false;
  // config.json for a single weights file (NxD's checkpoint.pt, a pytorch_model.bin); default: the folder's.
  std::string model_config;
};

// Whether `path` is a Hugging Face model folder: config.json beside
// model.safetensors, pytorch_model.bin or either's index. Reads the listing only.
bool IsHfFolder(ckpt::Env* env, const std::string& path);

// The registry entry "hf": detects with IsHfFolder; opens with HfState::Open,
// taking SourceOptions' family and model_config, and from its hints
// make_vocab_size_divisible_by (default 128), fuse_qkv (true) and
// qkv_linear (false). Bytes are the weights files'; no tag name.
ckpt::SourceKind HfSourceKind();

class HfState final : public ckpt::LogicalState {
 public:
  // `src`: an HF model folder, or one weights file (a torch state dict, as
  // NxD's checkpoint_converter.py --convert_to_full_state writes it, or
  // safetensors) with o.model_config. Throws ckpt::Error naming the file,
  // the key or tensor and what is wrong.
  static std::unique_ptr<HfState> Open(ckpt::Env* env, const std::string& src, const HfImportOptions& o);

  const std::string& path() const override { return dir_; }
  const ckpt::TagDescription& layout() const override { return layout_; }
  const std::vector<ckpt::ParamRule>& params() const override { return params_; }
  bool Has(const std::string& name, ckpt::StateField f) const override;
  ckpt::DType dtype(const std::string&, ckpt::StateField) const override { return dtype_; }
  void Read(const std::string& name, ckpt::StateField f, uint64_t begin, std::span<uint8_t> out, ckpt::Touched* touched) const override;
  const ckpt::Value& Step(const std::string& name) const override;
  const ckpt::Value& ParamGroups() const override { return none_; }
  const std::vector<ckpt::StateBuffer>& buffers() const override { return buffers_; }
  bool model_dict_ordered() const override { return true; }
  int64_t step() const override { return 0; }
  double consumed_samples() const override { return 0; }
  const std::optional<ckpt::TensorFingerprints>& recorded_fingerprints() const override { return fingerprints_; }
  std::optional<ckpt::Value> TagFile(const std::string&) const override { return std::nullopt; }

 private:
  struct Source {  // an HF tensor's bytes, as the folder holds them
    const uint8_t* data = nullptr;
    const ckpt::MappedFile* file = nullptr;
    std::vector<int64_t> shape;
    ckpt::DType dtype = ckpt::DType::kFloat32;
    // A safetensors tensor: its plain pieces are read with pread at `offset`
    // in `file` (reads_), not copied out of the mapping. The mapping's page
    // faults and its release after each chunk (madvise, TLB flushes) were 42%
    // of the 1B import's samples, a column split faulting a span 32 times.
    bool read_at = false;
    uint64_t offset = 0;
  };
  struct Piece {  // logical rows row, row + step, ... (`rows` of them) are rows [from, ...) of `spec`'s concatenated matrix
    int64_t row, rows, from;
    const HfTensorSpec* spec;
    int64_t step = 1;
  };
  HfState() = default;
  // Read's copy of a transposed piece (GPT-2's Conv1D, Mixtral's experts, whose gate_up_proj rows
  // alternate between w1 and w3: step 2): runs of its rows in the range, each by ReadTransposedBlock.
  void ReadTransposed(const Piece& p, uint64_t begin, std::span<uint8_t> out, uint64_t band_bytes) const;
  // Rows [r0, r0 + n), columns [c0, c1) of spec's concatenated matrix (the transpose of its source)
  // into dst, row i at dst + i * stride elements; a tile of at most 1 MiB of source rows at a time,
  // read with pread (safetensors) or from the mapping (.bin), so nothing is held past the chunk.
  void ReadTransposedBlock(const HfTensorSpec& spec, uint64_t r0, uint64_t n, uint64_t c0, uint64_t c1, uint8_t* dst, uint64_t stride) const;
  // Rows [r, r + n), columns [c0, c1) of spec's matrix into dst (row i at dst + i * stride elements),
  // copied from one of this thread's bands, a band of the rows from r on refilled first when none holds
  // them: whole rows with one pread for an untransposed spec, the columns [c0, c1) by ReadTransposedBlock
  // for a transposed one. A column split's Reads then cost one pread per band, not one per row piece
  // (a transpose's clipped row: one per element). `band_bytes`: what the thread's bands may hold in
  // all (the chunk's share of the budget for source bytes: ckpt::Touched::limit). False, and nothing
  // read, when the rectangle is too large to be worth a band (the caller reads it directly).
  bool ReadThroughBand(const HfTensorSpec& spec, uint64_t r, uint64_t n, uint64_t c0, uint64_t c1, uint8_t* dst, uint64_t stride,
                       uint64_t band_bytes) const;

  std::string dir_;
  uint64_t serial_ = 0;  // which HfState a thread's band was read from (the bands outlive any one)
  ckpt::TagDescription layout_;
  std::vector<ckpt::ParamRule> params_;
  ckpt::DType dtype_ = ckpt::DType::kFloat32;
  std::vector<HfTensorSpec> specs_;
  std::map<std::string, Source> sources_;
  std::map<std::string, std::vector<Piece>> pieces_;
  std::vector<std::shared_ptr<const ckpt::MappedFile>> files_;
  std::unique_ptr<ckpt::OpenFileCache> reads_;  // the safetensors files, for Source::read_at
  std::vector<ckpt::Value> loaded_;  // .bin state dicts whose mapped storages sources_ point into
  ckpt::Value none_;
  std::vector<ckpt::StateBuffer> buffers_;
  std::optional<ckpt::TensorFingerprints> fingerprints_;
};

}  // namespace tools

// An adapter-only LoRA tag (NxD's save_lora_base False) joined with the base
// model given apart (ckpt-export --lora_base: an HF folder or a tag): one
// LogicalState holding base and adapters, which the HF export merges as it
// merges a tag that saved both (W + scale * B A in float32, rounded once to
// the base's dtype: tools/hf_export.cc LoraMerge).
//
// The joined model is the base's (sizes, vocabulary, tie, rope_theta, norm
// epsilon, dtype) under the tag's attention layout and LoRA; the base is
// read under those names through ckpt::RenamedState (HF's q_proj, k_proj,
// v_proj, or another tag's layout). The adapters and what the tag carries
// (lora_config, step) are the tag's.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/shard/renamed_state.h"

namespace tools {

class LoraWithBase final : public ckpt::LogicalState {
 public:
  // Throws ckpt::Error: `adapters` is not an adapter-only LoRA tag; `base`
  // holds LoRA itself; a base tensor an adapter targets is not [lora_B's
  // rows, lora_A's columns] (naming the HF tensor and both shapes); the base
  // has other heads or KV heads than the tag was described with.
  LoraWithBase(const ckpt::LogicalState& adapters, const ckpt::LogicalState& base);

  const std::string& path() const override { return adapters_.path(); }
  const ckpt::TagDescription& layout() const override { return layout_; }
  const std::vector<ckpt::ParamRule>& params() const override { return params_; }
  bool Has(const std::string& name, ckpt::StateField f) const override;
  ckpt::DType dtype(const std::string& name, ckpt::StateField f) const override;
  void Read(const std::string& name, ckpt::StateField f, uint64_t begin, std::span<uint8_t> out, ckpt::Touched* touched) const override;
  const ckpt::Value& Step(const std::string& name) const override { return adapters_.Step(name); }
  const ckpt::Value& ParamGroups() const override { return adapters_.ParamGroups(); }
  const std::vector<ckpt::StateBuffer>& buffers() const override { return adapters_.buffers(); }
  bool model_dict_ordered() const override { return adapters_.model_dict_ordered(); }
  int64_t step() const override { return adapters_.step(); }
  double consumed_samples() const override { return adapters_.consumed_samples(); }
  bool consumed_samples_known() const override { return adapters_.consumed_samples_known(); }
  // Each part's are checked apart (ckpt::CheckRecordedFingerprints of the tag and of the base).
  const std::optional<ckpt::TensorFingerprints>& recorded_fingerprints() const override { return none_; }
  std::optional<ckpt::Value> TagFile(const std::string& name) const override { return adapters_.TagFile(name); }
  uint64_t ReadMemory() const override { return adapters_.ReadMemory() + base_->ReadMemory(); }

 private:
  bool Adapter(const std::string& name) const;
  const ckpt::LogicalState& adapters_;
  std::unique_ptr<ckpt::RenamedState> base_;  // the base under the joined model's base names
  ckpt::TagDescription layout_;
  std::vector<ckpt::ParamRule> params_;
  std::optional<ckpt::TensorFingerprints> none_;
};

}  // namespace tools

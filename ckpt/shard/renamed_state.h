// A LogicalState read under another layout's logical names.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/spec/model_family.h"

namespace ckpt {

// A source read under the target's logical names, when the two lay out their
// logical tensors differently (HF-style attention fused or separate q/k/v, or
// the other model family): each target tensor is row blocks of the source's
// (LogicalRowsIn); rows none covers (vocabulary padding) read as zero.
class RenamedState final : public LogicalState {
 public:
  RenamedState(const LogicalState& src, const ModelFormat& to);
  const std::string& path() const override { return src_.path(); }
  const TagDescription& layout() const override { return layout_; }
  const std::vector<ParamRule>& params() const override { return params_; }
  bool Has(const std::string& name, StateField f) const override { return src_.Has(First(name), f); }
  DType dtype(const std::string& name, StateField f) const override { return src_.dtype(First(name), f); }
  void Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const override;
  const Value& Step(const std::string& name) const override { return src_.Step(First(name)); }
  const Value& ParamGroups() const override { return src_.ParamGroups(); }
  const std::vector<StateBuffer>& buffers() const override { return src_.buffers(); }
  bool model_dict_ordered() const override { return src_.model_dict_ordered(); }
  int64_t step() const override { return src_.step(); }
  double consumed_samples() const override { return src_.consumed_samples(); }
  bool consumed_samples_known() const override { return src_.consumed_samples_known(); }
  // Recorded under the source's names: the renamed tensors are checked through their parts' reads.
  const std::optional<TensorFingerprints>& recorded_fingerprints() const override { return none_; }
  std::optional<Value> TagFile(const std::string& name) const override { return src_.TagFile(name); }
  bool xser() const override { return src_.xser(); }
  uint64_t ReadMemory() const override { return src_.ReadMemory(); }

 private:
  const std::string& First(const std::string& name) const { return blocks_.at(name).front().from.name; }
  const LogicalState& src_;
  TagDescription layout_;
  std::vector<ParamRule> params_;
  std::map<std::string, std::vector<RowsFrom>> blocks_;
  std::map<std::string, int64_t> width_;
  std::optional<TensorFingerprints> none_;
};

}  // namespace ckpt

#include "tools/lora_base.h"

#include <map>

#include "ckpt/spec/lora.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/util/error.h"

namespace tools {
namespace {

using ckpt::Error;

std::string Shape(const std::vector<int64_t>& s) { return ckpt::ShapeString(s); }

// Every HF tensor an adapter of `joined` targets must have the shape the
// adapters give ([lora_B rows, lora_A columns], HfTensorsFor's shape of the
// tag's sizes) in the base.
void CheckFit(const ckpt::LogicalState& adapters, const ckpt::LogicalState& base, const ckpt::ModelFormat& tag) {
  std::map<std::string, std::vector<int64_t>> have;
  for (const auto& t : ckpt::HfTensorsFor(base.layout().format, ckpt::DType::kFloat32)) have[t.name] = t.shape;
  for (const auto& t : ckpt::HfTensorsFor(tag, ckpt::DType::kFloat32)) {
    if (!ckpt::LoraAdaptersOf(tag, t.blocks.front().name)) continue;
    const auto it = have.find(t.name);
    if (it == have.end())
      throw Error(base.path() + ": the base given with --lora_base has no " + t.name + ", which the LoRA adapters of " + adapters.path() +
                  " target");
    if (it->second != t.shape)
      throw Error(base.path() + ": the base's " + t.name + " is " + Shape(it->second) + ", but the LoRA adapters of " + adapters.path() +
                  " (lora_B rows x lora_A columns) fit " + Shape(t.shape));
  }
}

}  // namespace

LoraWithBase::LoraWithBase(const ckpt::LogicalState& adapters, const ckpt::LogicalState& base) : adapters_(adapters), layout_(adapters.layout()) {
  const ckpt::ModelFormat& tag = adapters.layout().format;
  const ckpt::ModelFormat& fb = base.layout().format;
  if (!tag.lora.on() || tag.lora.saved != ckpt::LoraSaved::kAdapterOnly)
    throw Error(adapters.path() + ": --lora_base merges an adapter-only LoRA tag into a base given apart, and this tag " +
                (!tag.lora.on() ? "has no LoRA adapters" : tag.lora.saved == ckpt::LoraSaved::kMerged ? "has them merged" : "holds its base"));
  if (fb.lora.on())
    throw Error(base.path() + ": the base given with --lora_base holds LoRA itself (" + ckpt::DescribeLora(fb.lora) +
                "); give the model the adapters were trained on");
  ckpt::ModelFormat tag_base = tag;
  tag_base.lora = {};
  CheckFit(adapters, base, tag);
  if (fb.heads != tag.heads || fb.kv_heads != tag.kv_heads)
    throw Error(base.path() + ": the base has " + std::to_string(fb.heads) + " heads (" + std::to_string(fb.kv_heads) + " KV), but " +
                adapters.path() + " was read with " + std::to_string(tag.heads) + " (" + std::to_string(tag.kv_heads) + " KV)");
  // The base's model under the tag's attention layout (ckpt::LayoutFree's fields are the base's).
  ckpt::ModelFormat joined = fb;
  joined.family = tag.family, joined.fuse_qkv = tag.fuse_qkv, joined.qkv_linear = tag.qkv_linear;
  joined.kv_size_multiplier = tag.kv_size_multiplier, joined.hw_backend = tag.hw_backend, joined.make_vocab_size_divisible_by = 1;
  base_ = std::make_unique<ckpt::RenamedState>(base, joined);
  joined.lora = tag.lora;
  joined.lora.saved = ckpt::LoraSaved::kBaseAndAdapter;
  layout_.format = joined;
  layout_.has_optimizer = false;
  params_ = ckpt::LogicalParameters(joined, layout_.grid.tp);
}

bool LoraWithBase::Adapter(const std::string& name) const { return ckpt::IsLoraAdapterName(name); }

bool LoraWithBase::Has(const std::string& name, ckpt::StateField f) const {
  return Adapter(name) ? adapters_.Has(name, f) : base_->Has(ckpt::WithoutBaseLayer(name), f);
}

ckpt::DType LoraWithBase::dtype(const std::string& name, ckpt::StateField f) const {
  return Adapter(name) ? adapters_.dtype(name, f) : base_->dtype(ckpt::WithoutBaseLayer(name), f);
}

void LoraWithBase::Read(const std::string& name, ckpt::StateField f, uint64_t begin, std::span<uint8_t> out, ckpt::Touched* touched) const {
  if (Adapter(name)) return adapters_.Read(name, f, begin, out, touched);
  base_->Read(ckpt::WithoutBaseLayer(name), f, begin, out, touched);
}

}  // namespace tools

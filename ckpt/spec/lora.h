// LoRA as a property of a model family's parameters: what NxD's LoRA modules
// (modules/lora/model.py, tp_layer.py, layer.py, config.py) add to the
// HF-style Llama's table, and the `lora_config` entry NxD saves with them.
//
// A targeted layer keeps its base weight under `<module>.base_layer.<leaf>`
// and gains `<module>.lora_A.weight` ([rank, in]) and `<module>.lora_B.<leaf>`
// ([out, rank]), float32, after its base weights (the module order of
// LoraLayer.__init__ then update_layer). How tensor parallelism cuts them
// follows the base layer (tp_layer.py):
//   - GQA QKV (LoraGQAQKVParallelLinear): lora_A whole on every rank; lora_B a
//     GQAQKVColumnParallelLinear with the base's kv_size_multiplier and
//     fuse_qkv, so its rows are cut as the base's Q, K and V rows are
//     (query placement and KV replication included);
//   - row-parallel (o_proj, down_proj: LoraParallelLinear over
//     RowParallelLinear): lora_A row-parallel, its columns cut as the base's;
//     lora_B whole on every rank;
//   - column-parallel (gate_up_proj): lora_A whole; lora_B column-parallel.
// Rank r adds lora_B's local rows to the base's local rows (forward and
// LoraLayer.merge), so the adapter's rows are cut by the base's spec: that is
// what makes the merged tensor W + scale * B A of the whole model equal the
// ranks' merges. (NxD builds gate_up_proj's lora_B without the base's stride
// 2, so its own runtime initialiser and merge_sharded_lora gather cut it
// contiguously; its values start at zero, so only that gather is affected:
// tests/data/upstream/nxd_lora/README.md.)
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/pt/value.h"
#include "ckpt/spec/partition.h"

namespace ckpt {

// The non-tensor model-file entry NxD writes with save_lora_config_adapter
// (model.py _get_lora_adapter_state_dict), last in every model file.
inline constexpr char kLoraConfigKey[] = "lora_config";

// The lora_config dict (config.py LoraConfig.selected_fields_to_save) as a
// LoraFormat, validated: rank 1..65536 and equal to `r`, alpha a finite
// positive number, 1..16 target names each of the HF-style Llama's linear
// layers shardkit lays out (qkv_proj, o_proj, gate_up_proj, down_proj),
// bias "none" and no modules_to_save (what else they save is not laid out
// here), and save_lora_base / merge_lora naming the save mode. Throws
// ckpt::Error naming `where` and the key.
LoraFormat LoraFormatOfConfig(const Value& config, const std::string& where);

// The manifest's record of a LoraFormat (ModelFormat::ToJson's "lora"), and
// back, validated as LoraFormatOfConfig validates; throws naming `where`.
nlohmann::ordered_json LoraToJson(const LoraFormat& l);
LoraFormat LoraFormatOfJson(const nlohmann::json& j, const std::string& where);

// The adapter's scale: alpha / rank, or alpha / sqrt(rank) with use_rslora
// (layer.py LoraLayer.__init__).
double LoraScale(const LoraFormat& l);

// "base_and_adapter", "adapter_only", "merged" (as manifests record it), and back.
const char* LoraSavedName(LoraSaved s);
std::optional<LoraSaved> ParseLoraSaved(const std::string& s);

// "LoRA rank 16, alpha 32 (scale 2) on qkv_proj; base and adapters".
std::string DescribeLora(const LoraFormat& l);

// Why f's LoRA cannot be laid out ("" when it can): LoRA needs the HF-style
// family, and a qkv_proj target needs qkv_linear (NxD's LoRA of the stride-3
// ColumnParallelLinear qkv_proj would be a plain column-parallel one; not
// laid out here).
std::string LoraProblem(const ModelFormat& f);

// Why a Hugging Face export of f cannot be written ("" when it can): an
// adapter-only tag has no base to merge into (unless one is given apart:
// ckpt-export --lora_base); a tag holding base and adapters exports merged
// (LoraMergeOf), the merged mode as it is.
std::string LoraHfUnsupported(const ModelFormat& f);

// The logical tensors whose merge W + scale * B A (LoraLayer.merge,
// layer.py get_delta_weight: (lora_B @ lora_A) * scaling) is the HF weight
// of a targeted module's base tensor: base `<module>.base_layer.<leaf>`,
// a `<module>.lora_A.weight` ([rank, in]), b `<module>.lora_B.<leaf>`
// ([out, rank], rows cut as the base's, so logical row i of b pairs with
// logical row i of base).
struct LoraMergeSource {
  std::string base, a, b;
};
// For the base name `name` as the family's table names it (no base_layer):
// its merge sources when f holds base and adapters and name's module is a
// target; nullopt otherwise (the tensor is read as it is).
std::optional<LoraMergeSource> LoraMergeOf(const ModelFormat& f, const std::string& name);
// The same sources whenever f holds adapters (base and adapters, or
// adapters only, whose `base` names a tensor the tag lacks: a peft export
// or a merge into a base given apart reads it, LoraMergeOf does not).
std::optional<LoraMergeSource> LoraAdaptersOf(const ModelFormat& f, const std::string& name);

// lora_config's lora_dropout (LoraConfig; what peft's adapter_config.json
// calls the same), validated: a number in [0, 1); 0 when the entry has none.
// Throws ckpt::Error naming `where`.
double LoraDropoutOfConfig(const Value& config, const std::string& where);

// The family's table `base` (LogicalParameters without LoRA) as the tag
// holds it under f.lora: targets renamed and their adapters after them
// (kBaseAndAdapter), the adapters alone (kAdapterOnly), or `base` itself
// (kMerged, and without LoRA).
std::vector<ParamRule> WithLora(const ModelFormat& f, std::vector<ParamRule> base);

// The name a base weight has in an HF model (drops ".base_layer"), and
// whether a name is an adapter's (holds ".lora_A." or ".lora_B.").
std::string WithoutBaseLayer(const std::string& name);
bool IsLoraAdapterName(const std::string& name);

}  // namespace ckpt

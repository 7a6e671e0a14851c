// An NNM checkpoint read as logical tensors: its rank files found
// (nnm_source.h) and loaded (pickles parsed, tensor bytes mapped), mapped to
// NxDT's names by the conversion plan (nnm_convert.h), and viewed as the NxDT
// tag they make at NNM's degrees (ckpt::ShardedTag::FromFiles). nnm2nxdt-ckpt
// converts through these functions, and the source registry's "nnm" entry
// reads an NNM checkpoint through them, so both see the same state.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ckpt/shard/sharded_tag.h"
#include "ckpt/shard/source_registry.h"
#include "convert/nnm_convert.h"
#include "convert/nnm_source.h"

namespace convert {

// Loads every rank file of `src` (and its ZeRO-1 files), in parallel, as
// plain data confined to src.folder. Throws ckpt::Error naming the file.
std::vector<RankInput> LoadNnmInputs(ckpt::Env* env, const NnmSource& src);

// The planned file whose tensors are generated as they are written (NNM's
// unmerged SwiGLU, merged then: ConcatRows), which no reader can index;
// null when there is none.
const PlannedFile* GeneratedFile(const ConvertPlan& plan);

// The planned files (plain .pt, not xser parts) read as the NxDT tag they
// make, at NNM's degrees: what the reshard engine reads, and what tells the
// model format. Throws ckpt::Error when they do not make one
// (ckpt::FormatUnknown when the model format needs hints).
std::unique_ptr<ckpt::ShardedTag> PlannedTag(const NnmSource& src, const ConvertPlan& plan, const ckpt::FormatHints& hints,
                                             const ckpt::TagReadOptions& opts);

// Whether `path` is an NNM checkpoint: a folder holding NNM's rank folders
// (tp_rank_XX_pp_rank_XXX, mp_rank_XX), a folder that is not a tag holding a
// .ckpt file, or a .ckpt file. Reads folder listings only.
bool LooksLikeNnmCheckpoint(ckpt::Env* env, const std::string& path);

// The registry entry "nnm": detects with LooksLikeNnmCheckpoint; opens as
// nnm2nxdt-ckpt reads (SourceOptions' checkpoint_name, hints, weights_only,
// trust_first_replica; log announces the file chosen). The tag name is the
// checkpoint file's; bytes are the tensor bytes of the mapped files.
ckpt::SourceKind NnmSourceKind();

}  // namespace convert

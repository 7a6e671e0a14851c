// Every reader the programs know, in the one source registry
// (ckpt/shard/source_registry.h): the tag entry ckpt/ registers, and the
// entries of the readers above ckpt/, which ckpt/ must not depend on: NNM
// checkpoints (convert/nnm_state.h), Hugging Face folders
// (tools/hf_state.h) and ckpt-export HDF5 files (tools/h5_state.h).
//
// A new format is one file with its reader and its SourceKind, and one line
// here.
#pragma once

#include "ckpt/shard/source_registry.h"

namespace tools {

// ckpt::SourceRegistry::Default() with every entry added (once, on the
// first call; thread-safe). Detection is tried in the order added: tag,
// nnm, hf, h5.
const ckpt::SourceRegistry& AllSources();

}  // namespace tools

// The shared command line of ckpt-reshard and ckpt-import (tools/layout_cli.cc).
#pragma once

#include "ckpt/util/env.h"
#include "ckpt/shard/reshard.h"
#include "ckpt/shard/source_registry.h"

namespace tools {

enum class LayoutSource { kTag, kExport };
int LayoutMain(int argc, char** argv, LayoutSource source);

// ckpt-import: opens a ckpt-export file (or with `hf` a Hugging Face folder,
// read with `o`: its vocab padding, family and config) through the source
// registry (tools/all_sources.h) and writes it as ckpt::WriteInLayout does.
ckpt::ReshardSummary RunImport(const ckpt::ReshardArgs& a, bool hf, const ckpt::SourceOptions& o, ckpt::Env* env, const ckpt::LogFn& log);

}  // namespace tools

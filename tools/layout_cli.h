// The shared command line of ckpt-reshard and ckpt-import (tools/layout_cli.cc).
#pragma once

#include "ckpt/util/env.h"
#include "ckpt/shard/reshard.h"

namespace tools {

enum class LayoutSource { kTag, kExport };
int LayoutMain(int argc, char** argv, LayoutSource source);

// ckpt-import: opens a ckpt-export file (or with `hf` a Hugging Face folder,
// its vocab padded to a multiple of `divisible` times tp) and writes it as
// ckpt::WriteInLayout does.
ckpt::ReshardSummary RunImport(const ckpt::ReshardArgs& a, bool hf, int64_t divisible, ckpt::Env* env, const ckpt::LogFn& log);

}  // namespace tools

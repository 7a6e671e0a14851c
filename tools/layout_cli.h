// The shared command line of ckpt-reshard and ckpt-import (tools/layout_cli.cc).
#pragma once

#include "ckpt/env.h"
#include "tools/reshard.h"

namespace tools {

enum class LayoutSource { kTag, kExport };
int LayoutMain(int argc, char** argv, LayoutSource source);

// ckpt-import: opens a ckpt-export file (or with `hf` a Hugging Face folder,
// its vocab padded to a multiple of `divisible` times tp) and writes it as
// WriteInLayout does.
ReshardSummary RunImport(const ReshardArgs& a, bool hf, int64_t divisible, ckpt::Env* env, const LogFn& log);

}  // namespace tools

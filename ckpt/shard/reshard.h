// ckpt-reshard: re-lays a checkpoint tag for other tensor, pipeline and data
// parallel degrees, weights and optimizer state alike, streaming.
//
// The source is read through ShardedTag (ckpt/shard/sharded_tag.h), which indexes
// every logical tensor's boxes in the mapped rank files. Every target tensor
// is a generated storage (Storage::Generated): when the writer asks for a
// chunk of its bytes, the target rank's boxes (ckpt/spec/shard_spec.h BoxesOf) name the
// logical elements, which are copied from the source's mapped pages, and
// those pages are then released. So memory holds a few chunks per writing
// thread, never a tensor or a file, and each byte is read once and written
// once; every piece copied is also summed into the logical tensors'
// fingerprints (ckpt/shard/fingerprint.h), by the first target rank holding it. The
// tag is written in a staging folder, committed (manifest with the target
// degrees, model format and fingerprints, then `done`) and only then published
// under its name (ckpt/store/tag_writer.h), so no interruption leaves a target
// that looks complete and the source is only ever read.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/store/resume.h"
#include "ckpt/shard/sharded_tag.h"
#include "ckpt/shard/source_check.h"
#include "ckpt/util/writer_group.h"

namespace ckpt {

struct ReshardArgs {
  std::string src;             // a tag, or a checkpoint folder (its newest complete tag)
  std::string dst;             // the new tag; or
  std::string checkpoint_dir;  // a folder to create the tag in, named as the trainer names tags
  int tp = 0, pp = 0;
  std::optional<int> dp;       // default: the source's
  // Expert parallelism of an MoE model (RankGrid::ep); default: the source's.
  // Weights only at ep > 1 (NxD's expert-parallel ZeRO-1 state is not written).
  std::optional<int> ep;
  std::optional<bool> zero1;   // default: the source's
  std::vector<int64_t> pipeline_cuts;  // the first layer of stages 1.. of all pp * virtual stages
  // NxD's virtual_pipeline_size for the target (ckpt/spec/partition.h: pp rank
  // p holds stages p, p + pp, ...). Default 1; with keep_virtual_stages, the
  // source's when the target keeps its pp and no cuts are given (ckpt-reshard's
  // default: the layout kept).
  std::optional<int> virtual_pipeline_size;
  bool keep_virtual_stages = false;
  uint64_t memory_budget = uint64_t{512} << 20;
  int threads = 1;
  bool dry_run = false, overwrite = false, verify_source = true;
  // Read the source's model only (TagReadOptions::weights_only); the target has no optimizer.
  bool weights_only = false;
  // Write rank files as xser (NxD's use_xser) or plain .pt; default: the source's container.
  std::optional<bool> save_xser;
  ckpt::FormatHints hints;
  // The HF-style family's target attention layout (ckpt/spec/model_family.h);
  // default: the source's. A kv_size_multiplier the target tp cannot take is
  // refused with the one it can.
  std::optional<int64_t> out_kv_size_multiplier;
  std::optional<ckpt::HwBackend> out_hw_backend;
  std::optional<bool> out_fuse_qkv, out_qkv_linear;
  // The target's model family (weights only: the families group optimizer state differently).
  std::optional<ckpt::ModelFamily> out_model_family;
  bool trust_first_replica = false;  // TagReadOptions::trust_first_replica
  ckpt::WriterGroup* group = &ckpt::SoloGroup();  // under mpirun the ranks split the output files
  bool progress_bar = false;
  std::string tool = "reshard";  // names the staging folder (.<dst>.<tool>-partial)
  // The source's checksum pass (ckpt/shard/source_check.h), run beside the
  // copy: its memory is set aside from the budget, it starts once the budget
  // is shared out, and the output is committed (a dry run ends) only once it passed.
  SourceCheck* source_check = nullptr;
};

struct ReshardSummary {
  std::string src_tag, dst_tag;
  ckpt::RankGrid from, to;
  std::vector<int64_t> from_bounds, to_bounds;  // over all pp * virtual stages
  int from_virtual_stages = 1, to_virtual_stages = 1;
  ckpt::ModelFormat format;
  int files = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
  uint64_t stream_chunk = 0;
  int64_t vocab_rows_from = 0, vocab_rows_to = 0;
  double seconds = 0;
  uint64_t peak_rss = 0;
  std::vector<std::string> notes;
};

// Throws ckpt::Error naming the file, key or degree for bad input.
ReshardSummary RunReshard(const ReshardArgs& a, ckpt::Env* env, const LogFn& log);

// What RunReshard does once its source is open, for any source (ckpt-import's
// HDF5 state too): writes `src` as the tag a.dst (or in a.checkpoint_dir,
// named after `source_tag_name`'s step) at a's degrees. `sum` arrives with
// src_tag and bytes_read set. The output is checked against sum.src_tag.
ReshardSummary WriteInLayout(const ckpt::LogicalState& src, const std::string& source_tag_name, const ReshardArgs& a, ckpt::Env* env,
                             const LogFn& log, std::chrono::steady_clock::time_point t0, ReshardSummary sum);

// The tag SRC names: itself (it must have `done`), or a checkpoint folder's
// newest complete tag (announced through `log`; with `verify`, the newest whose
// checksums verify, and then `checked` is true). A folder holding model/ alone
// (NxD's checkpoint_converter.py output) is read as a weights-only tag. Throws
// ckpt::Error naming the problem. A tag named directly is not checked here:
// SourceCheck (ckpt/shard/source_check.h) checks it beside the copy.
struct SourceTag {
  std::string tag;
  bool checked = false;
};
SourceTag FindSourceTag(const std::string& src, bool verify, ckpt::Env* env, const LogFn& log);

// Peak resident memory of this process so far, in bytes.
uint64_t PeakRss();
// Resident memory of this process now, in bytes.
uint64_t CurrentRss();

}  // namespace ckpt

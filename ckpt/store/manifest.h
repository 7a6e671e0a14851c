// manifest.json: what a committed tag holds. For every file (path relative to
// the tag) its size and CRC-32, plus the step, consumed samples,
// rank grid and world size, and the parallel layout beyond the grid (the stage
// map, master weights, container) so that resume decides from the manifest alone. NxD ignores the file; shardkit uses it to verify
// a tag and to pick a resume point without trusting modification times.
// CRC-32 because the writer already has it: the zip format needs every
// record's CRC, and the whole-file CRC follows from those by combination
// (crc32_combine), so the manifest costs no second pass over the data.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/spec/partition.h"

namespace ckpt {

struct FileDigest {
  uint64_t size = 0;
  uint32_t crc32 = 0;
  bool operator==(const FileDigest&) const = default;
};

// One logical tensor's fingerprint: its element type, element count and the
// CRC-32 of its bytes in row-major order. "Logical" is the unsharded tensor
// with vocab rows up to the real vocabulary and no ZeRO-1 padding, so the
// fingerprint is the same in every layout (ckpt/shard/fingerprint.h computes it).
struct TensorFingerprint {
  std::string dtype;  // DTypeName
  uint64_t numel = 0;
  uint32_t crc32 = 0;
  bool operator==(const TensorFingerprint&) const = default;
};
// By logical parameter name, then field ("param", "exp_avg", "exp_avg_sq", "master").
using TensorFingerprints = std::map<std::string, std::map<std::string, TensorFingerprint>>;

nlohmann::ordered_json FingerprintsToJson(const TensorFingerprints& t);
// Throws ckpt::Error naming `where`, the tensor and the field when malformed.
TensorFingerprints FingerprintsFromJson(const nlohmann::json& j, const std::string& where);

// One pp rank's layers: half-open [first, end) ranges of global layer
// indices, in the order the rank runs them. One range per rank today; with
// virtual pipeline stages (NxD's virtual_pipeline_size, NNM's chunks) pp rank p
// holds several (stages p, p+pp, ...).
using LayerRange = std::pair<int64_t, int64_t>;
using StageMap = std::vector<std::vector<LayerRange>>;  // by pp rank

// The container of a tag's rank files: plain torch .pt, or NxD's xser (X.pt
// of references plus X.pt.tensors/). One per tag, as NxD decides it
// (checkpoint_storage.py is_checkpoint_xser).
enum class Container { kPlainPt, kXser };
const char* ContainerName(Container c);  // "pt", "xser"
// The container the files of a tag are in: xser when any is an xser tensor file.
Container ContainerOfFiles(const std::map<std::string, FileDigest>& files);

// The parallel layout a tag was written in, beyond Manifest::grid (which holds
// tp, pp, dp and ZeRO-1).
struct RecordedLayout {
  StageMap stages;
  bool master_weights = false;  // the optimizer files hold fp32 master weights (ZeRO-1 sharded_master_weights)
  Container container = Container::kPlainPt;
  bool operator==(const RecordedLayout&) const = default;
};

// A pipeline split as bounds over all its stages: StageBounds over pp *
// virtual_stages stages, stage s on pp rank s % pp (ckpt/spec/partition.h,
// NxD's virtual_pipeline_size).
struct StageSplit {
  std::vector<int64_t> bounds;
  int virtual_stages = 1;
  bool operator==(const StageSplit&) const = default;
};
// The stage map of `bounds` with `virtual_stages` per pp rank (RankLayerRanges).
StageMap StageMapOf(const std::vector<int64_t>& bounds, int virtual_stages = 1);
// The split of `stages`: every pp rank holds the same number V of ranges and,
// taken in stage order (rank 0's first, rank 1's first, ..., rank 0's second,
// ...), they are consecutive from layer 0. nullopt when they are not (a map
// no pipeline NxD or Megatron lays out).
std::optional<StageSplit> StageSplitOf(const StageMap& stages);
// The StageBounds of `stages` when it is a split with one range per pp rank;
// nullopt otherwise, virtual stages included (what the trainer can take as it is).
std::optional<std::vector<int64_t>> StageBoundsOf(const StageMap& stages);

struct Manifest {
  int64_t step = 0;
  double consumed_samples = 0;
  RankGrid grid;
  int world_size = 1;
  // The model format, when the writer knew it (the trainer, converter and
  // reshard do): lets ckpt-reshard work without the training config.
  std::optional<ModelFormat> model;
  // How the optimizer files group parameters, when the writer wrote them.
  std::optional<GroupingRule> optimizer_grouping;
  std::map<std::string, FileDigest> files;
  // Every logical tensor's fingerprint, when the writer computed them as it
  // wrote (ckpt-reshard does): ckpt-verify --against compares them.
  std::optional<TensorFingerprints> tensors;
  // The layout beyond the grid, when the writer recorded it (every shardkit
  // writer does since #36 step 3; readers of older manifests derive it from
  // the rank files, as before).
  std::optional<RecordedLayout> layout;

  nlohmann::ordered_json ToJson() const;
  // Throws ckpt::Error naming `source` and the bad field.
  static Manifest FromJson(const nlohmann::json& j, const std::string& source);
  static Manifest Load(Env* env, const std::string& path);
  void Save(Env* env, const std::string& path) const;  // atomic
};

// One file's {"size", "crc32"} entry (a manifest's or a rank record's);
// throws ckpt::Error naming `where` when malformed.
FileDigest DigestFromJson(const nlohmann::json& entry, const std::string& where);

std::string CrcHex(uint32_t crc);
// Size and CRC-32 of a file as it is on disk (read a 4 MiB window at a time,
// Env::ReadInPieces, so memory stays small whatever the file's size).
FileDigest DigestFile(Env* env, const std::string& path);

}  // namespace ckpt

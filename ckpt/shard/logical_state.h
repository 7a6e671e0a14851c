// A checkpoint's state as logical tensors, whatever holds it: a sharded
// tag (ShardedTag, ckpt/shard/sharded_tag.h) or a layout-free export
// (tools/h5_state.h). What writes a checkpoint in some layout (ckpt-reshard,
// ckpt-import), exports it or compares it reads through this interface, so
// one planner serves every source.
//
// "Logical" is the unsharded tensor in row-major order; vocab rows past the
// real vocabulary are padding, which params() reports as the source pads
// them; elements past what the source holds read as zero.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/pt/dtype.h"
#include "ckpt/util/env.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/manifest.h"
#include "ckpt/spec/optimizer_groups.h"
#include "ckpt/spec/partition.h"
#include "ckpt/pt/value.h"

namespace ckpt {

enum class StateField { kParam, kExpAvg, kExpAvgSq, kMaster };
const char* FieldName(StateField f);  // "param", "exp_avg", "exp_avg_sq", "master" (as manifests key fingerprints)

struct FormatHints {
  std::optional<int64_t> heads, kv_heads, vocab_size, make_vocab_size_divisible_by;
  // What the forward pass needs beyond the tensors (ModelFormat::rope_theta, ...).
  std::optional<double> rope_theta, norm_eps, rotary_percentage;
  // The HF-style family's (ckpt/spec/model_family.h): what the data may not tell,
  // and sizes an HF config.json states, checked against the tensors.
  std::optional<int64_t> kv_size_multiplier;
  std::optional<HwBackend> hw_backend;
  std::optional<int64_t> hidden, ffn, layers, max_positions;
  std::optional<bool> fuse_qkv, qkv_linear;  // NxDT's model.fuse_qkv and model.qkv_linear (a job config)
  // Mixtral (MoE, issue #38): NxDT's model.moe.num_experts, top_k and frequency
  // (HF config.json: num_local_experts, num_experts_per_tok).
  std::optional<int64_t> experts, moe_top_k, moe_frequency;

  // Whether any hint is given.
  bool Any() const {
    return heads || kv_heads || vocab_size || make_vocab_size_divisible_by || rope_theta || norm_eps || rotary_percentage ||
           kv_size_multiplier || hw_backend || hidden || ffn || layers || max_positions || fuse_qkv || qkv_linear || experts ||
           moe_top_k || moe_frequency;
  }
};

// What a tag holds as a whole: its parallel layout (grid and stages), the
// model format, and how its optimizer files group and name parameters.
struct TagDescription {
  RankGrid grid;
  std::vector<int64_t> stage_bounds;  // StageBounds of the tag's stage split, over all pp * virtual_stages stages
  int virtual_stages = 1;             // stages per pp rank: NxD's virtual_pipeline_size (ckpt/spec/partition.h)
  ModelFormat format;
  bool format_from_manifest = false;
  bool has_optimizer = false;
  GroupingRule grouping = GroupingRule::kNxdt;  // how the optimizer files group parameters (ckpt::FamilyGrouping)
  TiedCopyNaming tied_naming = TiedCopyNaming::kNxdt;  // how GPT's tied output copy is named (ckpt/spec/partition.h)
  bool master_weights = false;  // ZeRO-1 sharded_master_weights
};

// Pages of mapped files a copy touched, released once the copy is done, or
// as soon as the spans touched cover more than `limit` bytes: a chunk of a
// column-split target reads a row piece from every source row, so its span in
// a source file is the source's width over the chunk's times the chunk, which
// the memory budget (ckpt/shard/reshard.h) does not hold otherwise.
class Touched {
 public:
  explicit Touched(uint64_t limit = UINT64_MAX) : limit_(limit) {}
  // Records that [p, p + n) of `f` was read (copied out already: releasing it is always safe).
  void Add(const MappedFile* f, const uint8_t* p, size_t n);
  void Release();  // MappedFile::DropPages of every span touched
  // Bytes the spans cover now (what a read may keep resident until Release).
  uint64_t bytes() const {
    uint64_t n = 0;
    for (const Span& s : spans_) n += static_cast<uint64_t>(s.hi - s.lo);
    return n;
  }
  // The bytes of source a read may keep until the chunk is done: the chunk's share of the budget
  // (ckpt/shard/stream_budget.h), which a reader that copies with pread may spend on a buffer instead.
  uint64_t limit() const { return limit_; }
  ~Touched() { Release(); }

 private:
  struct Span {
    const MappedFile* file;
    const uint8_t *lo, *hi;
  };
  std::vector<Span> spans_;
  uint64_t limit_;
};

// A model-file entry that is not a parameter (rotary inv_freq buffers):
// whole on every rank, carried with its layer.
struct StateBuffer {
  std::string name, after;  // `after`: the key it followed ("" at the front)
  int layer;
  Value value;
};

class LogicalState {
 public:
  virtual ~LogicalState() = default;

  virtual const std::string& path() const = 0;
  virtual const TagDescription& layout() const = 0;
  // The logical parameters, vocab padded as the source pads it.
  virtual const std::vector<ParamRule>& params() const = 0;
  virtual bool Has(const std::string& name, StateField f) const = 0;
  virtual DType dtype(const std::string& name, StateField f) const = 0;
  // Copies logical elements [begin, begin + out.size() / element size) of
  // `name`'s `f` into `out`; what the source does not hold reads as zero.
  // Mapped pages it copied from are added to `touched` (may be null).
  // Thread-safe. Throws ckpt::Error when the source cannot be read.
  virtual void Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const = 0;
  // The optimizer `step` entry of a logical parameter, as torch keeps it.
  virtual const Value& Step(const std::string& name) const = 0;
  // The optimizer's `param_groups` (hyperparameters; ids as the source numbered them).
  virtual const Value& ParamGroups() const = 0;
  virtual const std::vector<StateBuffer>& buffers() const = 0;
  // Whether model files are OrderedDicts (torch state_dict) or plain dicts.
  virtual bool model_dict_ordered() const = 0;
  virtual int64_t step() const = 0;
  virtual double consumed_samples() const = 0;
  // False when the source records no consumed samples (NxD's own trainer's tags): then 0.
  virtual bool consumed_samples_known() const { return true; }
  // Fingerprints the source records (ckpt/shard/fingerprint.h), if any.
  virtual const std::optional<TensorFingerprints>& recorded_fingerprints() const = 0;
  // A tag-level file the source carries (scheduler.pt, user_content.pt), if any.
  virtual std::optional<Value> TagFile(const std::string& name) const = 0;
  // Whether the source's rank files are xser (a writer's default container).
  virtual bool xser() const { return false; }
  // Memory reading may hold beyond what Read copies (caches), for budgets.
  virtual uint64_t ReadMemory() const { return 0; }
};

}  // namespace ckpt

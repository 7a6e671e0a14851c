// A checkpoint's whole state in one layout-free HDF5 file (ckpt-export,
// ckpt-import), readable with h5py or HDFView without torch or Neuron:
//
//   /model/<NxDT name>                 the logical tensor: unsharded, vocab rows
//                                      up to the real vocabulary; chunked so a
//                                      reader can slice it
//   /optim/<NxDT name>/exp_avg, exp_avg_sq, master
//   /vocab_padding/model/<name>, /vocab_padding/optim/<name>/<field>
//                                      the source's padding rows past the real
//                                      vocabulary, when it had any: NxD
//                                      initializes them, so an import restores
//                                      them and equals ckpt-reshard's output
//
// Every tensor dataset carries `dtype` (torch's name; HDF5 has no bfloat16,
// so bfloat16 and float16 are kept as their 16-bit patterns in uint16
// datasets, unless exported as float32, which keeps `source_dtype`), and the
// layout-free fingerprint of its logical bytes in the source dtype (`crc32`,
// `numel`, as ckpt/shard/fingerprint.h defines it). Each /optim/<name> group
// carries the parameter's optimizer `step` and its `group` index.
//
// Root attributes: `format` ("shardkit-full-state"), `version`, `model` (the
// ModelFormat JSON the partition rules need), `source_layout` (JSON: grid,
// stage bounds, optimizer form), `source`, `tag_name`, `step`,
// `consumed_samples`, `model_dict_ordered`, `buffers` (rotary inv_freq and
// the like), `param_groups` (a pickle, uint8: it keeps which objects the
// groups share), `scheduler.pt` and `user_content.pt`. The other pickled
// values are stored in the exact JSON form of ckpt/pt/value_json.h; so an
// import writes all of them back byte for byte. For readers,
// `param_groups_readable` lists each group's hyperparameters and members.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/shard/source_registry.h"

namespace tools {

inline constexpr const char* kH5Format = "shardkit-full-state";
inline constexpr int64_t kH5Version = 1;

struct ExportOptions {
  bool weights_only = false;
  bool float32 = false;  // store bfloat16/float16 tensors as float32
  bool gzip = false;
  size_t block = size_t{16} << 20;  // bytes read and written at a time
  // Called after each block: bytes of tensors done, of all, and the tensor.
  std::function<void(uint64_t, uint64_t, const std::string&)> progress;
};

struct ExportSummary {
  uint64_t tensors = 0, bytes = 0;  // logical tensors and their bytes, as the source holds them
};

// Writes `src` as a new HDF5 file at `path` (which the caller then
// publishes). Streams: memory holds one block. Throws ckpt::Error naming the
// tensor, also when the source's data do not match its recorded fingerprints.
ExportSummary WriteH5State(const ckpt::LogicalState& src, const std::string& tag_name, const std::string& path,
                           const ExportOptions& options);

// Whether `path` is a file this format wrote (so --overwrite may replace it).
bool IsH5State(const std::string& path);

// Whether `path` is an HDF5 file: a regular file that starts with HDF5's
// signature. Reads its first 8 bytes.
bool StartsAsHdf5(ckpt::Env* env, const std::string& path);

// The registry entry "h5": detects with StartsAsHdf5 (an HDF5 file that is
// not an export is claimed, and H5State::Open says what it lacks); opens
// with H5State::Open. Bytes are the file's; the tag name the one recorded.
ckpt::SourceKind H5SourceKind();

// An export read back as a LogicalState, for ckpt-import.
class H5State final : public ckpt::LogicalState {
 public:
  // Throws ckpt::Error naming the file, the dataset or attribute and what is
  // wrong: not HDF5, not this format, a tensor missing or of the wrong shape
  // or type for the model format.
  static std::unique_ptr<H5State> Open(const std::string& path);
  ~H5State() override;

  const std::string& path() const override { return path_; }
  const ckpt::TagDescription& layout() const override { return layout_; }
  const std::vector<ckpt::ParamRule>& params() const override { return params_; }
  bool Has(const std::string& name, ckpt::StateField f) const override { return tensors_.count({name, f}) > 0; }
  ckpt::DType dtype(const std::string& name, ckpt::StateField f) const override;
  void Read(const std::string& name, ckpt::StateField f, uint64_t begin, std::span<uint8_t> out, ckpt::Touched* touched) const override;
  const ckpt::Value& Step(const std::string& name) const override;
  const ckpt::Value& ParamGroups() const override { return param_groups_; }
  const std::vector<ckpt::StateBuffer>& buffers() const override { return buffers_; }
  bool model_dict_ordered() const override { return ordered_; }
  int64_t step() const override { return step_; }
  double consumed_samples() const override { return consumed_; }
  const std::optional<ckpt::TensorFingerprints>& recorded_fingerprints() const override { return fingerprints_; }
  std::optional<ckpt::Value> TagFile(const std::string& name) const override;
  // The chunk caches, and what HDF5 allocates besides them (free lists, type conversion).
  uint64_t ReadMemory() const override { return kOpenDatasets * kChunkCache + (uint64_t{8} << 20); }
  const std::string& tag_name() const { return tag_name_; }

 private:
  struct Tensor {
    std::string dataset, padding;        // paths; padding: the source's vocab padding rows, or ""
    ckpt::DType dtype, stored;           // the source's, and the dataset's
    int64_t rows = 0, width = 1;         // of the logical tensor (vocab rows up to the real vocabulary)
    int64_t padding_rows = 0;
  };
  struct Key {
    std::string name;
    ckpt::StateField field;
    bool operator<(const Key& o) const { return name != o.name ? name < o.name : field < o.field; }
  };
  H5State() = default;
  void ReadRows(const Tensor& t, const std::string& dataset, uint64_t begin, uint64_t n, uint8_t* out) const;
  // An open dataset. A few stay open, each with a small chunk cache (rows
  // are read a piece at a time, so a chunk is read once, not per piece);
  // the least recently used is closed, so memory does not grow with the
  // model. Called under the HDF5 lock.
  int64_t Dataset(const std::string& path) const;
  static constexpr size_t kOpenDatasets = 8, kChunkCache = size_t{4} << 20;

  std::string path_, tag_name_;
  int64_t file_ = -1;
  ckpt::TagDescription layout_;
  std::vector<ckpt::ParamRule> params_;
  std::map<Key, Tensor> tensors_;
  std::map<std::string, ckpt::Value> steps_;
  ckpt::Value param_groups_;
  std::vector<ckpt::StateBuffer> buffers_;
  std::map<std::string, ckpt::Value> tag_files_;
  std::optional<ckpt::TensorFingerprints> fingerprints_;
  bool ordered_ = true;
  mutable std::vector<std::pair<std::string, int64_t>> open_;  // most recent last
  int64_t step_ = 0;
  double consumed_ = 0;
};

}  // namespace tools

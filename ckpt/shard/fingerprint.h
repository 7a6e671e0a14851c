// Layout-free fingerprints of a checkpoint's logical tensors (the
// TensorFingerprint of ckpt/store/manifest.h: CRC-32 of the logical tensor's bytes
// in row-major order), so two tags in different layouts can be shown to hold
// the same state from their manifests alone.
//
// A writer computes them from the slices it writes, never assembling a
// tensor: every piece it writes (a byte range of a logical tensor) is summed
// as it passes, and pieces are joined in logical order by the CRC
// combination (crc(A·B) from crc(A), crc(B) and |B|). Pieces from many
// threads and ranks meet in a FingerprintCollector; its Finish checks that
// each tensor's pieces cover it exactly once. ComputeFingerprints gets the
// same values by reading a tag, which is how a recorded fingerprint is
// checked and how a tag without them is compared.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "ckpt/store/manifest.h"
#include "ckpt/shard/logical_state.h"

namespace ckpt {

// One field of one logical parameter, as a tag holds it.
struct LogicalTensor {
  std::string name;
  StateField field;
  DType dtype;
  uint64_t numel;  // vocab rows up to the real vocabulary
};
// Every logical tensor `tag` holds, in parameter order, fields in StateField order.
std::vector<LogicalTensor> LogicalTensors(const LogicalState& tag);

class FingerprintCollector {
 public:
  // Bytes [byte_begin, byte_begin + bytes.size()) of `name`'s `field` in
  // logical order. Thread-safe. Adjacent pieces are joined as they come.
  void Add(const std::string& name, StateField field, uint64_t byte_begin, std::span<const uint8_t> bytes);
  // {"name": {"field": [[begin, end, "crc32"], ...]}}, for a rank record.
  nlohmann::json ToJson() const;
  // Adds the pieces ToJson wrote (another rank's). Throws ckpt::Error naming
  // `where` when malformed.
  void MergeJson(const nlohmann::json& j, const std::string& where);

  // The fingerprints of `tensors`. Throws ckpt::Error naming the tensor when
  // its pieces leave a gap, overlap, run past its end, or it has none, and
  // when a piece belongs to no tensor of the list.
  TensorFingerprints Finish(const std::vector<LogicalTensor>& tensors) const;

 private:
  struct Piece {
    uint64_t end;
    uint32_t crc;
  };
  using Pieces = std::map<uint64_t, Piece>;  // by begin
  void AddPiece(Pieces& pieces, const std::string& key, uint64_t begin, uint64_t end, uint32_t crc);

  mutable std::mutex mu_;
  std::map<std::string, Pieces> pieces_;  // by "name\tfield"
  std::string error_;                     // the first overlap seen
};

// Reads every logical tensor of `tag` (chunk by chunk, pages released) and
// returns its fingerprints.
TensorFingerprints ComputeFingerprints(const LogicalState& tag, size_t chunk = 4 << 20, std::optional<StateField> only = std::nullopt);

// A field whose recorded fingerprint is not the one computed from its data.
struct FingerprintMismatch {
  std::string tensor, field;
  TensorFingerprint recorded, computed;
};
// The fields both hold whose fingerprints differ (dtype, count or CRC-32), in name order.
std::vector<FingerprintMismatch> RecordedMismatches(const TensorFingerprints& recorded, const TensorFingerprints& computed);

// Throws ckpt::Error naming the tensor when `tag` records fingerprints and its
// data (the parameters, or every field) no longer match them.
void CheckRecordedFingerprints(const LogicalState& tag, size_t chunk, std::optional<StateField> only = std::nullopt);
// The same check of fingerprints computed elsewhere (from the pass that
// exported the tag): throws when a field both hold differs.
void CheckRecordedFingerprints(const LogicalState& tag, const TensorFingerprints& computed);

}  // namespace ckpt

// Whether two checkpoint tags hold the same model and optimizer state,
// whatever their layouts. Every logical tensor (unsharded, vocab rows up to
// the real vocabulary, ZeRO-1 padding trimmed) of each field is compared by
// its fingerprint (ckpt/fingerprint.h): the one a tag's manifest records, or
// else one computed by streaming the tag. A tensor whose fingerprints differ
// is then streamed from both tags to name its first differing element.
// Per-parameter optimizer steps and the groups' hyperparameters are compared
// too. GPT's tied output copy is the embedding.
//
// A recorded fingerprint is only as good as the files it describes: check
// the tag against its manifest's file checksums first (ckpt-verify does).
#pragma once

#include <string>
#include <vector>

#include "ckpt/logical_state.h"

namespace ckpt {

struct TagDifference {
  std::string name;  // a logical parameter ("" for the tag as a whole)
  std::string what;  // "exp_avg differs first at element 1234 of 4096", ...
};

struct CompareReport {
  uint64_t tensors = 0, bytes = 0;       // logical tensors and their bytes compared
  bool recorded_a = false, recorded_b = false;  // fingerprints from the manifest, not computed
  std::vector<TagDifference> differences;
};

CompareReport CompareTags(const LogicalState& a, const LogicalState& b, size_t chunk = 4 << 20);

}  // namespace ckpt

// Whether two checkpoint tags hold the same model and optimizer state,
// whatever their layouts. Every logical tensor (unsharded, vocab rows up to
// the real vocabulary, ZeRO-1 padding trimmed) of each field is compared by
// its fingerprint (ckpt/shard/fingerprint.h): the one a tag's manifest records, or
// else one computed by streaming the tag. A tensor whose fingerprints differ
// is then streamed from both tags to name its first differing element.
// Per-parameter optimizer steps and the groups' hyperparameters are compared
// too. GPT's tied output copy is the embedding.
//
// With a tolerance (rtol or atol > 0), tensors whose fingerprints differ are
// compared element by element as numbers, numpy.allclose's way:
// |a - b| <= atol + rtol * |b|; only elements past it make a difference. The
// largest differences seen are reported either way, since runs that are
// equal only within rounding (other layouts, other summation orders) never
// match bit for bit.
//
// A recorded fingerprint is only as good as the files it describes: check
// the tag against its manifest's file checksums first (ckpt-verify does).
#pragma once

#include <string>
#include <vector>

#include "ckpt/shard/logical_state.h"

namespace ckpt {

struct TagDifference {
  std::string name;  // a logical parameter ("" for the tag as a whole)
  std::string what;  // "exp_avg differs first at element 1234 of 4096", ...
};

struct CompareOptions {
  double rtol = 0, atol = 0;  // 0, 0: bit for bit
  size_t chunk = 4 << 20;     // bytes streamed at a time
};

struct CompareReport {
  uint64_t tensors = 0, bytes = 0;       // logical tensors and their bytes compared
  uint64_t inexact = 0;                  // tensors equal only within the tolerance
  double max_abs_diff = 0, max_rel_diff = 0;  // over the elements compared as numbers
  std::string max_rel_at;                // "name field" holding max_rel_diff
  bool recorded_a = false, recorded_b = false;  // the tag recorded fingerprints, checked against the computed ones
  std::vector<TagDifference> differences;
};

CompareReport CompareTags(const LogicalState& a, const LogicalState& b, const CompareOptions& opts = {});

}  // namespace ckpt

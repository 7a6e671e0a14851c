// Whether two checkpoint tags hold the same model and optimizer state,
// whatever their layouts: every logical tensor (unsharded, vocab rows up to
// the real vocabulary, ZeRO-1 padding trimmed) and field is streamed from
// both tags through ShardedTag and compared byte for byte, chunk by chunk,
// in bounded memory. Per-parameter optimizer steps and the groups'
// hyperparameters are compared too. GPT's tied output copy is the embedding.
#pragma once

#include <string>
#include <vector>

#include "ckpt/sharded_tag.h"

namespace ckpt {

struct TagDifference {
  std::string name;  // a logical parameter ("" for the tag as a whole)
  std::string what;  // "exp_avg differs at element 1234 (of 4096)", ...
};

struct CompareReport {
  uint64_t tensors = 0, bytes = 0;  // compared
  std::vector<TagDifference> differences;
};

CompareReport CompareTags(const ShardedTag& a, const ShardedTag& b, size_t chunk = 4 << 20);

}  // namespace ckpt

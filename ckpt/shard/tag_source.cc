#include "ckpt/shard/tag_source.h"

#include <filesystem>

#include "ckpt/shard/sharded_tag.h"
#include "ckpt/util/output_guard.h"
#include "ckpt/spec/tag_paths.h"
#include "ckpt/store/tag_verify.h"

namespace ckpt {

SourceKind TagSourceKind() {
  SourceKind k;
  k.name = "tag";
  k.description = "a checkpoint tag (NxDT's or NxD's rank files, plain .pt or xser)";
  k.detect = [](Env* env, const std::string& path) { return LooksLikeTag(env, path); };
  k.open = [](Env* env, const std::string& path, const SourceOptions& o) {
    auto tag = ShardedTag::Open(env, path, o.hints, {.weights_only = o.weights_only, .trust_first_replica = o.trust_first_replica});
    OpenedSource s;
    s.tag_name = std::filesystem::path(WithoutTrailingSeparators(path)).filename().string();
    s.bytes = tag->bytes();
    s.notes = tag->format_notes();
    s.optimizer_skipped = tag->optimizer_skipped();
    s.state = std::move(tag);
    return s;
  };
  return k;
}

}  // namespace ckpt

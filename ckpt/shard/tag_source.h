// The registry entry of sharded tags (ckpt/shard/sharded_tag.h): NxDT's
// and NxD's checkpoint tags, plain .pt or xser, with or without a manifest.
#pragma once

#include "ckpt/shard/source_registry.h"

namespace ckpt {

// name "tag". Detects a folder LooksLikeTag (ckpt/store/tag_verify.h) calls a
// tag; opens it with ShardedTag::Open and SourceOptions' hints, weights_only
// and trust_first_replica. The tag name is the folder's name; bytes are
// ShardedTag::bytes; notes its format_notes.
SourceKind TagSourceKind();

}  // namespace ckpt

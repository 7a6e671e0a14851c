// manifest.json: what a committed tag holds. For every file (path relative to
// the tag) its size and CRC-32, plus the step, consumed samples,
// rank grid and world size. NxD ignores the file; shardkit uses it to verify
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

#include "ckpt/env.h"
#include "ckpt/layout.h"
#include "ckpt/partition.h"

namespace ckpt {

struct FileDigest {
  uint64_t size = 0;
  uint32_t crc32 = 0;
  bool operator==(const FileDigest&) const = default;
};

struct Manifest {
  int64_t step = 0;
  double consumed_samples = 0;
  RankGrid grid;
  int world_size = 1;
  // The model format, when the writer knew it (the trainer, converter and
  // reshard do): lets ckpt-reshard work without the training config.
  std::optional<ModelFormat> model;
  std::map<std::string, FileDigest> files;

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
// Size and CRC-32 of a file as it is on disk (mapped a chunk at a time, each
// released once summed, so memory stays small whatever the file's size).
FileDigest DigestFile(Env* env, const std::string& path);

}  // namespace ckpt

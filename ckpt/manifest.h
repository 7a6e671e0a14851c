// manifest.json: what a committed tag holds. For every file (path relative to
// the tag) its size and XXH3-64 checksum, plus the step, consumed samples,
// rank grid and world size. NxD ignores the file; shardkit uses it to verify
// a tag and to pick a resume point without trusting modification times.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "ckpt/env.h"
#include "ckpt/layout.h"

namespace ckpt {

struct FileDigest {
  uint64_t size = 0;
  uint64_t xxh3 = 0;
  bool operator==(const FileDigest&) const = default;
};

struct Manifest {
  int64_t step = 0;
  double consumed_samples = 0;
  RankGrid grid;
  int world_size = 1;
  std::map<std::string, FileDigest> files;

  nlohmann::ordered_json ToJson() const;
  // Throws ckpt::Error naming `source` and the bad field.
  static Manifest FromJson(const nlohmann::json& j, const std::string& source);
  static Manifest Load(Env* env, const std::string& path);
  void Save(Env* env, const std::string& path) const;  // atomic
};

std::string DigestHex(uint64_t xxh3);
uint64_t Xxh3(std::span<const uint8_t> data);
// Size and checksum of a file as it is on disk (mapped, not copied).
FileDigest DigestFile(Env* env, const std::string& path);

}  // namespace ckpt

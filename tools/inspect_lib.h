// What ckpt-inspect reports, separated from printing so it can be tested:
// the checkpoint files under a path (a .pt/.ckpt file, an xser file, an NxDT
// tag directory or an NNM checkpoint folder), each flattened into entries.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/util/env.h"
#include "ckpt/pt/value.h"

namespace shardkit {

struct InspectEntry {
  std::string key;  // path through the tree, components joined by '/'
  bool is_tensor = false;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  nlohmann::ordered_json value;  // non-tensor values: canonical JSON
};

struct InspectedFile {
  std::string file;  // relative to the inspected path ("" for a single file)
  std::string format;  // "pt" or "xser"
  std::vector<InspectEntry> entries;
};

struct InspectReport {
  std::string path;
  std::string kind;  // "file", "xser", "nxdt_tag", "nnm_folder", "directory"
  std::vector<std::string> markers;  // done, checkpoint, newest, manifest.json present
  std::vector<InspectedFile> files;
  // For a tag: what ckpt-verify finds wrong (missing rank files, sizes or
  // checksums against the manifest, no `done`); the command exits 1 when any.
  std::vector<std::string> problems;
  // For a tag whose manifest records its model format: the parallel layout
  // and model (ModelFormat::Describe, with its family and KV replication),
  // and what a reader must know of it (a Megatron-style KV replication that
  // only shardkit loads). A LoRA tag without one: its lora_config (ckpt/spec/lora.h).
  std::string model;
  std::optional<nlohmann::ordered_json> model_json;
  std::vector<std::string> notes;
};

// Throws ckpt::Error naming the offending file.
InspectReport Inspect(const std::string& path, bool verify_crc, ckpt::Env* env = ckpt::Env::Default());
// Flattens a tree into entries (exposed for tests).
void Flatten(const ckpt::Value& v, const std::string& prefix, std::vector<InspectEntry>* out);

nlohmann::ordered_json ReportToJson(const InspectReport& r);
std::string ReportToText(const InspectReport& r);

}  // namespace shardkit

// The source registry: every reader of a checkpoint as logical tensors (a
// sharded tag, an NNM checkpoint, a Hugging Face folder, a ckpt-export HDF5
// file, the tests' fake) is one entry, opened through one registry, so a new
// format is one file and one entry (PyTorch DCP's registered storage readers
// and TensorStore's drivers are the model).
//
// An entry has a name, a detection function and an open function. Detection
// answers whether a path is this kind of source from names and at most a few
// small files (it never parses tensors), so the registry can say what a path
// is and entries do not claim each other's paths. Opening returns the common
// LogicalState (ckpt/shard/logical_state.h) with what the tools report about
// the read.
//
// The registry lives in ckpt/ with the tag entry (ckpt/shard/tag_source.h);
// the entries of readers above ckpt/ (NNM in convert/, HF and HDF5 in tools/)
// are added by tools/all_sources.h, so ckpt/ depends on neither.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/spec/model_family.h"
#include "ckpt/util/env.h"

namespace ckpt {

// What opening a source may need besides its path; each entry reads the
// fields that apply to it and ignores the others.
struct SourceOptions {
  // What the source may not record (heads, KV heads, vocabulary padding; for
  // an HF folder make_vocab_size_divisible_by, fuse_qkv and qkv_linear).
  FormatHints hints{};
  bool weights_only = false;         // read the model alone (ckpt::TagReadOptions::weights_only)
  bool trust_first_replica = false;  // ckpt::TagReadOptions::trust_first_replica
  ModelFamily family = ModelFamily::kMegatron;  // an HF folder: the family to read it into
  std::string model_config{};   // an HF weights file: its config.json
  std::string checkpoint_name{};  // an NNM checkpoint: the file to take in each rank folder
  std::function<void(const std::string&)> log{};  // what a reader announces (which NNM file it chose); may be empty
};

// An opened source and what the tools report about the read.
struct OpenedSource {
  std::unique_ptr<LogicalState> state;
  std::string kind;      // the entry's name
  std::string tag_name;  // the tag name the source is or records ("" when none)
  uint64_t bytes = 0;    // bytes of the files behind the state
  std::vector<std::string> notes;  // what the reader took from besides the tensors (a recorded job config)
  bool optimizer_skipped = false;  // optimizer state present but not read (weights_only)
};

struct SourceKind {
  std::string name;         // "tag", "nnm", "hf", "h5", ...: what a command line or a message calls it
  std::string description;  // one line, for messages ("a checkpoint tag (NxDT or NxD)")
  // Whether `path` is this kind of source. Reads names and at most a few
  // small files; never throws for a path that is not this kind.
  std::function<bool(Env* env, const std::string& path)> detect;
  // Opens `path`. Throws ckpt::Error naming the file, key or tensor for
  // anything that is not a complete, consistent source of this kind.
  std::function<OpenedSource(Env* env, const std::string& path, const SourceOptions& options)> open;
};

class SourceRegistry {
 public:
  // The process's registry, holding the tag entry; programs that read other
  // kinds add them at start (tools::AllSources).
  static SourceRegistry& Default();

  // Adds an entry. Throws ckpt::Error when its name is taken or it lacks a function.
  void Add(SourceKind kind);
  // The entry named `name`, or null.
  const SourceKind* Find(const std::string& name) const;
  // The entry whose detection claims `path`, or null when none does.
  // Throws ckpt::Error naming the path and the entries when several do.
  const SourceKind* Detect(Env* env, const std::string& path) const;
  // Opens `path` as `kind`, or as what Detect finds when `kind` is empty.
  // Throws ckpt::Error naming the path when no entry is named `kind` or
  // none claims it, and whatever the entry's open throws.
  OpenedSource Open(Env* env, const std::string& path, const SourceOptions& options, const std::string& kind = "") const;
  // The entries' names, in the order added.
  std::vector<std::string> names() const;

 private:
  std::vector<SourceKind> kinds_;
};

}  // namespace ckpt

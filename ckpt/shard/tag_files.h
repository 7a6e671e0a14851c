// TagFiles: the files of one checkpoint tag (the tag reader's first part,
// ckpt/shard/sharded_tag.h): which rank files model/ and optim/ hold, plain
// .pt or xser (X.pt + X.pt.tensors/, the whole tag one or the other), what
// is missing, and the degrees the names give (tp, pp from model/; dp and
// ZeRO-1 from optim/), checked against the manifest when there is one. It
// then loads them: each plain rank file mapped, an xser tag's files read by
// several threads at once (Preload), every rank file's bytes counted, and
// keeps what it mapped alive for the tensors that view it.
//
// A tag on disk is read through `env`, every path confined to the tag (a
// rank file, or model/ itself, linked out of it is refused, never read). A
// tag in memory (ShardedTag::FromFiles) maps each path to its loaded value.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "ckpt/shard/logical_state.h"
#include "ckpt/store/manifest.h"
#include "ckpt/util/env.h"

namespace ckpt {

struct TagReadOptions;

class TagFiles {
 public:
  TagFiles(Env* env, std::string dir) : env_(env), dir_(std::move(dir)) {}
  // The tag is `files` (paths in the tag -> loaded values), not a folder.
  void SetInMemory(std::map<std::string, Value> files);

  // Finds the rank files and sets `layout`'s grid and has_optimizer (false
  // with opts.weights_only; `optimizer_skipped` then says whether there were
  // optimizer files), and whether the tag is xser. Loads the manifest of a
  // tag on disk into `manifest`. Throws naming the file for a tag that is not
  // a folder, has no model/ rank files, misses a rank's file, mixes
  // containers, or disagrees with its manifest.
  void Discover(const TagReadOptions& opts, std::optional<Manifest>& manifest, TagDescription& layout, bool* optimizer_skipped);
  // Reads every rank file of an xser tag ahead, by 8 threads (see the .cc).
  void Preload(const TagDescription& layout);
  // Loads model/ of every (ep, tp, pp) rank; each must hold a dict.
  void LoadModelFiles(const RankGrid& grid);
  // Tp rank t's model file of stage p and ep rank e (after LoadModelFiles).
  const Dict& Model(int t, int p, int e = 0) const { return model_[(static_cast<size_t>(e) * pp_ + p) * tp_ + t].as_dict(); }

  // `rel` (model/<rank file>, user_content.pt, ...) as messages name it; on
  // disk, checked to lie inside the tag.
  std::string Path(const std::string& rel) const;
  // A tag-level or rank file, without the accounting Load does.
  Value Peek(const std::string& rel) const;
  // A rank file, its bytes counted and its mapping kept.
  Value Load(const std::string& rel);
  // The mapped file a tensor's bytes lie in: its own tensor file under xser.
  const MappedFile* FileOf(const Tensor& x, const std::string& rel) const;
  // user_content.pt, loaded once (the model format and the step both read it), or null.
  const Value* UserContent();
  // A file of the tag by its path in the tag, or nullopt when absent.
  std::optional<Value> TagFile(const std::string& name) const;

  const std::string& dir() const { return dir_; }
  bool in_memory() const { return in_memory_; }
  bool xser() const { return xser_; }
  uint64_t bytes() const { return bytes_; }

 private:
  std::vector<std::string> ListNames(const std::string& sub) const;
  std::vector<std::string> ListRankFiles(const std::string& sub, std::set<std::string>& entries) const;
  void RefuseLostExpertOptimizer() const;
  void CheckOptimizerFiles(const std::vector<std::string>& names, const std::optional<Manifest>& manifest, TagDescription& layout);

  Env* env_;
  std::string dir_;
  bool in_memory_ = false;
  std::map<std::string, Value> given_;  // SetInMemory's files
  std::map<std::string, std::variant<Value, std::exception_ptr>> preloaded_;  // Preload's, until Load takes them
  std::vector<std::shared_ptr<const MappedFile>> files_;
  std::vector<Value> held_;  // xser rank files: their tensors keep the tensor files mapped
  std::map<std::string, const MappedFile*> file_of_;
  std::vector<Value> model_;  // by (ep, pp, tp)
  int tp_ = 1, pp_ = 1;
  bool xser_ = false;
  uint64_t bytes_ = 0;
  std::optional<Value> user_content_;
  bool user_content_loaded_ = false;
};


}  // namespace ckpt

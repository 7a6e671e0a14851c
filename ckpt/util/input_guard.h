// The rule for reading: nothing outside the tree the user named is opened.
// A file inside an input folder may be a symbolic link only when it resolves
// to a place inside that folder too (after resolving the folder's own links),
// so a tag whose rank file or model/ folder links elsewhere, or a Hugging
// Face index naming an in-folder link to /etc/passwd, is refused rather than
// followed. One exception, for Hugging Face's cache: a folder that is
// <cache>/snapshots/<revision> may hold links into <cache>/blobs, which is
// how huggingface_hub lays out every downloaded model.
// Errors name the file, where it resolves to, and the folder it left.
#pragma once

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace ckpt {

// Throws ckpt::Error unless `path` resolves inside `root` (see above).
// `path` need not exist (a missing file is the caller's error to report).
void RequireInside(const std::string& root, const std::string& path);

// True when `path` resolves inside `root` (the same rule, as a predicate).
bool ResolvesInside(const std::string& root, const std::string& path);

// The same rule for many files of one folder (an xser tensors folder holds
// one per tensor): the folder is resolved once, then a file costs one lstat,
// and only a link is resolved in full.
class ConfinedFolder {
 public:
  // Throws ckpt::Error unless `dir` resolves inside `root`.
  ConfinedFolder(std::string root, std::string dir);
  // Throws ckpt::Error unless dir/name resolves inside root. `name` is a file
  // name, without '/'.
  void Require(const std::string& name) const;

 private:
  std::string root_, dir_;
};

// The same rule for many files anywhere under one root (VerifyTag checks each
// of a Trn1 tp 32 xser tag's 6,304 files; resolving each in full cost about 20
// system calls a file, readlink and getcwd per path component): the root is
// resolved once and each folder once, then a file that is not a link costs
// one lstat. A link, a path that does not exist, or a file whose folder
// resolves outside is resolved in full, as ResolvesInside does. Thread-safe.
class ConfinedTree {
 public:
  explicit ConfinedTree(std::string root) : root_(std::move(root)) {}
  // ResolvesInside(root, path).
  bool Inside(const std::string& path) const;

 private:
  std::string root_;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, bool> folders_;  // folder path -> ResolvesInside(root, folder)
};

}  // namespace ckpt

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

#include <string>

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

}  // namespace ckpt

#include "ckpt/util/input_guard.h"

#include <sys/stat.h>

#include <filesystem>
#include <vector>

#include "ckpt/util/error.h"
#include "ckpt/util/output_guard.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;

bool Under(const std::string& dir, const std::string& p) {
  return p == dir || (p.size() > dir.size() && p.compare(0, dir.size(), dir) == 0 && (dir == "/" || p[dir.size()] == '/'));
}

// The folders `path` may resolve into: the root itself and, for a Hugging
// Face cache snapshot (<cache>/snapshots/<rev>), the cache's blobs/.
std::vector<std::string> AllowedRoots(const std::string& root) {
  const std::string real = ResolvedPath(root);
  std::vector<std::string> roots{real};
  const fs::path r(real);
  if (r.has_parent_path() && r.parent_path().filename() == "snapshots")
    roots.push_back((r.parent_path().parent_path() / "blobs").string());
  return roots;
}

}  // namespace

bool ResolvesInside(const std::string& root, const std::string& path) {
  const std::string real = ResolvedPath(path);
  for (const std::string& r : AllowedRoots(root))
    if (Under(r, real)) return true;
  return false;
}

void RequireInside(const std::string& root, const std::string& path) {
  if (ResolvesInside(root, path)) return;
  throw Error(path + ": resolves to " + ResolvedPath(path) + ", outside " + root +
              " (a symbolic link out of the folder); shardkit opens nothing outside the folder you named. "
              "Copy the file into the folder, or name the folder it really lives in");
}

ConfinedFolder::ConfinedFolder(std::string root, std::string dir) : root_(std::move(root)), dir_(std::move(dir)) {
  RequireInside(root_, dir_);
}

void ConfinedFolder::Require(const std::string& name) const {
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
    throw Error(dir_ + ": '" + name + "' is not a file name of the folder");
  const std::string path = dir_ + "/" + name;
  std::error_code ec;
  // Not a link: a name in a folder that resolves inside root is inside root.
  if (fs::is_symlink(fs::symlink_status(path, ec)) || ec) RequireInside(root_, path);
}

// realpath(folder/name) is realpath(folder)/name when name is no link, so a
// folder inside the root vouches for its plain files.
bool ConfinedTree::Inside(const std::string& path) const {
  const size_t slash = path.rfind('/');
  const std::string name = slash == std::string::npos ? "" : path.substr(slash + 1);
  struct stat st;
  if (name.empty() || name == "." || name == ".." || ::lstat(path.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) return ResolvesInside(root_, path);
  const std::string folder = slash == 0 ? "/" : path.substr(0, slash);
  bool inside;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = folders_.find(folder);
    inside = it != folders_.end() ? it->second : folders_.emplace(folder, ResolvesInside(root_, folder)).first->second;
  }
  return inside || ResolvesInside(root_, path);  // outside: the path itself may be the Hugging Face cache's blobs/
}

}  // namespace ckpt

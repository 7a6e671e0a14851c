#include "ckpt/input_guard.h"

#include <filesystem>
#include <vector>

#include "ckpt/error.h"
#include "ckpt/output_guard.h"

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

}  // namespace ckpt

#include "ckpt/util/output_guard.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "ckpt/util/error.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;

// The path's components, without empty ones (a trailing separator).
std::vector<std::string> Parts(const fs::path& p) {
  std::vector<std::string> out;
  for (const auto& c : p)
    if (!c.empty() && c != ".") out.push_back(c.string());
  return out;
}

// a == b, or b lies inside a.
bool Contains(const fs::path& a, const fs::path& b) {
  const auto pa = Parts(a), pb = Parts(b);
  return pa.size() <= pb.size() && std::equal(pa.begin(), pa.end(), pb.begin());
}

}  // namespace

std::string WithoutTrailingSeparators(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

std::string ResolvedPath(const std::string& path) {
  const std::string given = WithoutTrailingSeparators(path);
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(given, ec), ec);
  if (ec) p = fs::absolute(given).lexically_normal();
  return WithoutTrailingSeparators(p.string());
}

void CheckOutputs(const std::vector<OutputPath>& outputs, const std::vector<InputPath>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    OutputPath o = outputs[i];
    if (o.path.empty()) continue;
    o.path = WithoutTrailingSeparators(o.path);  // lstat("link/") would follow the link
    const fs::path out = ResolvedPath(o.path);
    for (const InputPath& in : inputs) {
      if (in.path.empty()) continue;
      const fs::path inp = ResolvedPath(in.path);
      std::string how;
      if (out == inp) how = "is";
      else if (Contains(out, inp)) how = "contains";
      else if (Contains(inp, out)) how = "lies inside";
      if (!how.empty())
        throw Error(o.option + " " + o.path + ": " + how + " the input " + (in.option.empty() ? "" : in.option + " ") + in.path +
                    "; writing it could destroy the input. Choose an output outside it");
    }
    for (size_t j = 0; j < i; ++j)
      if (!outputs[j].path.empty() && ResolvedPath(outputs[j].path) == out.string())
        throw Error(o.option + " " + o.path + ": is also " + outputs[j].option + "; one would overwrite the other");
    struct stat st;
    if (::lstat(o.path.c_str(), &st) == 0) {
      if (S_ISLNK(st.st_mode))
        throw Error(o.option + " " + o.path + ": is a symbolic link; refusing to replace the link (give its target instead)");
      if (!o.is_dir && !S_ISREG(st.st_mode))
        throw Error(o.option + " " + o.path + ": exists and is not a regular file" + (S_ISDIR(st.st_mode) ? " (a folder)" : ""));
      if (o.is_dir && !S_ISDIR(st.st_mode)) throw Error(o.option + " " + o.path + ": exists and is not a folder");
    }
    if (!o.is_dir) {
      const fs::path parent = fs::path(o.path).has_parent_path() ? fs::path(o.path).parent_path() : fs::path(".");
      std::error_code ec;
      if (!fs::is_directory(parent, ec))
        throw Error(o.option + " " + o.path + ": its folder " + parent.string() + " does not exist; nothing was written");
    }
  }
}

}  // namespace ckpt

// The one guard every command runs on its outputs before it writes anything,
// so that no command can destroy what the user did not ask it to:
//  - an output that is an input, contains an input or lies inside one is
//    refused (paths are compared after resolving symlinks and "..");
//  - two outputs at the same path are refused;
//  - an output file that exists as anything but a regular file (a symlink, a
//    device, a folder) is refused: an atomic replace would swap the link or
//    node itself, not write through it;
//  - an output file's folder must exist, so that a command with two outputs
//    fails before the first is written rather than after.
// Errors name the option, the path and what is wrong.
#pragma once

#include <string>
#include <vector>

namespace ckpt {

struct OutputPath {
  std::string path;
  std::string option;  // "-o", "--report", "--nxdt_ckpt_path": how the user named it
  bool is_dir = false;  // a tag folder rather than a file
};

struct InputPath {
  std::string path;
  std::string option;
};

void CheckOutputs(const std::vector<OutputPath>& outputs, const std::vector<InputPath>& inputs);

// The absolute path with symlinks and ".." resolved as far as the path exists.
std::string ResolvedPath(const std::string& path);

// The path as the user meant it: "out.ckpt/" names out.ckpt ("/" stays "/").
std::string WithoutTrailingSeparators(std::string path);

}  // namespace ckpt

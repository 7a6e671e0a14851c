// ckpt::Error is the one exception type the checkpoint library throws.
// Its message always names the file (and, where known, the record or key) and
// what is wrong, so a tool can print it as-is and exit non-zero.
#pragma once

#include <stdexcept>
#include <string>

namespace ckpt {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace ckpt

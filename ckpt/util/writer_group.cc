#include "ckpt/util/writer_group.h"

#include <cstdio>
#include <cstdlib>

namespace ckpt {
namespace {

class Solo final : public WriterGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void Broadcast(std::string*) override {}
  std::vector<std::string> Gather(const std::string& s) override { return {s}; }
  [[noreturn]] void Abort(int code) override { std::exit(code); }
};

}  // namespace

WriterGroup& SoloGroup() {
  static Solo solo;
  return solo;
}

int FailGroup(WriterGroup& group, int code, const std::string& what) {
  const std::string line = (group.size() > 1 ? "rank " + std::to_string(group.rank()) + ": error: " : "error: ") + what + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
  if (group.size() > 1) group.Abort(code);
  return code;
}

}  // namespace ckpt

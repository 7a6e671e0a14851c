#include "ckpt/util/progress.h"

#include <algorithm>
#include <cstdio>

namespace ckpt {

std::string ProgressBar(uint64_t done, uint64_t total, int width) {
  const int filled = static_cast<int>(static_cast<double>(width) * static_cast<double>(std::min(done, total)) /
                                      static_cast<double>(std::max<uint64_t>(total, 1)));
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
}

std::string HumanBytes(uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1ull << 30));
  else if (b >= (1ull << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1ull << 20));
  else if (b >= (1ull << 10)) std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / (1ull << 10));
  else std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  return buf;
}

}  // namespace ckpt

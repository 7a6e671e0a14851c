// Progress reporting shared by long-running tools: a text bar for terminals
// and human-readable sizes for log lines.
#pragma once

#include <cstdint>
#include <string>

namespace ckpt {

// "[#########.....................]": `done` of `total` over `width` cells.
std::string ProgressBar(uint64_t done, uint64_t total, int width = 30);
// "1.50 GiB", "12.0 MiB", "512 B".
std::string HumanBytes(uint64_t bytes);

}  // namespace ckpt

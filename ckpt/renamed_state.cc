#include "ckpt/renamed_state.h"

#include <algorithm>

namespace ckpt {

RenamedState::RenamedState(const LogicalState& src, const ModelFormat& to) : src_(src), layout_(src.layout()) {
  layout_.format = to;
  params_ = LogicalParameters(to, src.layout().grid.tp);
  blocks_ = LogicalRowsIn(src.layout().format, to);
  for (const auto& p : params_) width_[p.name] = p.shape.size() > 1 ? p.shape[1] : 1;
}

void RenamedState::Read(const std::string& name, StateField f, uint64_t begin, std::span<uint8_t> out, Touched* touched) const {
  const uint64_t w = static_cast<uint64_t>(width_.at(name)), es = ElementSize(dtype(name, f));
  const uint64_t end = begin + out.size() / es;
  uint64_t at = 0;  // this tensor's element where the block starts
  for (const auto& b : blocks_.at(name)) {
    const uint64_t len = static_cast<uint64_t>(b.rows) * w, lo = std::max(begin, at), hi = std::min(end, at + len);
    if (lo < hi) src_.Read(b.name, f, static_cast<uint64_t>(b.row) * w + (lo - at), out.subspan((lo - begin) * es, (hi - lo) * es), touched);
    at += len;
  }
}

}  // namespace ckpt

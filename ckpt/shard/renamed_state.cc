#include "ckpt/shard/renamed_state.h"

#include <algorithm>
#include <cstring>

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
  std::memset(out.data(), 0, out.size());  // rows no piece covers: vocabulary padding
  for (const RowsFrom& p : blocks_.at(name)) {
    const uint64_t at = static_cast<uint64_t>(p.row) * w, len = static_cast<uint64_t>(p.from.rows) * w;
    const uint64_t lo = std::max(begin, at), hi = std::min(end, at + len);
    if (lo < hi)
      src_.Read(p.from.name, f, static_cast<uint64_t>(p.from.row) * w + (lo - at), out.subspan((lo - begin) * es, (hi - lo) * es), touched);
  }
}

}  // namespace ckpt

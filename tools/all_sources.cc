#include "tools/all_sources.h"

#include <mutex>

#include "convert/nnm_state.h"
#include "tools/h5_state.h"
#include "tools/hf_state.h"

namespace tools {

const ckpt::SourceRegistry& AllSources() {
  static std::once_flag once;
  std::call_once(once, [] {
    ckpt::SourceRegistry& r = ckpt::SourceRegistry::Default();
    r.Add(convert::NnmSourceKind());
    r.Add(HfSourceKind());
    r.Add(H5SourceKind());
  });
  return ckpt::SourceRegistry::Default();
}

}  // namespace tools

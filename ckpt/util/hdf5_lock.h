// Debian's libhdf5 (serial) is not built thread-safe: every HDF5 call in the
// process holds this one lock. Header-only, so ckpt/ itself needs no HDF5.
#pragma once

#include <mutex>

namespace ckpt {

inline std::mutex& Hdf5Lock() {
  static std::mutex mu;
  return mu;
}

}  // namespace ckpt

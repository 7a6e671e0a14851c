#!/usr/bin/env bash
# Installs every Debian package shardkit needs to build, test and benchmark.
# Idempotent: packages already present are skipped, so repeated runs are fast.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build g++ clang libclang-rt-14-dev pkg-config
  lld  # links three times faster than ld.bfd (CMakeLists.txt, SHARDKIT_LLD)
  libhdf5-dev libzip-dev nlohmann-json3-dev libyaml-cpp-dev libtbb-dev
  libeigen3-dev libopenmpi-dev openmpi-bin libcli11-dev libxxhash-dev libdeflate-dev zlib1g-dev
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-torch python3-numpy python3-omegaconf python3-h5py
  procps  # pgrep and pkill: the kill tests find and kill one rank of an mpirun job
  strace  # bad_input_bounded.py checks a command opens nothing under a folder linked out of its input
  libopenblas0-pthread  # the BLAS torch uses in benchmarks (Debian otherwise gives it reference BLAS)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  # apt's output goes to a log; a line per phase here, the log's tail on failure.
  log=${SETUP_LOG:-/tmp/shardkit-setup.log}
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  run_phase() {
    echo "setup: $1 (log: $log)"
    shift
    if ! "$@" >>"$log" 2>&1; then
      echo "setup: failed; the end of $log:" >&2
      tail -n 30 "$log" >&2
      exit 1
    fi
  }
  : >"$log"
  run_phase "updating the package lists" $SUDO apt-get update -qq
  run_phase "installing ${#missing[@]} packages: ${missing[*]}" \
    env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  echo "setup: done"
else
  echo "setup: all ${#PACKAGES[@]} packages present"
fi

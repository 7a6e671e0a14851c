#!/usr/bin/env bash
# Installs every Debian package shardkit needs to build, test and benchmark.
# Idempotent: packages already present are skipped, so repeated runs are fast.
set -euo pipefail

PACKAGES=(
  build-essential cmake g++ clang libclang-rt-14-dev pkg-config
  libhdf5-dev libzip-dev nlohmann-json3-dev libyaml-cpp-dev libtbb-dev
  libeigen3-dev libopenmpi-dev openmpi-bin libcli11-dev libxxhash-dev libdeflate-dev zlib1g-dev
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-torch python3-numpy python3-omegaconf python3-h5py
  procps  # pgrep and pkill: the kill tests find and kill one rank of an mpirun job
  libopenblas0-pthread  # the BLAS torch uses in benchmarks (Debian otherwise gives it reference BLAS)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all ${#PACKAGES[@]} packages present"
fi

#!/usr/bin/env bash
# Configures and builds one build tree. Usage: build.sh DIR [cmake args...]
# BUILD_TARGETS, if set, names the targets to build (default: all).
set -euo pipefail
dir=$1; shift
# Ninja where it is installed (setup.sh installs it); a tree already configured keeps its generator.
generator=()
[ -f "$dir/CMakeCache.txt" ] || ! command -v ninja >/dev/null || generator=(-G Ninja)
cmake -S "$(dirname "$0")/.." -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} "$@" >/dev/null
cmake --build "$dir" -j "$(nproc)" ${BUILD_TARGETS:+--target $BUILD_TARGETS}

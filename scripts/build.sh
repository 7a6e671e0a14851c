#!/usr/bin/env bash
# Configures and builds one build tree. Usage: build.sh DIR [cmake args...]
set -euo pipefail
dir=$1; shift
cmake -S "$(dirname "$0")/.." -B "$dir" -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-Release} "$@" >/dev/null
cmake --build "$dir" -j "$(nproc)"

#!/usr/bin/env bash
# The whole test suite: install, build, run ctest; then the zip and pickle tests
# under ASan+UBSan, then the libFuzzer target for a bounded time on a seed corpus.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"

bash "$root/scripts/build.sh" "$root/build"
(cd "$root/build" && ctest --output-on-failure -j 2 --timeout 900)

echo "== sanitizer build (ASan + UBSan): zip and pickle tests"
bash "$root/scripts/build.sh" "$root/build-asan" -DSHARDKIT_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
(cd "$root/build-asan" && ctest --output-on-failure -j 2 -L sanitize)

echo "== libFuzzer: zip + pickle readers"
CC=clang CXX=clang++ bash "$root/scripts/build.sh" "$root/build-fuzz" -DSHARDKIT_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug
bash "$root/tests/fuzz/run_fuzz.sh" "$root/build-fuzz" "${FUZZ_SECONDS:-60}"

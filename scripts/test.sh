#!/usr/bin/env bash
# The whole test suite: install, build, run ctest; then every unit test (the
# zip and pickle tests among them) under ASan+UBSan, then the libFuzzer
# targets (.pt readers, xser, YAML configs, manifests and rank records) for a
# bounded time on seed corpora; then a short round of kill trials (random
# SIGKILLs of multi-process jobs: tests/kill_trials.py; KILL_TRIALS sets the
# count per job, default 5).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"

bash "$root/scripts/build.sh" "$root/build"
(cd "$root/build" && ctest --output-on-failure -j 2 --timeout 900 --no-tests=error)

# Every unit test (the zip and pickle tests among them) again under ASan + UBSan.
# --no-tests=error: an empty selection must fail, not pass.
echo "== sanitizer build (ASan + UBSan): unit tests"
bash "$root/scripts/build.sh" "$root/build-asan" -DSHARDKIT_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
(cd "$root/build-asan" && ctest --output-on-failure -j 2 --timeout 900 --no-tests=error -L unit)

echo "== libFuzzer: .pt readers, xser, YAML configs, manifests and rank records"
CC=clang CXX=clang++ bash "$root/scripts/build.sh" "$root/build-fuzz" -DSHARDKIT_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug
bash "$root/tests/fuzz/run_fuzz.sh" "$root/build-fuzz" "${FUZZ_SECONDS:-60}"

echo "== kill trials: training (4 ranks), ckpt-reshard and nnm2nxdt-ckpt (2 ranks each), SIGKILLed at random"
/usr/bin/python3 "$root/tests/kill_trials.py" --build "$root/build" --trials "${KILL_TRIALS:-5}"

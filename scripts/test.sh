#!/usr/bin/env bash
# The whole test suite, on a fresh machine:
#  1. install (setup.sh);
#  2. the release build, and ctest: the interop tests (our binaries against
#     real torch and upstream fixtures) and the fault tests;
#  3. one clang build with ASan + UBSan: every unit test (the zip and pickle
#     tests among them), then the libFuzzer targets (.pt readers, xser, YAML
#     configs, manifests and rank records) for a bounded time on seed corpora,
#     two at a time;
#  4. a short round of kill trials (random SIGKILLs of multi-process jobs:
#     tests/kill_trials.py; KILL_TRIALS sets the count per job, default 5),
#     run beside the fuzzers: those run for a fixed time whatever CPU they
#     get, so the trials cost no wall time, and they run under load; then a
#     short round of writer trials (two writers of one output, MPI jobs with
#     one rank given another job: tests/writer_trials.py; WRITER_TRIALS,
#     default 5).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)
phase() { echo "== $* (at $(($(date +%s) - start)) s)"; }
bash "$root/scripts/setup.sh"

phase "release build, then ctest: interop and fault tests"
# The release build: products, test programs, interop and fault tests. The unit
# tests run once, below, under the sanitizers. It compiles file by file
# (UNITY=OFF), so a file that does not include what it uses fails here; a
# unity batch would hide it. It is the cheaper of the two builds to leave
# unbatched (docs/build.md); it also runs the include check (ckpt/CMakeLists.txt).
UNITY=OFF bash "$root/scripts/build.sh" "$root/build" -DSHARDKIT_UNIT_TESTS=OFF
# Three at a time on two cores: some tests wait on the disk (zip64_large writes 4 GiB).
(cd "$root/build" && ctest --output-on-failure -j 3 --timeout 900 --no-tests=error)

# One clang build serves both: every unit test (the zip and pickle tests among
# them) again under ASan + UBSan, and the libFuzzer targets. It builds only
# what it runs (the targets unit_tests and fuzzers).
phase "sanitizer build (ASan + UBSan, clang): unit tests and libFuzzer targets"
CC=clang CXX=clang++ BUILD_TARGETS="unit_tests fuzzers" \
  bash "$root/scripts/build.sh" "$root/build-asan" -DSHARDKIT_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug \
  "-DCMAKE_CXX_FLAGS_DEBUG=-gline-tables-only" "-DCMAKE_C_FLAGS_DEBUG=-gline-tables-only"  # file:line in reports, less to compile
# --no-tests=error: an empty selection must fail, not pass.
(cd "$root/build-asan" && ctest --output-on-failure -j 2 --timeout 900 --no-tests=error -L unit)

phase "libFuzzer (.pt readers, xser, YAML configs, manifests and rank records), and beside it the kill trials:" \
  "training (4 ranks), ckpt-reshard and nnm2nxdt-ckpt (2 ranks each), SIGKILLed at random"
kill_log=$(mktemp)
{ /usr/bin/python3 "$root/tests/kill_trials.py" --build "$root/build" --trials "${KILL_TRIALS:-5}" &&
  /usr/bin/python3 "$root/tests/writer_trials.py" --build "$root/build" --trials "${WRITER_TRIALS:-5}"; } >"$kill_log" 2>&1 &
kill_pid=$!
fuzz_rc=0
bash "$root/tests/fuzz/run_fuzz.sh" "$root/build-asan" "${FUZZ_SECONDS:-60}" || fuzz_rc=$?
kill_rc=0
wait "$kill_pid" || kill_rc=$?
echo "== kill and writer trials (at $(($(date +%s) - start)) s):"
cat "$kill_log"
rm -f "$kill_log"
[ "$fuzz_rc" -eq 0 ] || { echo "test.sh: the fuzzers failed" >&2; exit 1; }
[ "$kill_rc" -eq 0 ] || { echo "test.sh: the kill or writer trials failed" >&2; exit 1; }
echo "test.sh: every phase passed in $(($(date +%s) - start)) s"

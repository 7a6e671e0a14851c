#!/usr/bin/env bash
# The main job on built-in defaults: install, build, write a sample NxDT-layout
# checkpoint shard with the C++ writer, then inspect it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh" "$root/build"
out=$(mktemp -d)
"$root/build/tools/ckpt-sample" "$out/sample"
"$root/build/tools/ckpt-inspect" "$out/sample"
echo "main: sample checkpoint in $out/sample"

#!/usr/bin/env bash
# The main job on built-in defaults: install, build, write sample NxDT-layout
# checkpoints through the checkpoint store, inspect the newest and verify all.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh" "$root/build"
out=$(mktemp -d)
"$root/build/tools/ckpt-sample" "$out/checkpoints" --steps 3 --save-top-k 2
newest=$(ls -d "$out"/checkpoints/*.ckpt | sort -V | tail -1)
"$root/build/tools/ckpt-inspect" "$newest"
"$root/build/tools/ckpt-verify" "$out/checkpoints"
echo "main: sample checkpoints in $out/checkpoints"

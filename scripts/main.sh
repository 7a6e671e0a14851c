#!/usr/bin/env bash
# The main job on built-in defaults: install, build, write sample NxDT-layout
# checkpoints through the checkpoint store, inspect the newest and verify all,
# then migrate NNM's example Llama config to the NxDT schema.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh" "$root/build"
out=$(mktemp -d)
"$root/build/tools/ckpt-sample" "$out/checkpoints" --steps 3 --save-top-k 2
newest=$(ls -d "$out"/checkpoints/*.ckpt | sort -V | tail -1)
"$root/build/tools/ckpt-inspect" "$newest"
"$root/build/tools/ckpt-verify" "$out/checkpoints"
"$root/build/migrate/nnm2nxdt-config" "$root/tests/data/configs/megatron_llama_config.yaml" \
  -o "$out/nxdt_config.yaml" --report "$out/nxdt_config_report.json" model.data.data_prefix=[1.0,/data/corpus_text_document]
echo "main: sample checkpoints in $out/checkpoints; migrated config in $out/nxdt_config.yaml"

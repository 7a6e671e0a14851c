#!/usr/bin/env bash
# The main job on built-in defaults: install and build; tokenize a text file
# every Debian ships; train conf/tiny_llama.yaml, SIGKILL it after its first
# checkpoint, restart it and watch it resume by itself to the end; train it again
# on 2 ranks at tensor-parallel degree 2 (train.sh starts mpirun); inspect and
# verify the checkpoints; train the HF-style Llama (model_source: hf) and export it
# as a Hugging Face folder; migrate NNM's example Llama config to NxDT's schema.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh" "$root/build" -DSHARDKIT_UNIT_TESTS=OFF  # the programs; the test command builds the unit tests
bin=$root/build/bin
work=$(mktemp -d)
cd "$work"
mkdir -p data
"$bin/shardkit-tokenize" "${SHARDKIT_TEXT:-/usr/share/common-licenses/GPL-3}" data/text_document

echo "main: training; it will be killed after its first checkpoint"
"$bin/shardkit-train" "$root/conf/tiny_llama.yaml" &
pid=$!
until ls runs/tiny_llama/version_0/checkpoints/*/done >/dev/null 2>&1 || ! kill -0 $pid 2>/dev/null; do sleep 0.01; done
kill -9 $pid 2>/dev/null && echo "main: killed the run (SIGKILL)" || true
wait $pid 2>/dev/null || true
echo "main: restarting; it resumes from the newest complete checkpoint"
"$bin/shardkit-train" "$root/conf/tiny_llama.yaml"

echo "main: training again on 2 ranks, tensor_model_parallel_size 2 (train.sh starts mpirun)"
CONF="$root/conf/tiny_llama.yaml" bash "$root/train.sh" exp_manager.explicit_log_dir=runs/tp2 trainer.devices=2 \
  distributed_strategy.tensor_model_parallel_size=2 trainer.max_steps=20
"$bin/ckpt-verify" runs/tp2/checkpoints

echo "main: an HF-style Llama (model_source: hf) on 2 ranks, its one KV head replicated over both (kv_replicator 2)"
CONF="$root/conf/hf_llama.yaml" bash "$root/train.sh" exp_manager.explicit_log_dir=runs/hf_llama trainer.max_steps=20
"$bin/ckpt-export" "$(ls -d runs/hf_llama/checkpoints/*.ckpt | sort -V | tail -1)" hf_llama_export --format hf

ckpts=runs/tiny_llama/version_0/checkpoints
"$bin/ckpt-inspect" "$(ls -d $ckpts/*.ckpt | sort -V | tail -1)"
"$bin/ckpt-verify" "$ckpts"
"$bin/nnm2nxdt-config" "$root/tests/data/configs/megatron_llama_config.yaml" \
  -o nxdt_config.yaml --report nxdt_config_report.json model.data.data_prefix=[1.0,/data/corpus_text_document] 2>/dev/null
echo "main: run in $work/runs/tiny_llama/version_0 (metrics.jsonl, checkpoints/); migrated config in $work/nxdt_config.yaml"

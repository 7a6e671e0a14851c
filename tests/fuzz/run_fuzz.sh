#!/usr/bin/env bash
# Runs every libFuzzer target for a bounded time on a fresh seed corpus:
#   pt_fuzz        the .pt readers (zip, legacy, pickle), SECONDS
#   yaml_fuzz      YAML configs: migration, --check, training config (interpolation), SECONDS
#   xser_fuzz      xser reference trees and their info.pt, SECONDS * 3/4
#   manifest_fuzz  manifest.json and rank completion records, SECONDS * 3/8
#   hf_fuzz        safetensors headers and fingerprint pieces, SECONDS * 3/8
# Usage: run_fuzz.sh BUILD_DIR SECONDS. Fails on any crash, leak, UB or timeout.
# Targets run two at a time (one per core, FUZZ_JOBS sets it); each keeps its
# own time budget.
# -entropic=0: entropic scheduling spends ~90% of the time in its own
# bookkeeping on pt_fuzz's ~80k features (measured: 21 vs 765 exec/s).
set -euo pipefail
build=$(cd "$1" && pwd) seconds=$2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mkdir -p "$tmp/seeds/pt" "$tmp/seeds/yaml" "$tmp/seeds/manifest" "$tmp/seeds/hf" "$tmp/seeds/xser"
/usr/bin/python3 "$here/make_seeds.py" "$tmp/seeds/pt"
cp "$root"/conf/*.yaml "$root"/tests/data/configs/*.yaml "$tmp/seeds/yaml/"
printf 'model: &a {x: 1, y: [*a]}\n' >"$tmp/seeds/yaml/alias.yaml"
printf 'a: &a [1, 1]\nb: &b [*a, *a]\nc: [*b, *b]\nmodel: {n: ${a}, m: ${model.n}}\n' >"$tmp/seeds/yaml/laughs.yaml"
# Interpolation blow-ups (#35): 500 bytes whose a9 expands to 10^9 bytes; the same chain of empty
# values (no bytes, 2^40 references); a cycle that branches; references to a mapping that double.
chain() {  # KEYS COPIES FIRST: a0 is FIRST, each next key COPIES references to the one before
  echo "a0: $3"
  for ((i = 1; i <= $1; ++i)); do
    printf "a$i: '"
    for ((c = 0; c < $2; ++c)); do printf '${a%d}' $((i - 1)); done
    echo "'"
  done
}
chain 9 10 x >"$tmp/seeds/yaml/interpolation_blowup.yaml"
chain 40 2 "''" >"$tmp/seeds/yaml/interpolation_empty.yaml"
printf "a: '\${b}\${b}\${b}'\nb: '\${a}\${a}\${a}'\nmodel: {x: '\${model}'}\n" >"$tmp/seeds/yaml/interpolation_cycle.yaml"
{ echo "m0: {a: 1}"; for ((i = 1; i <= 40; ++i)); do echo "m$i: ['\${m$((i - 1))}', '\${m$((i - 1))}']"; done; } \
  >"$tmp/seeds/yaml/interpolation_tree.yaml"
cat >"$tmp/seeds/manifest/manifest.json" <<'JSON'
{"format": "shardkit-checkpoint-manifest", "version": 1, "step": 3, "consumed_samples": 24.0,
 "grid": {"tp": 1, "pp": 2, "dp": 1, "zero1": false}, "world_size": 2,
 "files": {"model/dp_rank_00_tp_rank_00_pp_rank_00.pt": {"size": 1024, "crc32": "0a1b2c3d"},
           "model/dp_rank_00_tp_rank_00_pp_rank_01.pt": {"size": 0, "crc32": "00000000"}}}
JSON
printf '{"rank": 1, "save_id": "run/step=3", "files": {"optim/x.pt": {"size": 7, "crc32": "deadbeef"}}}\n' \
  >"$tmp/seeds/manifest/rank_00001.json"

# A safetensors file of two tensors, and a rank record's fingerprint pieces.
/usr/bin/python3 - "$tmp/seeds/hf" <<'PY'
import json, struct, sys
h = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
     "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}, "__metadata__": {"format": "pt"}}
t = json.dumps(h).encode()
t += b" " * (-len(t) % 8)
open(sys.argv[1] + "/model.safetensors", "wb").write(struct.pack("<Q", len(t)) + t + bytes(22))
open(sys.argv[1] + "/pieces.json", "w").write(json.dumps({"w": {"param": [[0, 32, "0a1b2c3d"], [32, 64, "00000000"]]}}))
PY
# xser: an X.pt of TensorReferences (pickled as torch_xla's) and its info.pt, as xser_fuzz takes them.
/usr/bin/python3 - "$tmp/seeds/xser" <<'PY'
import io, struct, sys, types, torch
for name in ("torch_xla", "torch_xla.utils"):
    sys.modules[name] = types.ModuleType(name)
mod = types.ModuleType("torch_xla.utils.serialization")
class TensorReference:
    def __init__(self, tid):
        self.tid = tid
TensorReference.__module__ = mod.__name__
mod.TensorReference = TensorReference
sys.modules[mod.__name__] = mod
def saved(obj):
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()
x = saved({"w": TensorReference(0), "n": {"b": TensorReference(1), "l": [TensorReference(2)]}, "s": 3})
info = saved({i: {"dtype": torch.float32, "shape": torch.Size([i + 1]), "expert_model_parallel": False} for i in range(3)})
open(sys.argv[1] + "/with_info", "wb").write(struct.pack("<I", len(x)) + x + info)
open(sys.argv[1] + "/without_info", "wb").write(struct.pack("<I", len(x)) + x)
PY
cat >"$tmp/seeds/manifest/tensors.json" <<'JSON'
{"format": "shardkit-checkpoint-manifest", "version": 1, "step": 3, "consumed_samples": 24.0,
 "grid": {"tp": 1, "pp": 1, "dp": 1, "zero1": false}, "world_size": 1,
 "files": {"model/dp_rank_00_tp_rank_00_pp_rank_00.pt": {"size": 1024, "crc32": "0a1b2c3d"}},
 "tensors": {"w": {"param": {"dtype": "bfloat16", "numel": 16, "crc32": "0a1b2c3d"}}}}
JSON

fuzz() {  # NAME SECONDS MAX_LEN: runs one target, leaves its report in $tmp/work/NAME/report
  local name=$1 secs=$2 max_len=$3 rc=0
  mkdir -p "$tmp/work/$name"
  local log=$tmp/work/$name/fuzz.log report=$tmp/work/$name/report
  (cd "$tmp/work/$name" && "$build/bin/$name" -max_total_time="$secs" -entropic=0 -print_funcs=0 -max_len="$max_len" \
    -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 . "$tmp/seeds/${name%_fuzz}" >fuzz.log 2>&1) || rc=$?
  {
    grep -E "INITED|DONE|stat::number_of_executed_units|stat::peak_rss" "$log" | sed "s/^/$name: /" || true
    local units
    units=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    if [ "$rc" -ne 0 ] || [ -z "$units" ] || [ "$units" -le 1000 ]; then
      echo "fuzz: $name failed (libFuzzer exit $rc, ${units:-0} executions)"
      grep -A40 -E "ERROR|SUMMARY|==[0-9]+==" "$log" | head -80 || true
      for a in "$tmp/work/$name"/crash-* "$tmp/work/$name"/leak-* "$tmp/work/$name"/timeout-* "$tmp/work/$name"/oom-*; do
        [ -e "$a" ] && { echo "artifact $a:"; xxd "$a" | head -20; }
      done
      true
    else
      echo "fuzz: $name: $units inputs in ${secs}s, no finding"
    fi
  } >"$report"
}
# Two lanes of equal length (7/4 S each): pt (S) then xser (3S/4); yaml (S), manifest and hf (3S/8 each).
jobs=${FUZZ_JOBS:-2}
lane_a() { fuzz pt_fuzz "$seconds" 65536; fuzz xser_fuzz $((seconds * 3 / 4)) 16384; }
lane_b() { fuzz yaml_fuzz "$seconds" 8192; fuzz manifest_fuzz $((seconds * 3 / 8)) 8192; fuzz hf_fuzz $((seconds * 3 / 8)) 8192; }
if [ "$jobs" -ge 2 ]; then
  lane_a & a=$!
  lane_b & b=$!
  wait $a || true; wait $b || true  # each lane's reports say how it went
else
  lane_a; lane_b
fi
passed=0 failed=0
for name in pt_fuzz yaml_fuzz manifest_fuzz hf_fuzz xser_fuzz; do
  report=$tmp/work/$name/report
  if [ -s "$report" ]; then cat "$report"; else echo "fuzz: $name left no report"; fi
  if [ -s "$report" ] && grep -q "^fuzz: $name: .* no finding$" "$report"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]

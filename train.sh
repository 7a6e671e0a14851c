#!/usr/bin/env bash
# CONF=conf/X.yaml ./train.sh [key=value ...]: train with an NxDT config, as the
# NxDT docs launch it (builds first if needed). Resumes by itself when the
# config says exp_manager.resume_if_exists. With trainer.devices *
# trainer.num_nodes above 1 it starts that many ranks under mpirun (as root
# too, and oversubscribing when there are more ranks than cores; each rank then
# computes on one thread). Extra mpirun options (e.g. -H host1,host2) go in
# MPIRUN_ARGS.
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
train="$root/build/bin/shardkit-train"
[ -x "$train" ] || bash "$root/scripts/build.sh" "$root/build"
conf="${CONF:-$root/conf/tiny_llama.yaml}"
world=$("$train" --world_size "$conf" "$@")
if [ "$world" -le 1 ]; then
  exec "$train" "$conf" "$@"
fi
opts=()
[ "$(id -u)" -eq 0 ] && opts+=(--allow-run-as-root)
[ "$world" -gt "$(nproc)" ] && opts+=(--oversubscribe)
# shellcheck disable=SC2086
exec mpirun ${opts[@]+"${opts[@]}"} ${MPIRUN_ARGS:-} -np "$world" "$train" "$conf" "$@"

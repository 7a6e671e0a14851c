#!/usr/bin/env bash
# CONF=conf/X.yaml ./train.sh [key=value ...]: train with an NxDT config, as the
# NxDT docs launch it (builds first if needed). Resumes by itself when the
# config says exp_manager.resume_if_exists.
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
[ -x "$root/build/libtrain/shardkit-train" ] || bash "$root/scripts/build.sh" "$root/build"
exec "$root/build/libtrain/shardkit-train" "${CONF:-$root/conf/tiny_llama.yaml}" "$@"

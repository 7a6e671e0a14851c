#!/usr/bin/python3
"""NxD's own load_checkpoint reading a LoRA tag shardkit re-cut (dev time; needs upstream source).

Runs ../nxd_tags/load_check.py (NxD trainer/checkpoint.py load_checkpoint on every rank, see
its header for the environment) on the fixture's tag and on shardkit's re-cut of it, and
requires every rank to get the same model and optimizer entries with the same sha256 (the
lines differ only in the tag's path). Exit 0 when they match.

  NXD_SRC=... TORCH_XLA_SRC=... load_check.py RECUT [ORIGINAL]
      ORIGINAL defaults to qkv_tp4/base_adapter/step_2 (the shipped config).
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "..", "nxd_tags", "load_check.py")


def entries(tag):
    p = subprocess.run([sys.executable, CHECK, tag], capture_output=True, text=True)
    if p.returncode:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"load_check.py {tag} failed ({p.returncode})")
    return [line for line in p.stdout.splitlines() if not line.startswith("# load_check ")], p.stdout


def main():
    recut = sys.argv[1]
    original = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "qkv_tp4", "base_adapter", "step_2")
    a, out = entries(original)
    b, _ = entries(recut)
    print(out)
    if sorted(a) != sorted(b):
        for line in sorted(set(a) ^ set(b)):
            print("DIFFERS:", line)
        print("# result: NxD loads other values from shardkit's re-cut")
        return 1
    print(f"# result: OK, NxD's load_checkpoint gives every rank the same {len(a)} lines from shardkit's re-cut")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""xser against plain .pt: ckpt-reshard and ckpt-export of the same tag in both
containers, and cp -r + sync of the xser tag's bytes, in one run.

  python3 benchmarks/xser.py [--gib 1] [--runs 1] [--build build] [--dir /tmp]

Source: benchmarks/reshard.py's NxD tag (Llama, bf16 weights, ZeRO-1 AdamW with
fp32 master weights), tp 4 pp 2 dp 2, about --gib, written by torch; its xser
twin is made from it by ckpt-reshard --save_xser at the same layout (one
tensor_<tid>.pt per tensor, X.pt of references, info.pt, as NxD's use_xser
writes; checked byte-equal in tests/interop/upstream_tags.py).

Per container, each run from a cold page cache:
  - ckpt-reshard --no_verify to tp 2 pp 4 dp 1 (ZeRO-1), in the source's container,
    and from xser to plain .pt (what reading xser costs alone);
  - ckpt-export --no_verify to one HDF5 file;
  - cp -r + sync -f of the source in both containers (the disk's figures, and
    what many small files cost the disk itself).
The goal (#21): xser within 1.1x of plain .pt.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from reshard import DIVISIBLE, HEADS, PY, VOCAB, cold, parse_size, pick_model, timed, tree

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=1, help="best of N, interleaved")
    ap.add_argument("--memory_budget", default="512M")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--dir", default="/tmp")
    a = ap.parse_args()
    free = shutil.disk_usage(a.dir).free
    if a.gib * 2**30 * 4.5 > free:
        raise SystemExit(f"{a.dir}: {free / 2**30:.1f} GiB free; --gib {a.gib} needs about {a.gib * 4.5:.1f}")
    hidden, layers = pick_model(a.gib)
    reshard = os.path.join(a.build, "bin", "ckpt-reshard")
    export = os.path.join(a.build, "bin", "ckpt-export")
    hints = ["--heads", str(HEADS), "--kv_heads", str(HEADS), "--vocab_size", str(VOCAB), "--make_vocab_size_divisible_by", str(DIVISIBLE)]
    work = tempfile.mkdtemp(dir=a.dir, prefix="xser_bench_")
    try:
        plain, xser = os.path.join(work, "plain", "step_100"), os.path.join(work, "xser", "step_100")
        subprocess.run([PY, os.path.join(HERE, "reshard.py"), "--generate", plain, str(hidden), str(layers), "4", "2", "2"], check=True)
        subprocess.run([reshard, plain, xser, "--tp", "4", "--pp", "2", "--dp", "2", "--zero1", "--save_xser", "--no_verify", *hints],
                       check=True, capture_output=True)
        sources = {"plain .pt": plain, "xser": xser}
        for name, src in sources.items():
            t = tree(src)
            print(f"{name}: {len(t)} files, {sum(t.values()) / 2**30:.2f} GiB")
        out = os.path.join(work, "out")
        methods = {}
        for name, src in sources.items():
            methods[f"ckpt-reshard {name}"] = (src, [reshard, src, out, "--tp", "2", "--pp", "4", "--dp", "1", "--zero1", "--no_verify",
                                                     "--memory_budget", a.memory_budget, *hints])
            methods[f"ckpt-export {name}"] = (src, [export, src, out + ".h5", "--no_verify", *hints])
        methods["ckpt-reshard xser -> plain .pt"] = (xser, [reshard, xser, out, "--tp", "2", "--pp", "4", "--dp", "1", "--zero1",
                                                            "--no_verify", "--no_save_xser", "--memory_budget", a.memory_budget, *hints])
        methods["cp -r + sync -f (xser)"] = (xser, ["sh", "-c", 'cp -r "$1" "$2" && sync -f "$2"', "sh", xser, out])
        methods["cp -r + sync -f (plain .pt)"] = (plain, ["sh", "-c", 'cp -r "$1" "$2" && sync -f "$2"', "sh", plain, out])
        best = {}
        for _ in range(a.runs):
            for m, (src, args) in methods.items():
                cold(out if os.path.isdir(out) else out + ".h5", [os.path.join(src, f) for f in tree(src)])
                if os.path.exists(out + ".h5"):
                    os.remove(out + ".h5")
                secs, rss, _ = timed(args, work)
                best[m] = min(best.get(m, (1e18, 0)), (secs, rss))
                shutil.rmtree(out, ignore_errors=True)
        print(f"\n{'method':32s} {'seconds':>8s} {'peak RSS':>10s}")
        for m, (secs, rss) in best.items():
            print(f"{m:32s} {secs:8.2f} {rss / 2**20:6.0f} MiB")
        print()
        print(f"ckpt-reshard reading xser, writing plain / plain .pt time "
              f"{best['ckpt-reshard xser -> plain .pt'][0] / best['ckpt-reshard plain .pt'][0]:.2f}")
        cp_ratio = best["cp -r + sync -f (xser)"][0] / best["cp -r + sync -f (plain .pt)"][0]
        print(f"the disk's own cost of the container: cp -r + sync, xser / plain .pt time {cp_ratio:.2f}")
        for job in ("ckpt-reshard", "ckpt-export"):
            ratio = best[f"{job} xser"][0] / best[f"{job} plain .pt"][0]
            print(f"{job}: xser / plain .pt time {ratio:.2f} (goal <= 1.1); "
                  f"cp -r + sync of the xser bytes / xser time {best['cp -r + sync -f (xser)'][0] / best[f'{job} xser'][0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

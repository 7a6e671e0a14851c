"""ckpt-export and ckpt-import speed and memory against cp and Python, in one run.

  python3 benchmarks/export.py [--gib 2] [--runs 1] [--build build] [--dir /tmp] [--keep]

Input: the NxD tag benchmarks/reshard.py builds (bf16 Llama, ZeRO-1 AdamW
with fp32 master weights, no manifest) at tp 2, pp 2, dp 2, about --gib.
From a cold page cache each (drop_caches as root, else POSIX_FADV_DONTNEED):
  export  - ckpt-export SRC OUT.h5 (durable: fsynced, renamed);
          - baseline: one Python process that torch.loads every rank file,
            merges them to full tensors (NxD's converter's merge) and writes
            the same datasets with h5py, fsynced;
          - cp -r of the source then sync -f: the physical limit.
  import  - ckpt-import OUT.h5 DST --tp 1 --pp 2 --dp 1 --zero1;
          - baseline: h5py reads every dataset whole, splits and torch.saves
            the rank files (the same split as reshard.py's baseline), fsynced;
          - cp of the .h5 then sync -f.
Throughput is bytes written / wall time; ratios are against cp and the
baseline of the same run. Peak RSS is the child's (os.wait4).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reshard as rb  # noqa: E402  (the generator, merge and split of the reshard benchmark)

PY = rb.PY
SOURCE = (2, 2, 2)
TARGET = ["--tp", "1", "--pp", "2", "--dp", "1", "--zero1"]
FIELDS = ("exp_avg", "exp_avg_sq", "master")


def export_baseline(src, out):
    import h5py
    import torch
    full, _, _ = rb.merge_source(src)
    with h5py.File(out, "w") as f:
        for n, x in full.items():
            for what, v in x.items():
                if rb.module(n) in ("word_embeddings", "output_layer"):
                    v = v[:rb.VOCAB]
                data = v.contiguous().view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()
                f.create_dataset(f"model/{n}" if what == "param" else f"optim/{n}/{what}", data=data)
    rb.fsync(out)


def import_baseline(h5, src, dst):
    import h5py
    import numpy as np
    import torch
    full, layers = {}, 0
    with h5py.File(h5, "r") as f:
        for n in f["model"]:
            x = {"param": torch.from_numpy(f[f"model/{n}"][()].view(np.int16)).view(torch.bfloat16)}
            for what in FIELDS:
                x[what] = torch.from_numpy(f[f"optim/{n}/{what}"][()])
            full[n] = x
            if ".layers." in n:
                layers = max(layers, int(n.split(".layers.")[1].split(".")[0]) + 1)
    step = torch.tensor(float(rb.STEP))
    rb.save_layout(full, layers, step, src, dst, 1, 2, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=1, help="best of N, interleaved")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--export-baseline", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--import-baseline", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.export_baseline:
        return export_baseline(*a.export_baseline)
    if a.import_baseline:
        return import_baseline(*a.import_baseline)

    hidden, layers = rb.pick_model(a.gib)
    hints = ["--heads", str(rb.HEADS), "--kv_heads", str(rb.HEADS), "--vocab_size", str(rb.VOCAB),
             "--make_vocab_size_divisible_by", str(rb.DIVISIBLE)]
    export_tool, import_tool = (os.path.join(a.build, "tools", t) for t in ("ckpt-export", "ckpt-import"))
    work = tempfile.mkdtemp(dir=a.dir, prefix="export_bench_")
    try:
        src = os.path.join(work, "step_100")
        subprocess.run([PY, rb.__file__, "--generate", src, str(hidden), str(layers), *map(str, SOURCE)], check=True)
        inputs = rb.tree(src)
        files = [os.path.join(src, f) for f in inputs]
        print(f"model: Llama, hidden {hidden}, {layers} layers, vocab {rb.VOCAB}; source tp2 pp2 dp2 ZeRO-1 with fp32 masters, "
              f"{len(inputs)} files, {sum(inputs.values()) / 2**30:.2f} GiB; {os.cpu_count()} cores, best of {a.runs}")
        h5, out = os.path.join(work, "state.h5"), os.path.join(work, "out")
        # The import reads a file ckpt-export wrote; its baseline reads the same.
        subprocess.run([export_tool, src, h5, *hints], check=True, capture_output=True)
        jobs = {
            "export": ([os.path.join(src, f) for f in inputs], {
                "ckpt-export": [export_tool, src, out, *hints, "--no_verify"],
                "python baseline (torch + h5py)": [PY, __file__, "--export-baseline", src, out],
                "cp -r + sync -f": ["sh", "-c", 'cp -r "$1" "$2" && sync -f "$2"', "sh", src, out]}),
            "import": ([h5], {
                "ckpt-import": [import_tool, h5, out, *TARGET],
                "python baseline (h5py + torch)": [PY, __file__, "--import-baseline", h5, src, out],
                "cp + sync -f": ["sh", "-c", 'cp "$1" "$2" && sync -f "$2"', "sh", h5, out]}),
        }
        rows, summary = [], []
        for job, (job_inputs, methods) in jobs.items():
            best, written = {}, {}
            for _ in range(a.runs):
                for m, args in methods.items():
                    rb.cold(out, job_inputs)
                    secs, rss, _ = rb.timed(args, work)
                    written[m] = os.path.getsize(out) if os.path.isfile(out) else sum(rb.tree(out).values())
                    old = best.get(m, (1e18, 0))
                    best[m] = (min(old[0], secs), max(old[1], rss))
            shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else os.path.exists(out) and os.remove(out)
            ours, base, cp = list(methods)
            thr = {m: written[m] / best[m][0] for m in methods}
            for m, (secs, rss) in best.items():
                rows.append((job, m, secs, thr[m] / 2**30, rss))
            summary.append(f"{job}: throughput / cp {thr[ours] / thr[cp]:.2f}, speed / baseline {best[base][0] / best[ours][0]:.1f}x, "
                           f"peak RSS {best[ours][1] / 2**20:.0f} MiB (baseline {best[base][1] / 2**20:.0f} MiB); "
                           f"{written[ours] / 2**30:.2f} GiB written")
        print(f"\n{'job':7s} {'method':32s} {'seconds':>8s} {'GiB/s':>7s} {'peak RSS':>10s}")
        for job, m, secs, rate, rss in rows:
            print(f"{job:7s} {m:32s} {secs:8.2f} {rate:7.2f} {rss / 2**20:6.0f} MiB")
        print("\n" + "\n".join(summary))
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

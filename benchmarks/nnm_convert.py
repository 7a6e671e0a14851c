"""nnm2nxdt-ckpt speed and memory against what users run today, in one run.

  python3 benchmarks/nnm_convert.py [--layers 4] [--runs 2] [--build build] [--dir DIR]

Input: a synthetic NNM checkpoint (tests/interop/nnm_fixture.py), tp=4 pp=2,
hidden 2048, ffn 5504, vocab 32000, with AdamW state from a real torch step:
about 4 GiB in 8 rank files with --layers 4.

  - shardkit: nnm2nxdt-ckpt, every file fsynced, manifest, done.
  - baseline: what NxDT's converter does, in Python with a process pool of the
    same width (2): per rank file torch.load, rename the keys, torch.save the
    model (and, to do the same job as ours, the optimizer state), fsync.
  - cp -r of the inputs followed by sync: the physical limit.
  - other degrees (tp 8 pp 1): nnm2nxdt-ckpt in one pass, against converting
    at NNM's degrees and then ckpt-reshard (two passes, an intermediate tag).
Each run starts with the page cache dropped (as root). Peak RSS is the
maximum resident set of the converting processes (wait4 / RUSAGE_CHILDREN).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench_util import settle

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))

BASELINE = r'''
import os, re, sys, torch
from concurrent.futures import ProcessPoolExecutor
def fsync(p):
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
def one(job):
    src, out, t, p, n_per_stage = job
    ck = torch.load(src)
    model = {}
    for k, v in ck["state_dict"].items():
        if not isinstance(v, torch.Tensor):
            continue
        k = k.replace("model.language_model", "language_model")
        k = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + p * n_per_stage}.", k, count=1)
        model[k] = v
    name = f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
    for sub, obj in (("model", model), ("optim", ck["optimizer_states"][0])):
        path = os.path.join(out, sub, name)
        torch.save(obj, path)
        fsync(path)
    if t == 0 and p == 0:
        for f, obj in (("user_content.pt", {"global_step": ck["global_step"], "epoch": ck["epoch"]}),
                       ("scheduler.pt", ck["lr_schedulers"][0])):
            torch.save(obj, os.path.join(out, f))
            fsync(os.path.join(out, f))
src, out, tp, pp, layers, name = sys.argv[1:]
tp, pp, layers = int(tp), int(pp), int(layers)
os.makedirs(os.path.join(out, "model")); os.makedirs(os.path.join(out, "optim"))
jobs = [(os.path.join(src, f"tp_rank_{t:02d}_pp_rank_{p:03d}", name), out, t, p, layers // pp) for p in range(pp) for t in range(tp)]
with ProcessPoolExecutor(2) as ex:
    list(ex.map(one, jobs))
'''


def timed(args):
    """Wall time and peak RSS (bytes) of a command and all its children."""
    t0 = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{args[0]} failed: {p.stderr.read().decode()}")
    p.stderr.close()
    return secs, ru.ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--before", default=None, help="another build whose nnm2nxdt-ckpt runs interleaved (before and after a change)")
    ap.add_argument("--generate", nargs=2, metavar=("DIR", "LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.generate:  # in a child, so the timed processes do not fork from a parent holding the model
        from nnm_fixture import make_nnm
        c = dict(hidden=2048, ffn=5504, heads=16, kv_heads=16, layers=int(a.generate[1]), vocab=32000, seq=8, gpt=False)
        # One process's run cut as NNM saves it, so replicas are equal (a re-cut compares them).
        full, _ = make_nnm(None, c, steps=1, write=False)
        print(make_nnm(a.generate[0], c, tp=4, pp=2, steps=1, from_full=full[(0, 0)])[1])
        return

    work = tempfile.mkdtemp(dir=a.dir, prefix="nnm_bench_")
    try:
        nnm = os.path.join(work, "nnm")
        t0 = time.perf_counter()
        name = subprocess.run([sys.executable, __file__, "--generate", nnm, str(a.layers)], check=True,
                              capture_output=True, text=True).stdout.strip()
        files = [os.path.join(d, f) for d, _, fs in os.walk(nnm) for f in fs]
        total, largest = sum(map(os.path.getsize, files)), max(map(os.path.getsize, files))
        print(f"input: {len(files)} files, {total / 2**30:.2f} GiB (largest {largest / 2**20:.0f} MiB), "
              f"made in {time.perf_counter() - t0:.0f} s")
        script = os.path.join(work, "baseline.py")
        with open(script, "w") as f:
            f.write(BASELINE)
        ours_out, base_out, cp_out, one_out, two_out = (os.path.join(work, n) for n in ("ours.ckpt", "base.ckpt", "cp", "one.ckpt", "two.ckpt"))
        convert = os.path.join(a.build, "bin", "nnm2nxdt-ckpt")
        reshard = os.path.join(a.build, "bin", "ckpt-reshard")
        jobs = {
            "shardkit nnm2nxdt-ckpt": (ours_out, [convert, "--tp", "4", "--pp", "2", "--n_layers", str(a.layers),
                                                  "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", ours_out]),
            **({"before: nnm2nxdt-ckpt": (ours_out + ".before", [os.path.join(a.before, "bin", "nnm2nxdt-ckpt"), "--nnm_ckpt_path", nnm,
                                                                  "--nxdt_ckpt_path", ours_out + ".before"])} if a.before else {}),
            "python baseline (pool of 2)": (base_out, ["/usr/bin/python3", script, nnm, base_out, "4", "2", str(a.layers), name]),
            "cp -r + sync": (cp_out, ["sh", "-c", f"cp -r {nnm} {cp_out} && sync"]),
            "tp8 pp1: one pass": (one_out, [convert, "--tp", "8", "--pp", "1", "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", one_out,
                                             "--memory_budget", "1G"]),
            "tp8 pp1: convert + reshard": (two_out, ["sh", "-c", f"{convert} --nnm_ckpt_path {nnm} --nxdt_ckpt_path {two_out}.mid && "
                                                     f"{reshard} {two_out}.mid {two_out} --tp 8 --pp 1 --memory_budget 1G && "
                                                     f"rm -rf {two_out}.mid"]),
        }
        results = {k: (1e9, 0) for k in jobs}
        for _ in range(a.runs):  # interleaved, best time of each
            for k, (out, args) in jobs.items():
                settle(out)
                secs, rss = timed(args)
                results[k] = (min(results[k][0], secs), max(results[k][1], rss))
        print(f"{'job':30s} {'time':>8s} {'GiB/s':>7s} {'peak RSS':>10s}")
        for k, (secs, rss) in results.items():
            print(f"{k:30s} {secs:7.2f}s {total / 2**30 / secs:7.2f} {rss / 2**20:8.0f} MiB")
        ours, base, cp, one, two = (results[k][0] for k in jobs if not k.startswith("before"))
        if a.before:
            print(f"before: {results['before: nnm2nxdt-ckpt'][0]:.2f} s, {cp / results['before: nnm2nxdt-ckpt'][0]:.2f} of cp")
        rss = results["shardkit nnm2nxdt-ckpt"][1]
        print(f"speed-up over the baseline: {base / ours:.1f}x (target >= 5x)")
        print(f"throughput vs cp: {cp / ours:.2f} of cp (target >= 0.70)")
        print(f"peak RSS / largest input file: {rss / largest:.2f} (target <= 1.2)")
        print(f"other degrees: one pass {one:.2f} s, {cp / one:.2f} of cp; convert + reshard {two:.2f} s "
              f"({two / one:.2f}x the one pass); one-pass peak RSS {results['tp8 pp1: one pass'][1] / 2**20:.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

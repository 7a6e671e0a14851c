"""Checkpoint write/read throughput: shardkit vs torch.save/torch.load vs cp,
on the same content in the same run.

  python3 benchmarks/pt_io.py [--mib 3072] [--build build] [--dir DIR]

Every timed run starts from the same state: its output removed, `sync`, the
page cache dropped (as root; otherwise skipped, and the figures get noisier),
and for reads the input read once so it is cached. Every writer makes its
file durable (fsync) before the clock stops: SavePt does so itself;
torch.save and cp are followed by an fsync of their output. Ours reads by
mapping and touches every byte (XXH3 over every storage); torch.load copies
every byte into fresh tensors; cp reads every byte and writes it again.
Times are the best of --runs.
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import torch

from bench_util import settle


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def best(fn, n, prepare):
    times = []
    for _ in range(n):
        prepare()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=3072)
    ap.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        env = dict(os.environ, SHARDKIT_BENCH_MIB=str(args.mib), SHARDKIT_BENCH_DIR=d)
        out = subprocess.run([os.path.join(args.build, "bin", "pt_io_bench"), "--benchmark_format=json"],
                             env=env, check=True, capture_output=True, text=True).stdout
        res = {b["name"].split("/")[0]: b for b in json.loads(out)["benchmarks"]}
        ours = os.path.join(d, "ours.pt")
        size = os.path.getsize(ours)
        our_write = res["BM_SavePt"]["real_time"] / 1e3
        our_read = res["BM_LoadPtTouchAll"]["real_time"] / 1e3

        obj = torch.load(ours)  # the same content, as torch objects
        theirs = os.path.join(d, "torch.pt")

        def torch_save():
            torch.save(obj, theirs)
            fsync(theirs)

        torch_write = best(torch_save, args.runs, lambda: settle(remove=theirs))
        del obj
        torch_read = best(lambda: torch.load(theirs), args.runs, lambda: settle(warm=theirs))

        copy = os.path.join(d, "copy.pt")

        def cp():
            subprocess.run(["cp", ours, copy], check=True)
            fsync(copy)

        cp_time = best(cp, args.runs, lambda: settle(remove=copy, warm=ours))
        gib = size / 2**30
        rows = [("shardkit SavePt", our_write), ("torch.save", torch_write), ("cp + fsync", cp_time),
                ("shardkit LoadPt + XXH3 every byte", our_read), ("torch.load", torch_read)]
        print(f"checkpoint: {gib:.2f} GiB, {len(torch.load(ours, map_location='cpu'))} tensors; best of {args.runs}")
        for name, t in rows:
            print(f"  {name:36s} {t:7.2f} s  {gib / t:6.2f} GiB/s")
        print(f"write: {cp_time / our_write:.2f}x cp throughput, {torch_write / our_write:.1f}x faster than torch.save")
        print(f"read:  {cp_time / our_read:.2f}x cp throughput, {torch_read / our_read:.1f}x faster than torch.load")


if __name__ == "__main__":
    main()

"""The scale benchmark's claims for a Mixtral tag (issue #38): a few layers of
Mixtral-8x7B's shapes (hidden 4096, 8 experts of FFN 14336, top 2, 32 heads,
8 KV heads, vocab 32000, bf16) as an HF-style NxD tag, each job timed against
the concurrent-dd limit and its peak RSS asserted against the budget.

  python3 benchmarks/scale_mixtral.py [--layers 1] [--small] [--build build] [--dir /tmp]
                                      [--threads N] [--memory_budget 512M]

Steps (benchmarks/scale.py's Bench: cold cache, wall time, peak RSS, bytes,
dd and cp limits measured right after each job on the same bytes):
  - a MixtralForCausalLM folder of random bf16 values (scale.py's generator);
  - ckpt-import --format hf --model_source hf: the folder -> tp 8, ep 1 (xser);
  - ckpt-reshard: tp 8 ep 1 -> tp 4 ep 2 (dp 2: NxD's ep groups lie inside dp),
    then that tag back to tp 8 ep 1;
  - ckpt-export --format hf: the tp 8 ep 1 tag -> a MixtralForCausalLM folder.

Memory: each job's peak RSS must be within the budget plus one chunk of the
largest tensor (a chunk is at most 64 MiB: ckpt/shard/stream_budget.h), and
for the export, whose expert matrices are transposed (w1, w3 from
gate_up_proj[e], w2 from down_proj[e]: tools/hf_export.h), within the budget
plus one expert matrix, held whole while it is written. Every job's line says
"within" or "OVER" its bound, and the benchmark exits 1 when one is over.

Disk: the tags are the model's size M (1 layer: 3.4 GB; each more layer 2.9
GB), and at most four are alive at once (the tp 8 tag, the ep 2 tag, the
scratch file and dd's output, or the copy for cp), so 1 layer needs about 14
GB, 2 layers about 26 GB; a need the free disk does not hold is refused
before anything is written. --small runs the same steps on a tiny model
(hidden 256, FFN 512, 2 layers, vocab 1024) in seconds, as the interop test
scale_mixtral does.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from reshard import parse_size
from scale import GEN_HF, PY, Bench

HEADS, KV, EXPERTS, TOP_K = 32, 8, 8, 2
MIXTRAL_8X7B = dict(hidden=4096, ffn=14336, vocab=32000)
SMALL = dict(hidden=256, ffn=512, vocab=1024)
MAX_CHUNK = 64 << 20  # ckpt/shard/stream_budget.h kMaxStreamChunk


def model_bytes(hidden, ffn, vocab, layers):
    """bf16 bytes of the model: embedding and output layer, attention, router and experts, norms."""
    kv = hidden // HEADS * KV
    layer = 2 * hidden * hidden + 2 * kv * hidden + EXPERTS * hidden + EXPERTS * 3 * hidden * ffn + 2 * hidden
    return 2 * (2 * vocab * hidden + layers * layer + hidden)


class MixtralBench(Bench):
    def __init__(self, a, work, shape):
        super().__init__(a, work)
        self.shape = shape
        self.budget = parse_size(a.memory_budget)
        s = shape
        # Bytes of the largest tensor one chunk of which a streaming job holds (the experts' gate_up_proj,
        # E x H x 2F), and of one expert matrix (H x F), which the export holds whole.
        self.largest = 2 * EXPERTS * s["hidden"] * 2 * s["ffn"]
        self.expert_matrix = 2 * s["hidden"] * s["ffn"]
        self.over = []

    def measured(self, command, argv, src, out, keep=False):
        self.job("mixtral", "hf", command, argv, src, out, 0, keep=keep)
        rss = self.rows[-1][6]
        extra = self.expert_matrix if command == "ckpt-export" else min(self.largest, MAX_CHUNK)
        bound = self.budget + extra
        ok = rss <= bound
        print(f"      peak RSS {rss / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB (budget {self.budget / 2**20:.0f} + "
              f"{'one expert matrix' if command == 'ckpt-export' else 'one chunk'} {extra / 2**20:.2f}): {'within' if ok else 'OVER'}",
              flush=True)
        if not ok:
            self.over.append(command)
        return out

    def steps(self, layers):
        s, d = self.shape, self.work
        hf, tag, ep2, back, export = (os.path.join(d, n) for n in ("hf_folder", "tp8_ep1", "tp4_ep2", "back", "export"))
        subprocess.run([PY, "-c", GEN_HF, hf, *map(str, (s["hidden"], s["ffn"], layers, HEADS, KV, s["vocab"], EXPERTS, TOP_K))], check=True)
        self.measured("ckpt-import", [hf, tag, "--format", "hf", "--model_source", "hf", "--tp", 8, "--pp", 1, "--save_xser", *self.engine],
                      hf, tag, keep=True)
        self.remove(hf)
        self.measured("ckpt-reshard", [tag, ep2, "--tp", 4, "--pp", 1, "--ep", 2, "--dp", 2, *self.engine], tag, ep2, keep=True)
        self.measured("ckpt-reshard", [ep2, back, "--tp", 8, "--pp", 1, "--ep", 1, "--dp", 1, *self.engine], ep2, back)
        self.remove(ep2)
        self.measured("ckpt-export", [tag, export, "--format", "hf", *self.engine], tag, export)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=1, help="MoE layers (default 1: about 14 GB of disk at Mixtral-8x7B's shapes)")
    ap.add_argument("--small", action="store_true", help="a tiny model of the same structure (seconds; the interop test's)")
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int, default=0, help="--threads of the tools (default: theirs, every core)")
    ap.add_argument("--memory_budget", default="512M")
    a = ap.parse_args()
    a.keep = False
    shape = SMALL if a.small else MIXTRAL_8X7B
    m = model_bytes(**shape, layers=a.layers)
    need, free = 4 * m, shutil.disk_usage(a.dir).free
    if need > free:
        raise SystemExit(f"{a.layers} layer(s) need about {need / 2**30:.1f} GiB of disk; {a.dir} has {free / 2**30:.1f} GiB free")
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print("note: not root: the page cache is not dropped between jobs (the figures are warm-cache ones)")
    work = tempfile.mkdtemp(prefix="scale_mixtral_", dir=a.dir)
    b = MixtralBench(a, work, shape)
    print(f"-- Mixtral {'(small)' if a.small else '8x7B shapes'}: {a.layers} layer(s), {EXPERTS} experts, "
          f"{m / 2**30:.2f} GiB bf16, budget {a.memory_budget}", flush=True)
    try:
        b.steps(a.layers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if b.over:
        print(f"peak RSS over its bound: {', '.join(b.over)}")
        sys.exit(1)
    print("every job's peak RSS within its bound")


if __name__ == "__main__":
    main()

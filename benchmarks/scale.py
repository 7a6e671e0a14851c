"""How time and memory scale with the model (issue #40): ckpt-reshard,
ckpt-import and ckpt-export at several sizes, each against the disk's limit
measured in the same run, with fits and a projection to a 405B tag.

  python3 benchmarks/scale.py [--sizes 0.1B,1B,7B] [--optimizer_sizes 1B] [--build build]
                              [--dir /tmp] [--threads N] [--memory_budget 512M] [--keep]

Tags, per size (Llama-shaped: 32 heads, 8 KV heads, vocab 32000, bf16; hidden,
FFN and layers by size, 0.1B: 1024/2816/4, 1B: 2048/5632/20, 7B: 4096/11008/32),
weights only:
  - hf: an HF-style NxDT tag as NxD lays it out for Trn1 at tp 32 with
    kv_size_multiplier 4 (fused QKV, xser), imported by ckpt-import from a
    Hugging Face folder (model.safetensors, written here from random bits);
  - megatron: the same weights as a Megatron-style (NNM/NxDT megatron names)
    xser tag at tp 4 (ckpt-import --model_source megatron).
And per --optimizer_sizes: a Megatron-style tag at tp 8, dp 2 with ZeRO-1
AdamW state and fp32 master weights (benchmarks/reshard.py's generator; 14
bytes a parameter).

Jobs, each from a cold page cache (sync; drop_caches as root):
  - ckpt-reshard: to tp 8 pp 4 (the hf tag also to kv_size_multiplier 1; the
    optimizer tag to dp 1 instead, a dp change, checked with ckpt-verify --against);
  - ckpt-import: the HF folder -> the tag (hf, megatron); for the optimizer
    tag, its ckpt-export .h5 -> a tag;
  - ckpt-export: the tag -> a Hugging Face folder (the optimizer tag: -> .h5).
Each reports wall time, peak RSS (os.wait4; this process holds no torch),
bytes read and written (the child's ru_inblock/ru_oublock, from the disk), and
its time against two limits measured right after it on the same bytes:
  - dd: two dd processes at once, one reading the job's bytes of a scratch
    file with O_DIRECT, one writing the job's output bytes with O_DIRECT;
  - cp: cp -r of the job's source, then sync -f.
Then least-squares fits: time against bytes moved (read + written) per
command, and peak RSS against the source's size; and, from them, the 405B
tag's (405e9 parameters at 14 bytes: about 5.7 TB read and written) time and
peak memory on this disk.

Disk: each job's output is deleted as soon as it is measured (and, for the
optimizer tag, verified), before its dd and cp limits run; the HF folder once
the last import from it is measured; each tag once its jobs are. A dry pass
over the same steps, with estimated sizes, finds the most bytes alive at once
(the scratch file included), and a size that does not fit the free disk is
skipped, and said so. That peak is about 4.4 times the bf16 model for a
weights size (the HF folder, the HF-style tag, the scratch file and dd's
output at once: 7B (5.9e9 parameters) needs about 49 GiB, 1B 8.4 GiB) and 4
times the optimizer tag (the tag, its .h5 export, the scratch file and dd's
output: 1B needs about 61 GiB). --keep keeps the HF folders and tags (outputs are
still deleted), and the need counts them.
"""
import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench_util import settle
from reshard import BYTES_PER_PARAM, model_params, parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/usr/bin/python3"
HEADS, KV, VOCAB = 32, 8, 32000
SIZES = {"0.1B": (1024, 2816, 4), "1B": (2048, 5632, 20), "7B": (4096, 11008, 32)}
# reshard.py's tags record no format: its model's, as reshard.py gives them.
OPTIM_HINTS = ["--heads", 16, "--kv_heads", 16, "--vocab_size", 32000, "--make_vocab_size_divisible_by", 128]
BYTES_405B = 405e9 * 14  # bf16 weight, fp32 master, exp_avg, exp_avg_sq

# Writes a Hugging Face Llama folder of random bf16 values, a tensor in memory at a time (numpy: no torch here);
# with EXPERTS and TOP_K after the sizes, a MixtralForCausalLM folder (every layer's MLP HF's block_sparse_moe).
GEN_HF = r'''
import json, os, sys
import numpy as np
out, H, F, L, heads, kv, V, *moe = sys.argv[1], *map(int, sys.argv[2:])
E, top_k = moe or (0, 0)
hd = H // heads
shapes = {"model.embed_tokens.weight": (V, H)}
for i in range(L):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                   p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, H),
                   p + "post_attention_layernorm.weight": (H,)})
    if E:
        shapes[p + "block_sparse_moe.gate.weight"] = (E, H)
        for e in range(E):
            x = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({x + "w1.weight": (F, H), x + "w2.weight": (H, F), x + "w3.weight": (F, H)})
    else:
        shapes.update({p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F)})
shapes.update({"model.norm.weight": (H,), "lm_head.weight": (V, H)})
header, at = {}, 0
for k, s in shapes.items():
    n = int(np.prod(s)) * 2
    header[k] = {"dtype": "BF16", "shape": list(s), "data_offsets": [at, at + n]}
    at += n
text = json.dumps(header).encode()
os.makedirs(out)
rng = np.random.default_rng(0)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(len(text).to_bytes(8, "little") + text)
    for k, s in shapes.items():
        x = (rng.standard_normal(s, dtype=np.float32) * 0.02).view(np.uint32)
        f.write((x >> 16).astype(np.uint16).tobytes())  # bf16: the top half of float32
        del x
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": F,
          "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": L, "vocab_size": V,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
if E:
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=E, num_experts_per_tok=top_k)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f)
'''


def die_with_parent():
    """In a child before exec: the kernel sends it SIGTERM when this process ends (prctl
    PR_SET_PDEATHSIG), so a killed benchmark leaves no generator writing into a folder its
    caller may remove (the 7B run's FileNotFoundError for config.json: an orphaned generator
    that wrote the 12 GB safetensors file into a removed folder, then could not create the next file)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


CHILD = {"preexec_fn": die_with_parent}


def stop_on_signal(signum, _frame):
    """SIGTERM or SIGHUP ends the run through `finally` (a child is killed by subprocess, the work folder removed)."""
    raise SystemExit(f"stopped by signal {signal.Signals(signum).name}")


def require_files(folder, names):
    """Each of `names` exists in `folder`, or exit naming the first that does not."""
    for n in names:
        if not os.path.isfile(os.path.join(folder, n)):
            raise SystemExit(f"{os.path.join(folder, n)}: missing after its generator exited 0 (was {folder} removed meanwhile?)")


def tree_bytes(root):
    if os.path.isfile(root):
        return os.path.getsize(root)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def params(hidden, ffn, layers, kv=KV):
    kvw = hidden // HEADS * kv
    return 2 * VOCAB * hidden + layers * (2 * hidden * hidden + 2 * kvw * hidden + 3 * hidden * ffn + 2 * hidden) + hidden


def run(cmd, check=True):
    """(seconds, peak RSS, bytes read, bytes written) of a child, from os.wait4."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **CHILD)
    err = p.stderr.read().decode(errors="replace")
    _, status, ru = os.wait4(p.pid, 0)
    if check and status != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed: {err[-3000:]}")
    return time.time() - t0, ru.ru_maxrss * 1024, ru.ru_inblock * 512, ru.ru_oublock * 512


def dd_limit(scratch, read_bytes, write_bytes, out):
    """Seconds for two dd at once: O_DIRECT reads of `read_bytes` of `scratch`, O_DIRECT writes of `write_bytes` to `out`."""
    mib = 1 << 20
    settle(out)
    t0 = time.time()
    r = subprocess.Popen(["dd", f"if={scratch}", "of=/dev/null", "iflag=direct", "bs=4M", f"count={-(-read_bytes // (4 * mib))}"],
                         stderr=subprocess.DEVNULL, **CHILD)
    w = subprocess.Popen(["dd", "if=/dev/zero", f"of={out}", "oflag=direct", "bs=4M", f"count={-(-write_bytes // (4 * mib))}",
                          "conv=fsync"], stderr=subprocess.DEVNULL, **CHILD)
    if r.wait() or w.wait():
        raise SystemExit("dd failed")
    secs = time.time() - t0
    os.remove(out)
    return secs


def cp_limit(src, work):
    copy = os.path.join(work, "copy")
    settle(copy)
    secs = run(["sh", "-c", f"cp -r {src} {copy} && sync -f {copy}"])[0]
    shutil.rmtree(copy) if os.path.isdir(copy) else os.remove(copy)
    return secs


def fit(xs, ys):
    """Least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


class Bench:
    def __init__(self, a, work):
        self.a, self.work = a, work
        self.bin = lambda name: os.path.join(a.build, "bin", name)
        self.engine = ["--memory_budget", a.memory_budget] + (["--threads", str(a.threads)] if a.threads else [])
        self.scratch = os.path.join(work, "scratch")
        self.rows = []  # (size label, tag kind, command, source bytes, seconds, rss, read, written, dd s, cp s)
        self.dry = None  # a dry pass's {path: estimated bytes} alive on disk, or None when running

    def dry_peak(self, steps):
        """The most bytes beyond what is on disk now that `steps()` (a size's) holds at once, from estimated sizes."""
        self.dry = {self.scratch: os.path.getsize(self.scratch) if os.path.exists(self.scratch) else 0}
        self.peak = now = sum(self.dry.values())
        try:
            steps()
        finally:
            self.dry = None
        return self.peak - now

    def made(self, path, nbytes):
        """Dry pass: `path` now holds `nbytes`."""
        self.dry[path] = nbytes
        self.peak = max(self.peak, sum(self.dry.values()))

    def remove(self, path, is_input=False):
        """Deletes a file or folder; an input (HF folder, tag) stays with --keep."""
        if is_input and self.a.keep:
            return
        if self.dry is not None:
            self.dry.pop(path, None)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    def scratch_file(self, nbytes):
        """A file of at least `nbytes` for dd to read."""
        have = os.path.getsize(self.scratch) if os.path.exists(self.scratch) else 0
        if have < nbytes:
            subprocess.run(["dd", "if=/dev/urandom", f"of={self.scratch}", "bs=4M", f"count={-(-nbytes // (4 << 20))}", "oflag=direct"],
                           check=True, stderr=subprocess.DEVNULL, **CHILD)

    def job(self, label, kind, command, argv, src, out, estimate, keep=False, check=None):
        """Runs `command` from a cold cache and measures it, then its dd and cp limits. Its output
        (`estimate` bytes in a dry pass) is deleted once measured and `check(out)` ran, unless `keep`."""
        if self.dry is not None:
            src_bytes = self.dry[src]
            self.made(out, estimate)
            if not keep:
                self.remove(out)
            self.made(self.scratch, max(self.dry[self.scratch], src_bytes))
            for scratch, nbytes in (("dd.out", estimate), ("copy", src_bytes)):
                self.made(scratch, nbytes)
                self.remove(scratch)
            return out
        settle(out)
        secs, rss, rd, wr = run([self.bin(command), *map(str, argv)])
        src_bytes, out_bytes = tree_bytes(src), tree_bytes(out)
        if check:
            check(out)
        if not keep:
            self.remove(out)
        self.scratch_file(src_bytes)
        dd = dd_limit(self.scratch, src_bytes, out_bytes, os.path.join(self.work, "dd.out"))
        cp = cp_limit(src, self.work)
        row = (label, kind, command, src_bytes, out_bytes, secs, rss, rd, wr, dd, cp)
        self.rows.append(row)
        print(f"{label:>5s} {kind:9s} {command:13s} {src_bytes / 2**30:7.2f} GiB -> {out_bytes / 2**30:6.2f} GiB "
              f"{secs:8.1f} s {rss / 2**20:7.0f} MiB  read {rd / 2**30:6.2f} GiB written {wr / 2**30:6.2f} GiB  "
              f"dd {dd:6.1f} s ({dd / secs:4.2f})  cp {cp:6.1f} s ({cp / secs:4.2f})", flush=True)
        return out

    def weights(self, label):
        hidden, ffn, layers = SIZES[label]
        # bf16 bytes: the HF folder, Megatron-style tag, outputs and exports; the HF-style tag holds its KV heads 4 times.
        model, hf_tag = 2 * params(hidden, ffn, layers), 2 * params(hidden, ffn, layers, kv=KV * 4)
        d = os.path.join(self.work, label)
        hf = os.path.join(d, "hf_folder")
        if self.dry is None:
            os.makedirs(d)
            subprocess.run([PY, "-c", GEN_HF, hf, str(hidden), str(ffn), str(layers), str(HEADS), str(KV), str(VOCAB)], check=True, **CHILD)
            require_files(hf, ["model.safetensors", "config.json"])
        else:
            self.made(hf, model)
        hf_args = ["--format", "hf", "--model_source", "hf", "--fuse_qkv", "true", "--qkv_linear", "true", "--kv_size_multiplier", "4",
                   "--tp", 32, "--pp", 1, "--save_xser"]
        meg_args = ["--format", "hf", "--tp", 4, "--pp", 1, "--save_xser"]
        for kind, args, reshard, tag_bytes in [("hf", hf_args, ["--out_kv_size_multiplier", 1], hf_tag), ("megatron", meg_args, [], model)]:
            tag = self.job(label, kind, "ckpt-import", [hf, os.path.join(d, kind), *args, *self.engine], hf, os.path.join(d, kind), tag_bytes,
                           keep=True)
            if kind == "megatron":
                self.remove(hf, is_input=True)  # its last import is measured
            self.job(label, kind, "ckpt-reshard", [tag, os.path.join(d, "out"), "--tp", 8, "--pp", 4, *reshard, *self.engine], tag,
                     os.path.join(d, "out"), model)
            self.job(label, kind, "ckpt-export", [tag, os.path.join(d, "export"), "--format", "hf", *self.engine],
                     tag, os.path.join(d, "export"), model)
            self.remove(tag, is_input=True)
        self.remove(d, is_input=True)

    def optimizer(self, label):
        hidden, ffn, layers = SIZES[label]
        optim = model_params(hidden, layers, 8) * BYTES_PER_PARAM  # the tag's and its exports' bytes
        d = os.path.join(self.work, label + "_optim")
        tag = os.path.join(d, "tag")
        if self.dry is None:
            os.makedirs(d)
            # reshard.py's generator: NxD's Megatron-style tag with ZeRO-1 AdamW state and fp32 masters, hidden from its table.
            subprocess.run([PY, os.path.join(HERE, "reshard.py"), "--generate", tag, str(hidden), str(layers), "8", "1", "2"], check=True, **CHILD)
        else:
            self.made(tag, optim)
        kind = "optimizer"

        def verify(out):
            v = subprocess.run([self.bin("ckpt-verify"), out, "--against", tag, *map(str, OPTIM_HINTS)], capture_output=True, text=True, **CHILD)
            print(f"      ckpt-verify --against: {'equal' if v.returncode == 0 else 'DIFFERS: ' + v.stdout[-500:] + v.stderr[-500:]}")

        self.job(label, kind, "ckpt-reshard", [tag, os.path.join(d, "out"), "--tp", 8, "--pp", 4, "--dp", 1, "--zero1", *OPTIM_HINTS,
                                               *self.engine], tag, os.path.join(d, "out"), optim, check=verify)
        h5 = self.job(label, kind, "ckpt-export", [tag, os.path.join(d, "state.h5"), *OPTIM_HINTS, "--memory_budget", self.a.memory_budget], tag,
                      os.path.join(d, "state.h5"), optim, keep=True)
        self.remove(tag, is_input=True)
        self.job(label, kind, "ckpt-import", [h5, os.path.join(d, "out"), "--tp", 8, "--pp", 1, "--dp", 2, "--zero1", *self.engine], h5,
                 os.path.join(d, "out"), optim)
        self.remove(h5, is_input=True)
        self.remove(d, is_input=True)

    def report(self):
        print("\nfits (least squares over every job above):")
        for command in ("ckpt-reshard", "ckpt-import", "ckpt-export"):
            rows = [r for r in self.rows if r[2] == command]
            if len(rows) < 2:
                continue
            a, b = fit([r[3] + r[4] for r in rows], [r[5] for r in rows])
            c, d = fit([r[3] for r in rows], [r[6] for r in rows])
            la, lb = fit([r[3] + r[4] for r in rows], [r[9] for r in rows])
            print(f"  {command}: time = {a:.2f} s + {b * 2**30:.3f} s/GiB moved (dd limit: {la:.2f} s + {lb * 2**30:.3f} s/GiB); "
                  f"peak RSS = {c / 2**20:.0f} MiB + {d * 2**30 / 2**20:.3f} MiB per GiB of source")
            moved = 2 * BYTES_405B
            # Peak RSS grows at small sizes only while tensors are smaller than a chunk; the budget
            # (plus one chunk, 64 MiB at most: ckpt/shard/reshard.cc) bounds it at any size.
            bound = parse_size(self.a.memory_budget) + (64 << 20)
            rss = min(c + d * BYTES_405B, bound)
            print(f"    405B tag ({BYTES_405B / 1e12:.1f} TB read and written): {(a + b * moved) / 3600:.1f} h "
                  f"(dd limit {(la + lb * moved) / 3600:.1f} h), peak RSS {rss / 2**20:.0f} MiB "
                  f"({'the fit' if rss < bound else 'the budget and a chunk: the fit gives ' + format((c + d * BYTES_405B) / 2**20, '.0f') + ' MiB'})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.1B,1B,7B", help="weights-only sizes, of " + ", ".join(SIZES))
    ap.add_argument("--optimizer_sizes", default="1B", help="sizes of the ZeRO-1 tag with fp32 masters (dp 2); '' for none")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int, default=0, help="--threads of the tools (default: theirs, every core)")
    ap.add_argument("--memory_budget", default="512M")
    ap.add_argument("--keep", action="store_true", help="leave the work folder, its HF folders and tags (job outputs are deleted)")
    a = ap.parse_args()
    sizes = [s for s in a.sizes.split(",") if s]
    optim = [s for s in a.optimizer_sizes.split(",") if s]
    for s in sizes + optim:
        if s not in SIZES:
            raise SystemExit(f"--sizes: '{s}' is not one of {', '.join(SIZES)}")
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print("note: not root: the page cache is not dropped between jobs (the figures are warm-cache ones)")
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signal)
    work = tempfile.mkdtemp(prefix="scale_", dir=a.dir)
    b = Bench(a, work)
    print(f"{'size':>5s} {'tag':9s} {'command':13s} {'source':>11s}    {'output':>10s} {'time':>10s} {'peak RSS':>11s}")
    try:
        for label, kind in [(s, "weights") for s in sizes] + [(s, "optimizer") for s in optim]:
            p = params(*SIZES[label])
            need = b.dry_peak(lambda: b.weights(label) if kind == "weights" else b.optimizer(label))
            free = shutil.disk_usage(work).free
            if need > free:
                print(f"skipped {label} ({kind}): needs about {need / 2**30:.0f} GiB of disk, {a.dir} has {free / 2**30:.0f} GiB free")
                continue
            print(f"-- {label} ({p / 1e9:.2f}B parameters, {kind})", flush=True)
            b.weights(label) if kind == "weights" else b.optimizer(label)
        b.report()
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

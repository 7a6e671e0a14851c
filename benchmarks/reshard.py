"""ckpt-reshard speed and memory against what users run today, in one run.

  python3 benchmarks/reshard.py [--gib 3] [--runs 1] [--build build] [--dir /tmp] [--keep]
                                [--memory_budget 512M] [--hidden auto]

Input: an NxD tag as torch writes it (bf16 model, ZeRO-1 AdamW state with fp32
master weights, no manifest), written rank file by rank file with random
values so the builder never holds more than one rank file: a Llama (16 heads,
vocab 32000 padded to a multiple of 128 * tp), hidden and layer count chosen
so the tag is about --gib (hidden 1024, 13 layers, 3.0 GiB by default). The
default size is cut to what the free disk holds (input + 2 outputs).

Two jobs, each on its own source tag:
  1. tp 4, pp 2, dp 2 (ZeRO-1) -> tp 2, pp 4, dp 1 (ZeRO-1)
  2. tp 8, pp 1, dp 1 (ZeRO-1) -> tp 2
and per job, each from a cold page cache (sync, drop_caches as root, else
POSIX_FADV_DONTNEED on every input file):
  - ckpt-reshard --no_verify, and ckpt-reshard as is (checks the source's
    CRC-32s first); every file fsynced, `done` last (checked here);
  - baseline: what NxD's checkpoint converter does, in one Python process:
    torch.load every source file (model and optimizer), merge to full
    tensors (ZeRO-1 shards concatenated and trimmed by shape_info, then the
    tensor-parallel merge), split for the target and torch.save every target
    file, optimizer state in the target's ZeRO-1 form, each fsynced. It
    holds the whole model, about twice the tag at its peak;
  - cp -r of the source then sync -f: the physical limit.
Time is wall time; GiB/s is bytes written / s; peak RSS is the child's
maximum resident set (os.wait4; this process holds no torch, so the
children do not inherit it).
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

from bench_util import settle

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/usr/bin/python3"  # Debian's torch

HEADS, VOCAB, DIVISIBLE, STEP = 16, 32000, 128, 100
FFN = {2048: 5632, 1024: 2816, 512: 1408, 256: 704}  # Llama's ~2.75 x hidden, divisible by tp 8
JOBS = [("tp4 pp2 dp2 -> tp2 pp4 dp1", (4, 2, 2), (2, 4, 1)),
        ("tp8 pp1 dp1 -> tp2 pp1 dp1", (8, 1, 1), (2, 1, 1))]
GROUP = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
         "maximize": False, "foreach": None, "capturable": False}
BYTES_PER_PARAM = 2 + 3 * 4  # bf16 weight; fp32 master, exp_avg, exp_avg_sq


# The NxD layout (Megatron's partition as NxD writes it), no torch needed.

def padded_vocab(tp):
    m = DIVISIBLE * tp
    return -(-VOCAB // m) * m


def logical_names(layers):
    out = [("language_model.embedding.word_embeddings.weight", -1)]
    for l in range(layers):
        for m in ("input_layernorm", "self_attention.query_key_value", "self_attention.dense",
                  "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
            out.append((f"language_model.encoder.layers.{l}.{m}.weight", l))
    out += [("language_model.encoder.final_layernorm.weight", -1), ("language_model.output_layer.weight", -1)]
    return out


def module(name):
    return name.rsplit(".", 1)[0].rsplit(".", 1)[-1]


def full_shape(name, hidden, vocab_rows):
    H, F, m = hidden, FFN[hidden], module(name)
    if m in ("word_embeddings", "output_layer"):
        return (vocab_rows, H)
    if m.endswith("norm"):
        return (H,)
    return {"query_key_value": (3 * H, H), "dense": (H, H), "dense_h_to_4h": (2 * F, H), "dense_4h_to_h": (H, F)}[m]


def kind(name):
    m = module(name)
    if m in ("word_embeddings", "output_layer", "query_key_value"):
        return "rows"
    if m in ("dense", "dense_4h_to_h"):
        return "cols"
    if m == "dense_h_to_4h":
        return "gate_up"
    return "whole"


def local_shape(name, shape, tp):
    k = kind(name)
    if k in ("rows", "gate_up"):
        return (shape[0] // tp,) + tuple(shape[1:])
    if k == "cols":
        return (shape[0], shape[1] // tp)
    return tuple(shape)


def nxdt_order(names):
    """Optimizer ids -> (name, group): decayed parameters, then norm weights."""
    return [(n, 0) for n in names if not module(n).endswith("norm")] + [(n, 1) for n in names if module(n).endswith("norm")]


def param_groups(order):
    return [dict(GROUP, weight_decay=wd, params=[i for i, (_, g) in enumerate(order) if g == gi])
            for gi, wd in ((0, 0.01), (1, 0.0))]


def stage_bounds(layers, pp):
    base, rem = divmod(layers, pp)
    sizes = [base + (1 if i >= pp - rem else 0) for i in range(pp)]
    return [sum(sizes[:i]) for i in range(pp + 1)]


def stage_names(layers, pp, p):
    """Stage p's parameters in module order: its layers, the embedding on the
    first stage, the final norm and output layer on the last."""
    b = stage_bounds(layers, pp)

    def mine(n, l):
        if l >= 0:
            return b[p] <= l < b[p + 1]
        return p == 0 if ".embedding." in n else p == pp - 1

    return [n for n, l in logical_names(layers) if mine(n, l)]


def rank_file(t, p, d=0):
    return f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"


def model_params(hidden, layers, tp):
    return sum(math.prod(full_shape(n, hidden, padded_vocab(tp))) for n, _ in logical_names(layers))


def pick_model(gib, hidden=None):
    """(hidden, layers): the largest hidden whose 4 layers (pp 4 needs them)
    fit in `gib`, then as many layers as fill it (sized at tp 8's padding)."""
    want = gib * 2**30
    for h in ([hidden] if hidden else sorted(FFN, reverse=True)):
        fixed = model_params(h, 0, 8) * BYTES_PER_PARAM
        per_layer = (model_params(h, 1, 8) - model_params(h, 0, 8)) * BYTES_PER_PARAM
        if fixed + 4 * per_layer <= want or h == min(FFN) or hidden:
            return h, max(4, round((want - fixed) / per_layer))


# Builder and baseline: run in /usr/bin/python3 children.

def generate(tag, hidden, layers, tp, pp, dp):
    """An NxD tag at (tp, pp, dp, ZeRO-1), one rank file in memory at a time."""
    import torch
    rows = padded_vocab(tp)
    os.makedirs(os.path.join(tag, "model"))
    os.makedirs(os.path.join(tag, "optim"))
    with open(os.path.join(tag, "checkpoint"), "w") as f:
        f.write("1")

    def rand(shape, dtype, *key, sq=False):  # replicated tensors get the same values on every tp rank
        g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
        x = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
        return (x.abs_() if sq else x).to(dtype)

    for p in range(pp):
        names = stage_names(layers, pp, p)
        order = nxdt_order(names)
        groups = param_groups(order)
        for t in range(tp):
            shapes = {n: local_shape(n, full_shape(n, hidden, rows), tp) for n in names}
            tt = lambda n: 0 if kind(n) == "whole" else t
            model = {n: rand(shapes[n], torch.bfloat16, n, tt(n), "w") for n in names}
            torch.save(model, os.path.join(tag, "model", rank_file(t, p)))
            del model
            for d in range(dp):
                def shard(n, what):
                    shape = shapes[n]
                    per = -(-shape[0] // dp)
                    real = max(0, min(shape[0], (d + 1) * per) - d * per)
                    x = torch.zeros((per,) + shape[1:])
                    x[:real] = rand((real,) + shape[1:], torch.float32, n, tt(n), d, what, sq=what == "exp_avg_sq")
                    return x

                osd = {"state": {}, "param_groups": groups,
                       "base_state": {i: {"step": torch.tensor(float(STEP)), "exp_avg": shard(n, "exp_avg"),
                                          "exp_avg_sq": shard(n, "exp_avg_sq")} for i, (n, _) in enumerate(order)},
                       "shape_info": {i: torch.Size(shapes[n]) for i, (n, _) in enumerate(order)},
                       "sharded_master_weights": {i: shard(n, "master") for i, (n, _) in enumerate(order)}}
                torch.save(osd, os.path.join(tag, "optim", rank_file(t, p, d)))
                del osd
    torch.save({"last_epoch": STEP, "base_lrs": [1e-4], "_last_lr": [5e-5], "name": "CosineAnnealing"},
               os.path.join(tag, "scheduler.pt"))
    torch.save({"epoch": 0, "global_step": STEP, "consumed_samples": float(STEP * 8)}, os.path.join(tag, "user_content.pt"))
    with open(os.path.join(tag, "done"), "w") as f:
        f.write("1")


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def baseline(src, dst, tp, pp, dp):
    """NxD's converter's way: everything loaded and merged, then split and saved."""
    full, layers, step = merge_source(src)
    save_layout(full, layers, step, src, dst, tp, pp, dp)


def merge_source(src):
    """Every rank file of an NxD tag loaded and merged: ({name: {"param",
    "master", "exp_avg", "exp_avg_sq"}: full tensors at the source's vocab
    padding}, layer count, the optimizer step)."""
    import torch
    grid = [f[:-3].split("_") for f in os.listdir(os.path.join(src, "optim"))]
    stp, spp, sdp = (1 + max(int(g[i]) for g in grid) for i in (5, 8, 2))
    full, layers, step = {}, 0, None
    for p in range(spp):
        parts = {}
        for t in range(stp):
            model = torch.load(os.path.join(src, "model", rank_file(t, p)))
            shards = [torch.load(os.path.join(src, "optim", rank_file(t, p, d))) for d in range(sdp)]
            for i, (n, _) in enumerate(nxdt_order(list(model))):
                rows = shards[0]["shape_info"][i][0]
                x = parts.setdefault(n, {"param": [], "master": [], "exp_avg": [], "exp_avg_sq": []})
                x["param"].append(model[n])
                x["master"].append(torch.cat([s["sharded_master_weights"][i] for s in shards])[:rows])
                for k in ("exp_avg", "exp_avg_sq"):
                    x[k].append(torch.cat([s["base_state"][i][k] for s in shards])[:rows])
                step = shards[0]["base_state"][i]["step"]
            del model, shards
        for n, kinds in parts.items():
            k = kind(n)
            merged = {}
            for what, xs in kinds.items():
                if k == "rows":
                    merged[what] = torch.cat(xs, 0)
                elif k == "cols":
                    merged[what] = torch.cat(xs, 1)
                elif k == "gate_up":
                    halves = [x.chunk(2, 0) for x in xs]
                    merged[what] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                else:
                    merged[what] = xs[0]
            full[n] = merged
            if ".layers." in n:
                layers = max(layers, int(n.split(".layers.")[1].split(".")[0]) + 1)
        del parts
    return full, layers, step


def save_layout(full, layers, step, src, dst, tp, pp, dp):
    """Merged tensors split and saved as an NxD tag at (tp, pp, dp, ZeRO-1);
    scheduler and user content copied from `src`."""
    import torch
    rows = padded_vocab(tp)
    for n, x in full.items():  # the target's vocab padding: rows cut or zero rows added
        if kind(n) == "rows" and module(n) in ("word_embeddings", "output_layer"):
            for what, v in x.items():
                x[what] = v[:rows] if v.shape[0] >= rows else torch.cat([v, v.new_zeros((rows - v.shape[0],) + v.shape[1:])])

    def split(n, v, t):
        k = kind(n)
        if k == "rows":
            return v.chunk(tp, 0)[t].clone()
        if k == "cols":
            return v.chunk(tp, 1)[t].clone()
        if k == "gate_up":
            gate, up = v.chunk(2, 0)
            return torch.cat([gate.chunk(tp, 0)[t], up.chunk(tp, 0)[t]])
        return v.clone()

    def shard(v, d):
        pad = (-v.shape[0]) % dp
        if pad:
            v = torch.cat([v, v.new_zeros((pad,) + v.shape[1:])])
        return v.chunk(dp)[d].clone()

    def save(obj, path):
        torch.save(obj, path)
        fsync(path)

    os.makedirs(os.path.join(dst, "model"))
    os.makedirs(os.path.join(dst, "optim"))
    with open(os.path.join(dst, "checkpoint"), "w") as f:
        f.write("1")
    for p in range(pp):
        names = stage_names(layers, pp, p)
        order = nxdt_order(names)
        for t in range(tp):
            model = {n: split(n, full[n]["param"], t) for n in names}
            save(model, os.path.join(dst, "model", rank_file(t, p)))
            shapes = {n: model[n].shape for n in names}
            del model
            local = {n: {w: split(n, full[n][w], t) for w in ("master", "exp_avg", "exp_avg_sq")} for n in names}
            for d in range(dp):
                osd = {"state": {}, "param_groups": param_groups(order),
                       "base_state": {i: {"step": step.clone(), "exp_avg": shard(local[n]["exp_avg"], d),
                                          "exp_avg_sq": shard(local[n]["exp_avg_sq"], d)} for i, (n, _) in enumerate(order)},
                       "shape_info": {i: shapes[n] for i, (n, _) in enumerate(order)},
                       "sharded_master_weights": {i: shard(local[n]["master"], d) for i, (n, _) in enumerate(order)}}
                save(osd, os.path.join(dst, "optim", rank_file(t, p, d)))
                del osd
            del local
    for f in ("scheduler.pt", "user_content.pt"):
        save(torch.load(os.path.join(src, f)), os.path.join(dst, f))
    with open(os.path.join(dst, "done"), "w") as f:
        f.write("1")
    fsync(os.path.join(dst, "done"))


# The benchmark (no torch in this process).

def tree(root):
    """Relative path -> size of every file under root."""
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


def cold(remove, inputs):
    """Output removed, everything synced, the inputs out of the page cache."""
    settle(remove)
    if os.geteuid() != 0:
        for f in inputs:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def timed(args, work):
    """Wall time, peak RSS (bytes) and stdout of a command (and its children)."""
    out, err = (open(os.path.join(work, n), "w+") for n in ("stdout", "stderr"))
    with out, err:
        t0 = time.perf_counter()
        p = subprocess.Popen(args, stdout=out, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        secs = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if p.returncode != 0:
            raise SystemExit(f"failed ({p.returncode}): {' '.join(args)}\n{err.read()}")
        return secs, ru.ru_maxrss * 1024, out.read()


def parse_size(s):
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:].upper(), 1)
    return int(float(s.rstrip("kKmMgG")) * mult)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=None, help="size of each source tag (default 3, less if the disk is short)")
    ap.add_argument("--hidden", type=int, choices=sorted(FFN), default=None, help="default: from --gib")
    ap.add_argument("--runs", type=int, default=1, help="best of N, interleaved")
    ap.add_argument("--memory_budget", default="512M")
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--keep", action="store_true", help="leave the work folder")
    ap.add_argument("--generate", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--baseline", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.generate:
        return generate(a.generate[0], *map(int, a.generate[1:]))
    if a.baseline:
        return baseline(a.baseline[0], a.baseline[1], *map(int, a.baseline[2:]))

    # Each job needs its source, and at most two outputs at once (one with --keep's leftovers).
    free = shutil.disk_usage(a.dir).free
    per_gib = 3.3 * 2**30 * (2 if a.keep else 1)
    gib = a.gib if a.gib else min(3.0, free / per_gib)
    if gib * per_gib > free:
        raise SystemExit(f"{a.dir}: {free / 2**30:.1f} GiB free, --gib {gib} needs about {gib * per_gib / 2**30:.1f}")
    hidden, layers = pick_model(gib, a.hidden)
    budget = parse_size(a.memory_budget)
    tool = os.path.join(a.build, "bin", "ckpt-reshard")
    hints = ["--heads", str(HEADS), "--kv_heads", str(HEADS), "--vocab_size", str(VOCAB),
             "--make_vocab_size_divisible_by", str(DIVISIBLE)]
    print(f"model: Llama, hidden {hidden}, ffn {FFN[hidden]}, {HEADS} heads, {layers} layers, vocab {VOCAB} "
          f"(padded to a multiple of {DIVISIBLE} x tp); bf16 weights, ZeRO-1 AdamW with fp32 master weights")
    print(f"{os.cpu_count()} cores, page cache dropped before every run "
          f"({'drop_caches' if os.geteuid() == 0 else 'POSIX_FADV_DONTNEED'}), best of {a.runs}")

    work = tempfile.mkdtemp(dir=a.dir, prefix="reshard_bench_")
    rows, summary = [], []
    try:
        for job, (stp, spp, sdp), (tp, pp, dp) in JOBS:
            jdir = os.path.join(work, f"tp{stp}pp{spp}dp{sdp}")
            src = os.path.join(jdir, "step_100")
            os.makedirs(jdir)
            t0 = time.perf_counter()
            subprocess.run([PY, __file__, "--generate", src, str(hidden), str(layers), str(stp), str(spp), str(sdp)],
                           check=True)
            inputs = tree(src)
            size = sum(inputs.values())
            files = [os.path.join(src, f) for f in inputs]
            print(f"{job}: source {len(inputs)} files, {size / 2**30:.2f} GiB (largest {max(inputs.values()) / 2**20:.0f} MiB), "
                  f"made in {time.perf_counter() - t0:.0f} s")
            out = os.path.join(jdir, "out")
            target = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--zero1"]
            reshard = [tool, src, out, *target, "--memory_budget", a.memory_budget, "--json", *hints]
            methods = {
                "ckpt-reshard --no_verify": reshard + ["--no_verify"],
                "ckpt-reshard (verify)": reshard,
                "python baseline (NxD way)": [PY, __file__, "--baseline", src, out, str(tp), str(pp), str(dp)],
                "cp -r + sync -f": ["sh", "-c", 'cp -r "$1" "$2" && sync -f "$2"', "sh", src, out],
            }
            best, written, tool_json, outputs = {}, {}, {}, {}
            for _ in range(a.runs):
                for m, args in methods.items():
                    cold(out, files)
                    secs, rss, stdout = timed(args, jdir)
                    outputs[m] = tree(out)
                    written[m] = sum(outputs[m].values())
                    if m.startswith("ckpt-reshard"):
                        if not os.path.exists(os.path.join(out, "done")):
                            raise SystemExit(f"{m}: {out} has no `done`")
                        tool_json[m] = json.loads(stdout)
                    old = best.get(m, (1e18, 0))
                    best[m] = (min(old[0], secs), max(old[1], rss))
            shutil.rmtree(out, ignore_errors=True)
            for m, (secs, rss) in best.items():
                rows.append((job, m, secs, written[m] / 2**30 / secs, rss))
            pts = lambda m: {f for f in outputs[m] if f.endswith(".pt") or f == "done"}
            same = pts("ckpt-reshard (verify)") == pts("python baseline (NxD way)")
            j = tool_json["ckpt-reshard (verify)"]
            largest = max(padded_vocab(stp), padded_vocab(tp)) * hidden * 4  # an fp32 vocab tensor, merged
            thr = {m: written[m] / best[m][0] for m in methods}
            summary.append(
                f"{job}: {written['ckpt-reshard (verify)'] / 2**30:.2f} GiB written in {j['files']} files "
                f"(baseline writes {'the same' if same else 'DIFFERENT'} .pt files); ckpt-reshard's own figures (verify, last run): "
                f"{j['seconds']:.2f} s, peak {j['peak_rss'] / 2**20:.0f} MiB, chunk {j['stream_chunk'] / 2**20:.0f} MiB\n"
                + "".join(
                    f"  {m}: throughput / cp {thr[m] / thr['cp -r + sync -f']:.2f} (target >= 0.8), "
                    f"speed / baseline {best['python baseline (NxD way)'][0] / best[m][0]:.1f}x (target >= 3x), "
                    f"peak RSS {best[m][1] / 2**20:.0f} MiB = {best[m][1] / (budget + largest):.2f} of budget "
                    f"{budget / 2**20:.0f} MiB + largest logical tensor {largest / 2**20:.0f} MiB\n"
                    for m in ("ckpt-reshard --no_verify", "ckpt-reshard (verify)")))
            if not a.keep:
                shutil.rmtree(jdir, ignore_errors=True)
        print()
        print(f"{'job':28s} {'method':26s} {'seconds':>8s} {'GiB/s':>7s} {'peak RSS':>10s}")
        for job, m, secs, rate, rss in rows:
            print(f"{job:28s} {m:26s} {secs:8.2f} {rate:7.2f} {rss / 2**20:6.0f} MiB")
        print()
        print("".join(summary), end="")
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

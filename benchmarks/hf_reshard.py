"""ckpt-reshard on an HF-style Llama tag (NxDT's model_source: hf), against the
durable copy of the same bytes and NxD's own converter route, in one run.

  python3 benchmarks/hf_reshard.py [--layers 32] [--runs 1] [--build build] [--dir /tmp] [--keep]
                                   [--memory_budget 512M] [--converter_layers 4]

Input: a Llama-7B-shaped tag (hidden 4096, 32 heads, 8 KV heads, FFN 11008,
vocab 32000, bf16; --layers of them) as NxD's checkpoint_converter.py writes
it for Trn1 tp 32 with kv_size_multiplier 4 (fused qkv_proj.weight_qkv:
rank r holds query head (r % 8) * 4 + r // 8 and KV head r % 8; o_proj's
columns alike), model only. Each rank file is generated alone, every head
block from its own seed, so KV replicas are equal as NxD keeps them.

Job: Trn1 tp 32 m 4 -> tp 8 m 1 (KV heads no longer replicated, queries back in
order), each from a cold page cache (sync, drop_caches as root):
  - ckpt-reshard --no_verify, and as is (checking the source's zip CRC-32s);
  - cp -r of the source then sync -f: the physical limit for these bytes;
  - with SHARDKIT_NXD_SRC and SHARDKIT_NXDT_SRC set (the upstream trees, as
    tests/data/upstream/hf_llama/generate.py takes them): NxD's converter
    route, --convert_to_full_state then --convert_from_full_state, in one
    process, on a --converter_layers copy of the tag (it holds the whole
    model, twice, so 32 layers do not fit 24 GiB), reported per GiB.
Time is wall time; peak RSS is the child's maximum resident set (os.wait4).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench_util import settle

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/usr/bin/python3"
H, HEADS, KV, FFN, VOCAB, HD = 4096, 32, 8, 11008, 32000, 128
TP, M = 32, 4

GEN = r'''
import os, sys, torch, zlib
out, layers, tp, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
H, HEADS, KV, FFN, VOCAB, HD = %d, %d, %d, %d, %d, %d
qn, n = HEADS // tp, KV * m // tp
def block(seed, rows, cols):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
def seed(*k):
    return zlib.crc32(repr(k).encode())
os.makedirs(os.path.join(out, "model"), exist_ok=True)
for r in range(tp):
    qblock = (r %% KV) * m + r // KV if m > 1 else r      # NxD's Trn1 query order
    qheads = [qblock * qn + i for i in range(qn)]
    kvheads = [(r %% KV) if m > 1 else r * n + i for i in range(n)]
    sd = {}
    sd["model.embed_tokens.weight"] = torch.cat([block(seed("emb", r, i), VOCAB // tp // 8, H) for i in range(8)])
    for l in range(layers):
        q = [block(seed(l, "q", h), HD, H) for h in qheads]
        k = [block(seed(l, "k", g), HD, H) for g in kvheads]
        v = [block(seed(l, "v", g), HD, H) for g in kvheads]
        sd[f"model.layers.{l}.self_attn.qkv_proj.weight_qkv"] = torch.cat(q + k + v)
        sd[f"model.layers.{l}.self_attn.o_proj.weight"] = torch.cat([block(seed(l, "o", h), H, HD) for h in qheads], dim=1)
        f = FFN // tp
        sd[f"model.layers.{l}.mlp.gate_up_proj.weight"] = torch.cat([block(seed(l, "gate", r), f, H), block(seed(l, "up", r), f, H)])
        sd[f"model.layers.{l}.mlp.down_proj.weight"] = block(seed(l, "down", r), H, f)
        sd[f"model.layers.{l}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        sd[f"model.layers.{l}.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    sd["lm_head.weight"] = torch.cat([block(seed("head", r, i), VOCAB // tp // 8, H) for i in range(8)])
    torch.save(sd, os.path.join(out, "model", "dp_rank_00_tp_rank_%%02d_pp_rank_00.pt" %% r))
''' % (H, HEADS, KV, FFN, VOCAB, HD)

CONVERTER = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
import generate  # tests/data/upstream/hf_llama: NxDT's documented entry point with the CPU stand-ins
import upstream_env
upstream_env.load_checkpoint_converter()
src, tmp, config, layers = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
common = ["--model_style", "hf", "--config", config, "--hw_backend", "trn1", "--n_layers", layers, "--qkv_linear", "True",
          "--fuse_qkv", "True"]
generate.run_converter(common + ["--input_dir", os.path.join(src, "model"), "--output_dir", os.path.join(tmp, "full"),
                                 "--tp_size", "32", "--pp_size", "1", "--kv_size_multiplier", "4", "--convert_to_full_state"])
generate.run_converter(common + ["--input_dir", os.path.join(tmp, "full", "checkpoint.pt"), "--output_dir", os.path.join(tmp, "out"),
                                 "--tp_size", "8", "--pp_size", "1", "--kv_size_multiplier", "1", "--convert_from_full_state"])
os.sync()
'''


def tree_bytes(root):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def timed(cmd, env=None):
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    err = p.stderr.read().decode()
    if status != 0:
        raise SystemExit(f"{cmd[0]} failed: {err[-2000:]}")
    return time.time() - t0, ru.ru_maxrss * 1024


def config_json(path, layers):
    with open(path, "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": FFN,
                   "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": layers, "vocab_size": VOCAB,
                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--converter_layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--memory_budget", default="512M")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    reshard = os.path.join(a.build, "bin", "ckpt-reshard")
    work = tempfile.mkdtemp(prefix="hf_reshard_", dir=a.dir)
    try:
        src, cfg = os.path.join(work, "src"), os.path.join(work, "config.json")
        config_json(cfg, a.layers)
        t0 = time.time()
        subprocess.run([PY, "-c", GEN, src, str(a.layers), str(TP), str(M)], check=True)
        size = tree_bytes(src)
        print(f"source: Trn1 tp {TP} kv_size_multiplier {M}, {a.layers} layers, {size / 2**30:.2f} GiB in {TP} files "
              f"(generated in {time.time() - t0:.0f} s)")
        rows = []
        for name, cmd in [("ckpt-reshard --no_verify", ["--no_verify"]), ("ckpt-reshard", [])]:
            best = None
            for _ in range(a.runs):
                out = os.path.join(work, "out")
                settle(out)
                secs, rss = timed([reshard, src, out, "--tp", "8", "--pp", "1", "--out_kv_size_multiplier", "1", "--model_config", cfg,
                                   "--memory_budget", a.memory_budget, *cmd])
                assert os.path.exists(os.path.join(out, "done"))
                best = min(best or (secs, rss), (secs, rss))
            rows.append((name, best[0], best[1], tree_bytes(out)))
        best = None
        for _ in range(a.runs):
            copy = os.path.join(work, "copy")
            settle(copy)
            secs, rss = timed(["sh", "-c", f"cp -r {src} {copy} && sync -f {copy}"])
            best = min(best or (secs, rss), (secs, rss))
        rows.append(("cp -r + sync (the source's bytes)", best[0], best[1], size))
        print(f"{'job':42s} {'seconds':>8s} {'GiB/s':>7s} {'peak RSS':>10s} {'vs cp':>6s}")
        for name, secs, rss, written in rows:
            print(f"{name:42s} {secs:8.1f} {written / 2**30 / secs:7.2f} {rss / 2**20:8.0f} MiB {secs / rows[-1][1]:6.2f}")
        nxd, nxdt = os.environ.get("SHARDKIT_NXD_SRC"), os.environ.get("SHARDKIT_NXDT_SRC")
        if nxd and nxdt:
            small, scfg = os.path.join(work, "small"), os.path.join(work, "small_config.json")
            config_json(scfg, a.converter_layers)
            subprocess.run([PY, "-c", GEN, small, str(a.converter_layers), str(TP), str(M)], check=True)
            ssize = tree_bytes(small)
            fixtures = os.path.join(HERE, "..", "tests", "data", "upstream", "hf_llama")
            out = os.path.join(work, "small_out")
            settle(out)
            secs, rss = timed([reshard, small, out, "--tp", "8", "--pp", "1", "--out_kv_size_multiplier", "1", "--model_config", scfg,
                               "--memory_budget", a.memory_budget])
            conv = os.path.join(work, "conv")
            os.makedirs(conv)
            settle()
            csecs, crss = timed([PY, "-c", CONVERTER, fixtures, small, conv, scfg, str(a.converter_layers)], env=dict(os.environ))
            print(f"\nNxD's converter route on {a.converter_layers} layers ({ssize / 2**30:.2f} GiB): to_full + from_full "
                  f"{csecs:.1f} s, peak RSS {crss / 2**20:.0f} MiB; ckpt-reshard {secs:.1f} s, peak RSS {rss / 2**20:.0f} MiB "
                  f"({csecs / secs:.1f}x faster, {crss / rss:.0f}x less memory)")
        else:
            print("\n(NxD's converter route: set SHARDKIT_NXD_SRC and SHARDKIT_NXDT_SRC to the upstream trees)")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

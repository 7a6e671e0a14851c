"""Training throughput of the training core against PyTorch eager on CPU, same
model, batch and thread count, in the same run; plus peak memory with and
without activation recompute.

  python3 benchmarks/train_tokens.py [--build build]

A step is forward, backward, gradient clipping and an AdamW update. The torch
model is tests/interop/train_reference.py's Megatron Llama.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))
from train_reference import forward  # noqa: E402

SHAPES = {
    "tiny": dict(vocab=264, hidden=64, ffn=172, heads=4, kv_heads=4, layers=2, batch=4, seq=64),
    "100m": dict(vocab=32000, hidden=768, ffn=2048, heads=12, kv_heads=12, layers=12, batch=1, seq=256),
}


def ours(build, model, recompute="", threads=None):
    env = dict(os.environ, SHARDKIT_BENCH_MODEL=model, SHARDKIT_BENCH_RECOMPUTE=recompute)
    if threads:
        env["SHARDKIT_BENCH_THREADS"] = str(threads)
    out = subprocess.run([os.path.join(build, "bin", "train_bench"), "--benchmark_format=json"], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["benchmarks"][0]


def torch_tokens_per_s(s, seconds=8.0):
    g = torch.Generator().manual_seed(0)
    H, F, V, L, hd = s["hidden"], s["ffn"], s["vocab"], s["layers"], s["hidden"] // s["heads"]
    params = {"language_model.embedding.word_embeddings.weight": torch.randn(V, H, generator=g) * 0.02,
              "language_model.encoder.final_layernorm.weight": torch.ones(H),
              "language_model.output_layer.weight": torch.randn(V, H, generator=g) * 0.02}
    for l in range(L):
        p = f"language_model.encoder.layers.{l}."
        params[p + "input_layernorm.weight"] = torch.ones(H)
        params[p + "self_attention.query_key_value.weight"] = torch.randn(3 * H, H, generator=g) * 0.02
        params[p + "self_attention.dense.weight"] = torch.randn(H, H, generator=g) * 0.02
        params[p + "post_attention_layernorm.weight"] = torch.ones(H)
        params[p + "mlp.dense_h_to_4h.weight"] = torch.randn(2 * F, H, generator=g) * 0.02
        params[p + "mlp.dense_4h_to_h.weight"] = torch.randn(H, F, generator=g) * 0.02
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    cfg = dict(hidden=H, heads=s["heads"], kv_heads=s["kv_heads"], layers=L, rotary_dim=hd)
    tokens = torch.randint(0, V, (s["batch"], s["seq"]), generator=g)
    targets = torch.randint(0, V, (s["batch"], s["seq"]), generator=g)

    def step():
        opt.zero_grad()
        logits = forward(params, cfg, tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()

    return steps_tokens_per_s(step, s["batch"] * s["seq"], seconds)


def steps_tokens_per_s(step, tokens_per_step, seconds):
    """Tokens/s of `step()` run for `seconds` (at least twice) after one warm-up step."""
    step()  # warm up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        step()
        n += 1
    return n * tokens_per_step / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    args = ap.parse_args()
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    print(f"threads: {threads} (ours: TBB default; torch: set_num_threads({threads}))")
    for name, s in SHAPES.items():
        o = ours(args.build, name)
        t = torch_tokens_per_s(s)
        print(f"{name:5s} ({o['params_M']:.1f}M params, batch {s['batch']}x{s['seq']}): shardkit {o['tokens_per_s']:.0f} tok/s, "
              f"torch {t:.0f} tok/s -> {o['tokens_per_s'] / t:.2f}x")
    for rc in ("", "selective", "full"):
        o = ours(args.build, "100m", rc)
        print(f"100m recompute={rc or 'none':9s}: activations {o['activations_MiB']:.0f} MiB, peak RSS {o['max_rss_MiB']:.0f} MiB, "
              f"{o['tokens_per_s']:.0f} tok/s")


if __name__ == "__main__":
    main()

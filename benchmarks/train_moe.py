"""Training throughput of a small Mixtral (MoE) in the training core against the same model in
PyTorch eager on CPU, same sizes, batch and thread count, in the same run (issue #39).

  python3 benchmarks/train_moe.py [--build build] [--threads N]

The model (train_bench.cc SHARDKIT_BENCH_MODEL=mixtral): 4 layers, hidden 128, 4 heads, every
layer MoE with 8 SwiGLU experts of width 256, top 2, normalized affinities, dropless (no
capacity), the load-balancing loss at 0.02; batch 4 x 128. A step is forward, backward,
gradient clipping and an AdamW update on both sides. The torch model is
tests/interop/train_reference.py's decoder with the MoE layer below as its MLP: the router's
softmax in fp32, top-k, then each expert's tokens gathered, run and scattered back
(index_add_), as NxD's ExpertMLPs computes an all-experts/dropless forward.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "interop"))
from train_reference import forward  # noqa: E402
from train_tokens import ours, steps_tokens_per_s  # noqa: E402

SHAPE = dict(vocab=264, hidden=128, ffn=256, heads=4, layers=4, experts=8, top_k=2, aux=0.02, batch=4, seq=128)


def moe_params(s, g):
    H, F, V, E = s["hidden"], s["ffn"], s["vocab"], s["experts"]
    params = {"language_model.embedding.word_embeddings.weight": torch.randn(V, H, generator=g) * 0.02,
              "language_model.encoder.final_layernorm.weight": torch.ones(H),
              "language_model.output_layer.weight": torch.randn(V, H, generator=g) * 0.02}
    for l in range(s["layers"]):
        p = f"language_model.encoder.layers.{l}."
        params[p + "input_layernorm.weight"] = torch.ones(H)
        params[p + "self_attention.query_key_value.weight"] = torch.randn(3 * H, H, generator=g) * 0.02
        params[p + "self_attention.dense.weight"] = torch.randn(H, H, generator=g) * 0.02
        params[p + "post_attention_layernorm.weight"] = torch.ones(H)
        params[p + "mlp.moe.router.linear_router.weight"] = torch.randn(E, H, generator=g) * 0.02
        params[p + "mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight"] = torch.randn(E, H, 2 * F, generator=g) * 0.02
        params[p + "mlp.moe.expert_mlps.mlp_op.down_proj.weight"] = torch.randn(E, F, H, generator=g) * 0.02
    return {k: v.requires_grad_(True) for k, v in params.items()}


def torch_tokens_per_s(s, seconds=8.0):
    g = torch.Generator().manual_seed(0)
    H, V, E, k = s["hidden"], s["vocab"], s["experts"], s["top_k"]
    params = moe_params(s, g)
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    cfg = dict(hidden=H, heads=s["heads"], kv_heads=s["heads"], layers=s["layers"], rotary_dim=H // s["heads"])
    tokens = torch.randint(0, V, (s["batch"], s["seq"]), generator=g)
    targets = torch.randint(0, V, (s["batch"], s["seq"]), generator=g)
    routing = []  # each MoE layer's (affinities, chosen experts), for the auxiliary loss

    def moe(h, l):
        p = f"language_model.encoder.layers.{l}.mlp.moe."
        x = h.reshape(-1, H)
        affinities = (x @ params[p + "router.linear_router.weight"].T).float().softmax(-1)
        weights, chosen = affinities.topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routing.append((affinities, chosen))
        gate_up, down = params[p + "expert_mlps.mlp_op.gate_up_proj.weight"], params[p + "expert_mlps.mlp_op.down_proj.weight"]
        out = torch.zeros_like(x)
        for e in range(E):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gate, up = (x[rows] @ gate_up[e]).chunk(2, -1)
            out = out.index_add(0, rows, (torch.nn.functional.silu(gate) * up) @ down[e] * weights[rows, slot, None])
        return out.view_as(h)

    def step():
        opt.zero_grad()
        routing.clear()
        logits = forward(params, cfg, tokens, mlp=moe)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        affinities = torch.cat([a for a, _ in routing])  # load_balancing_loss_func over every layer's rows
        chosen = torch.nn.functional.one_hot(torch.cat([c for _, c in routing]), E).sum(1).float()
        loss = loss + s["aux"] * E / k * (chosen.mean(0) * affinities.mean(0)).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()

    return steps_tokens_per_s(step, s["batch"] * s["seq"], seconds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="both sides' threads (default: every core)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads: {args.threads} (ours: tbb::global_control; torch: set_num_threads({args.threads}))")
    s = SHAPE
    o = ours(args.build, "mixtral", threads=args.threads)
    t = torch_tokens_per_s(s)
    print(f"mixtral ({o['params_M']:.1f}M params, {s['experts']} experts top {s['top_k']}, batch {s['batch']}x{s['seq']}): "
          f"shardkit {o['tokens_per_s']:.0f} tok/s, torch {t:.0f} tok/s -> {o['tokens_per_s'] / t:.2f}x")


if __name__ == "__main__":
    main()

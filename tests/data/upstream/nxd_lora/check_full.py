#!/usr/bin/python3
"""Checks (torch only, no upstream) that the tp 1 tags are the full tensors the tp 4 tags cut.

Cutting rules restated for this check only (the tags themselves come from upstream code):
replicated entries equal on every rank; K/V rows of a GQA layer (base and lora_B) on Trn1:
rank r holds KV head r % kv_heads (qkv_linear.py _initialize_affine_weight, `repeat`);
gate_up_proj.weight (base, stride 2): each rank holds its quarter of gate, then of up;
everything else: concatenation along the dim whose size differs.  Also checks that every
optimizer state tensor of the tp 4 tags is the matching cut of the tp 1 state.
Exit 1 on any mismatch.  Usage: check_full.py [dir]   (default: this folder)
"""
import os
import sys

import torch

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
TP, KV = 4, 2


def load(model, tp, mode, kind, r):
    d = os.path.join(ROOT, f"{model}_tp{tp}", mode, "step_2")
    p = os.path.join(d, kind, f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt")
    return torch.load(p)


def cut_ok(name, full, parts, ulps=0):
    if ulps:
        # merged weights: W + (B @ A) * scale per rank; the matmul's summation order may differ
        # between a rank's part and the whole, so allow `ulps` float32 ulps of the tensor's largest value
        return cut_ok(name, full, parts) or _close(name, full, parts, ulps)
    if all(p.shape == full.shape for p in parts):
        return all(torch.equal(p, full) for p in parts)
    if name.endswith(("weight_k", "weight_v")):
        n = parts[0].shape[0]
        return all(torch.equal(parts[r], full[(r % KV) * n:(r % KV + 1) * n]) for r in range(TP))
    if name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.base_layer.weight"):
        g, u = full.chunk(2, 0)
        return torch.equal(torch.cat([torch.cat([g.chunk(TP)[r], u.chunk(TP)[r]]) for r in range(TP)]),
                           torch.cat(parts))
    dim = 0 if parts[0].shape[0] != full.shape[0] else 1
    return torch.equal(torch.cat(parts, dim), full)


def _close(name, full, parts, ulps):
    def eq(a, b):
        tol = ulps * torch.finfo(torch.float32).eps * float(full.abs().max())
        return bool(((a - b).abs() <= tol).all())
    if all(p.shape == full.shape for p in parts):
        return all(eq(p, full) for p in parts)
    if name.endswith(("weight_k", "weight_v")):
        n = parts[0].shape[0]
        return all(eq(parts[r], full[(r % KV) * n:(r % KV + 1) * n]) for r in range(TP))
    if name.endswith("gate_up_proj.weight"):
        g, u = full.chunk(2, 0)
        return eq(torch.cat([torch.cat([g.chunk(TP)[r], u.chunk(TP)[r]]) for r in range(TP)]), torch.cat(parts))
    dim = 0 if parts[0].shape[0] != full.shape[0] else 1
    return eq(torch.cat(parts, dim), full)


def merged_per_rank(k, merged):
    """gate_up_proj: the base is cut with stride 2 (gate part, up part) but its lora_B, a
    ColumnParallelLinear built without stride, is cut contiguously, so NxD's per-rank merge
    adds rows of B that the unsharded model would add elsewhere; check the per-rank formula
    W_r + (B_r @ A) * scale bit for bit instead of the unsharded merge."""
    stem = k[: -len("weight")]
    base = [load("all_targets", TP, "base_adapter", "model", r) for r in range(TP)]
    scale = 32 / 16
    ok = all(torch.equal(merged[r][k], base[r][stem + "base_layer.weight"]
                         + (base[r][stem + "lora_B.weight"] @ base[r][stem + "lora_A.weight"]) * scale)
             for r in range(TP))
    print(f"merged {k}: per-rank W_r + (B_r @ A) * {scale}: {'equal' if ok else 'DIFFERENT'}")
    return ok


def main():
    bad = 0
    # optimizer indices follow NxDT's two param groups (decay, then no_decay
    # ["bias", "LayerNorm", "norm"]) over named_parameters(), the base_adapter model order
    params = [k for k in load("all_targets", 1, "base_adapter", "model", 0) if k != "lora_config"]
    nd = [k for k in params if any(s in k for s in ("bias", "LayerNorm", "norm"))]
    opt_names = [k for k in params if k not in nd] + nd
    for mode in ("base_adapter", "adapter_only", "merged"):
        full = load("all_targets", 1, mode, "model", 0)
        parts = [load("all_targets", TP, mode, "model", r) for r in range(TP)]
        names = [k for k in full if k != "lora_config"]
        for k in names:
            if mode == "merged" and k.endswith("gate_up_proj.weight"):
                bad += not merged_per_rank(k, parts)
                continue
            if not cut_ok(k, full[k], [p[k] for p in parts], ulps=2 if mode == "merged" else 0):
                bad += 1
                print("MISMATCH model", mode, k)
        of = load("all_targets", 1, mode, "optim", 0)
        op = [load("all_targets", TP, mode, "optim", r) for r in range(TP)]
        for i, st in of["state"].items():
            for key, v in st.items():
                if not cut_ok(opt_names[i], v, [o["state"][i][key] for o in op]):
                    bad += 1
                    print("MISMATCH optim", mode, opt_names[i], key)
            assert "lora_" in opt_names[i], opt_names[i]  # state only for adapters
        print(f"{mode}: {len(names)} model tensors, {len(of['state'])} optimizer states checked")
    print("# result:", "OK" if bad == 0 else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

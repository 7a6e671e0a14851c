#!/usr/bin/env python3
"""Forward check of the sharded HF-Llama fixtures against unsharded HF attention.

For every tag in manifest.json and every layer, attention is computed per tp rank the
way NxDT's HF Llama computes it (each rank's query heads attend with the KV heads that
rank holds, then o_proj as a row-parallel partial sum over ranks), and compared with HF
attention computed from the full state dict.

Two implementations of the per-rank math:
  * "restated" (always; needs only torch): a restatement of
    NxDT src/neuronx_distributed_training/models/hf_models/modeling_llama.py (commit 9169aa03)
      LlamaAttention.forward L383-L481:
        projection L418-L430 (fused MHA: qkv_proj(x).split(split_size = heads*d/tp), L418-L424;
                   qkv_linear: GQAQKVColumnParallelLinear -> (q, k, v), L425-L426; else q/k/v_proj),
        permute_qkv_for_attn L497-L517 (non-flash, non-SP: view(b, s, heads_local, d).transpose(1, 2)),
        apply_rotary_pos_emb L439 (NxD src/neuronx_distributed/overrides/transformer_overrides.py L20-L32),
        repeat_kv(k/v, num_key_value_groups) L452-L453 (HF repeat_kv: each local KV head repeated
                   num_heads_local // num_kv_heads_local times, consecutively),
        CoreAttention L226-L251: QK^T/sqrt(d), causal mask filled with -10000.0, softmax in fp32, @V,
        transpose/reshape L466-L468, o_proj L475 (RowParallelLinear: per-rank partial sums, all-reduced);
      per-rank head counts L358-L362: num_heads = heads/tp, num_kv = kv_heads*kv_shared_group_size/tp.
  * "upstream" (when SHARDKIT_NXDT_SRC and SHARDKIT_NXD_SRC are set): NxDT's real
    LlamaForCausalLM is built per tp rank (parallel layers replaced by the stand-ins in
    upstream_env.py), the rank's shards are loaded into it with load_state_dict(strict=True)
    and the real LlamaAttention.forward / LlamaRotaryEmbedding.forward are run.

The HF reference is a plain restatement of HF LlamaAttention (eager): GQA via repeat_kv
of the full K/V, causal softmax, o_proj.

Negative control: the same per-rank computation with each rank's KV replaced by the KV of
a rank that holds a different KV slot; it must NOT match.

Usage:  nice -n 19 /usr/bin/python3 forward_check.py [--write-json]
        (--write-json rewrites forward_check.json; without it nothing is written, so CI can run it
        on a read-only tree)
Exit status 1 if a layout expected correct does not match, the one expected wrong does
match, or a negative control matches.
"""

import json
import math
import os
import sys

import torch

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-4
EXPECT_WRONG = {"trn2_tp4_pp1_kv2_fused_converter"}  # converter writes Trn2 KV with the Trn1 rule


def load_manifest():
    with open(os.path.join(HERE, "manifest.json")) as f:
        return json.load(f)


def load_full(man, key):
    sd = torch.load(os.path.join(HERE, man["full"][key]["checkpoint"]), map_location="cpu")
    with open(os.path.join(HERE, man["full"][key]["config"])) as f:
        cfg = json.load(f)
    return {k: v.float() for k, v in sd.items()}, cfg


def load_shards(case):
    out = {}
    d = os.path.join(HERE, case["dir"], "model")
    for fn in sorted(os.listdir(d)):
        parts = fn[:-3].split("_")  # dp_rank_00_tp_rank_XX_pp_rank_YY.pt
        out[(int(parts[5]), int(parts[8]))] = {k: v.float() for k, v in
                                               torch.load(os.path.join(d, fn), map_location="cpu").items()}
    return out


def rank_state(shards, tp_rank, layer):
    for (r, _pp), sd in shards.items():
        if r == tp_rank and f"model.layers.{layer}.self_attn.o_proj.weight" in sd:
            return sd
    raise KeyError((tp_rank, layer))


# ------------------------------------------------------------------ shared math

def rope_cos_sin(cfg, seq):
    """HF default RoPE: inv_freq = 1/theta^(arange(0,d,2)/d); emb = cat(freqs, freqs)."""
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(seq, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None], emb.sin()[None]  # (1, seq, d)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(x, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x if n == 1 else x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def attend(q, k, v, masked_value):
    """softmax(QK^T/sqrt(d) + causal) V, fp32; q: (b, hq, s, d), k/v: (b, hq, s, d) already repeated."""
    d = q.shape[-1]
    s = q.shape[2]
    w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    w = w.masked_fill(mask, masked_value)
    w = torch.softmax(w, dim=-1, dtype=torch.float32)
    return torch.matmul(w, v)


def heads(x, n, d):
    b, s, _ = x.shape
    return x.view(b, s, n, d).transpose(1, 2)


def hf_attention(full, cfg, layer, x, cos, sin):
    """HF LlamaAttention (eager) from the full state dict. Returns (per-head output (b,h,s,d), o_proj output)."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    p = f"model.layers.{layer}.self_attn."
    q = heads(x @ full[p + "q_proj.weight"].T, nh, d)
    k = heads(x @ full[p + "k_proj.weight"].T, nkv, d)
    v = heads(x @ full[p + "v_proj.weight"].T, nkv, d)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    o = attend(q, repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv), torch.finfo(torch.float32).min)
    b, _, s, _ = o.shape
    return o, o.transpose(1, 2).reshape(b, s, nh * d) @ full[p + "o_proj.weight"].T


def local_qkv(sd, layer, q_out, kv_out):
    p = f"model.layers.{layer}.self_attn."
    if p + "qkv_proj.weight_qkv" in sd:
        return torch.split(sd[p + "qkv_proj.weight_qkv"], [q_out, kv_out, kv_out], dim=0)
    if p + "qkv_proj.weight_q" in sd:
        return sd[p + "qkv_proj.weight_q"], sd[p + "qkv_proj.weight_k"], sd[p + "qkv_proj.weight_v"]
    if p + "qkv_proj.weight" in sd:  # MHA, ColumnParallelLinear stride 3: [q_r; k_r; v_r]
        return torch.split(sd[p + "qkv_proj.weight"], q_out, dim=0)
    return sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"]


def q_heads_of(wq, full_q, d):
    """Which full query head each local head block is (exact row match)."""
    fb = torch.split(full_q, d)
    return [next(j for j, f in enumerate(fb) if torch.equal(b, f)) for b in torch.split(wq, d)]


def sharded_attention(case, cfg, shards, full, layer, x, cos, sin, kv_from=None):
    """Restated NxDT per-rank attention.  kv_from: optional {rank: other_rank} to take KV from."""
    tp, m = case["tp"], case["m"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    nh_l, nkv_l = nh // tp, nkv * m // tp
    q_out, kv_out = nh_l * d, nkv_l * d
    p = f"model.layers.{layer}.self_attn."
    outs, qmap, partial = [], [], 0
    for r in range(tp):
        sd = rank_state(shards, r, layer)
        wq, wk, wv = local_qkv(sd, layer, q_out, kv_out)
        if kv_from is not None:
            _, wk, wv = local_qkv(rank_state(shards, kv_from[r], layer), layer, q_out, kv_out)
        q = heads(x @ wq.T, nh_l, d)
        k = heads(x @ wk.T, nkv_l, d)
        v = heads(x @ wv.T, nkv_l, d)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        g = nh_l // nkv_l
        o = attend(q, repeat_kv(k, g), repeat_kv(v, g), -10000.0)
        outs.append(o)
        qmap += q_heads_of(wq, full[p + "q_proj.weight"], d)
        b, _, s, _ = o.shape
        partial = partial + o.transpose(1, 2).reshape(b, s, q_out) @ sd[p + "o_proj.weight"].T
    return torch.cat(outs, dim=1), qmap, partial


def wrong_kv_partner(case, cfg, shards, full):
    """For each rank, another rank holding a different KV slot (layer 0), or None if all equal."""
    tp, m = case["tp"], case["m"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    kv_out = nkv * m // tp * d
    ks = [local_qkv(rank_state(shards, r, 0), 0, nh // tp * d, kv_out)[1] for r in range(tp)]
    partner = {}
    for r in range(tp):
        cand = [o for o in list(range(r + 1, tp)) + list(range(r)) if not torch.equal(ks[o], ks[r])]
        if not cand:
            return None
        partner[r] = cand[0]
    return partner


# ------------------------------------------------------------------ upstream (NxDT) path

def upstream_available():
    return bool(os.environ.get("SHARDKIT_NXDT_SRC") and os.environ.get("SHARDKIT_NXD_SRC"))


def upstream_attention(case, cfg, shards, layers, x, pos):
    """Real NxDT LlamaForCausalLM per tp rank; returns per layer (concat pre-o_proj, summed o_proj) and
    the max |cos/sin| difference between NxDT's LlamaRotaryEmbedding.forward and ours."""
    sys.path.insert(0, HERE)
    import upstream_env as ue
    ml = ue.load_nxdt_modeling_llama()
    tp = case["tp"]
    qkv = case["qkv"]
    ql = qkv.startswith("weight_")
    fuse = qkv != "weight_q/_k/_v"
    conf = dict(cfg)
    conf.update(pretraining_tp=1, sequence_parallel_enabled=False, qkv_linear=ql, fuse_qkv=fuse,
                kv_shared_group_size=case["m"], use_flash_attention=False, use_ring_attention=False, lnc=1,
                transpose_nki_inputs=True, reduce_dtype=torch.float32, torch_dtype=torch.float32,
                pad_token_id=None)
    res = {layer: {"pre": [], "post": 0} for layer in layers}
    rope_diff = 0.0
    for r in range(tp):
        ue.set_tp(tp, r)
        model = ml.LlamaForCausalLM(ue._LlamaConfig(**conf))
        sd = {}
        for (rr, _pp), s in shards.items():
            if rr == r:
                sd.update(s)
        model.load_state_dict(sd, strict=True)  # names and local shapes == NxDT's module tree
        cos, sin = model.model.rotary_emb(x, pos)
        c2, s2 = rope_cos_sin(cfg, x.shape[1])
        rope_diff = max(rope_diff, (cos - c2).abs().max().item(), (sin - s2).abs().max().item())
        for layer in layers:
            attn = model.model.layers[layer].self_attn
            seen = {}
            h = attn.o_proj.register_forward_pre_hook(lambda mod, inp: seen.setdefault("x", inp[0]))
            with torch.no_grad():
                out, _ = attn(x, position_embeddings=(cos, sin))
            h.remove()
            b, s, _ = seen["x"].shape
            res[layer]["pre"].append(seen["x"].view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2))
            res[layer]["post"] = res[layer]["post"] + out
    ue.set_tp(1, 0)
    return {layer: (torch.cat(v["pre"], dim=1), v["post"]) for layer, v in res.items()}, rope_diff


# ------------------------------------------------------------------ main

def main():
    man = load_manifest()
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(2, 6, man["model"]["hidden"], generator=g)
    pos = torch.arange(6)[None].expand(2, 6)
    fulls = {k: load_full(man, k) for k in man["full"]}
    use_up = upstream_available()
    report = {"tolerance": TOL, "input": "randn(2, 6, hidden), torch.Generator seed 4321, fp32; weights bf16 -> fp32",
              "upstream_path_run": use_up, "cases": []}
    ok = True
    print(f"{'case':48s} {'pre-o_proj':>11s} {'o_proj sum':>11s} {'wrong-KV ctl':>12s}"
          + (f" {'NxDT real':>10s}" if use_up else "") + "  verdict")
    for case in man["cases"]:
        full, cfg = fulls[case["full"]]
        shards = load_shards(case)
        cos, sin = rope_cos_sin(cfg, x.shape[1])
        nh = cfg["num_attention_heads"]
        d = cfg["hidden_size"] // nh
        rec = {"name": case["name"], "layers": []}
        partner = wrong_kv_partner(case, cfg, shards, full)
        up = None
        if use_up:
            up, rope_diff = upstream_attention(case, cfg, shards, range(man["model"]["layers"]), x, pos)
            rec["nxdt_rope_vs_restated_max_abs"] = rope_diff
        worst_pre = worst_post = worst_up = 0.0
        ctl = None
        for layer in range(man["model"]["layers"]):
            ref_heads, ref_out = hf_attention(full, cfg, layer, x, cos, sin)
            cat, qmap, summed = sharded_attention(case, cfg, shards, full, layer, x, cos, sin)
            pre = (cat - ref_heads[:, qmap]).abs().max().item()
            post = (summed - ref_out).abs().max().item()
            lrec = {"layer": layer, "query_heads_in_rank_order": qmap,
                    "max_abs_pre_o_proj": pre, "max_abs_after_o_proj_sum": post}
            if partner is not None:
                _, _, bad = sharded_attention(case, cfg, shards, full, layer, x, cos, sin, kv_from=partner)
                lrec["wrong_kv_partner"] = [partner[r] for r in range(case["tp"])]
                lrec["max_abs_wrong_kv_control"] = (bad - ref_out).abs().max().item()
                ctl = lrec["max_abs_wrong_kv_control"] if ctl is None else min(ctl, lrec["max_abs_wrong_kv_control"])
            if up is not None:
                ucat, usum = up[layer]
                lrec["nxdt_real_vs_restated_pre_o_proj"] = (ucat - cat).abs().max().item()
                lrec["nxdt_real_vs_restated_o_proj_sum"] = (usum - summed).abs().max().item()
                lrec["nxdt_real_vs_hf_o_proj_sum"] = (usum - ref_out).abs().max().item()
                worst_up = max(worst_up, lrec["nxdt_real_vs_restated_pre_o_proj"],
                               lrec["nxdt_real_vs_restated_o_proj_sum"])
            worst_pre, worst_post = max(worst_pre, pre), max(worst_post, post)
            rec["layers"].append(lrec)
        expect_ok = case["name"] not in EXPECT_WRONG
        matches = worst_pre < TOL and worst_post < TOL
        verdict = "matches HF" if matches else "DOES NOT match HF"
        good = matches == expect_ok
        if ctl is not None and ctl < TOL:
            good = False
            verdict += ", control failed"
        if up is not None and worst_up >= TOL:
            good = False
            verdict += ", NxDT real != restated"
        verdict += " (expected)" if good else " (UNEXPECTED)"
        ok &= good
        rec.update(max_abs_pre_o_proj=worst_pre, max_abs_after_o_proj_sum=worst_post,
                   min_over_layers_wrong_kv_control=ctl, expected_to_match=expect_ok, verdict=verdict)
        if up is not None:
            rec["max_abs_nxdt_real_vs_restated"] = worst_up
        report["cases"].append(rec)
        print(f"{case['name']:48s} {worst_pre:11.3e} {worst_post:11.3e} "
              f"{('%.3e' % ctl) if ctl is not None else 'n/a':>12s}"
              + (f" {worst_up:10.3e}" if up is not None else "") + f"  {verdict}")
    if "--write-json" in sys.argv[1:]:
        with open(os.path.join(HERE, "forward_check.json"), "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

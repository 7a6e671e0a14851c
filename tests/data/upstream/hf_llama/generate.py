#!/usr/bin/env python3
"""Regenerate the upstream-truth HF-Llama fixtures in this directory.

Needs the upstream sources (NOT vendored here):
    SHARDKIT_NXD_SRC=<neuronx-distributed checkout>/src
    SHARDKIT_NXDT_SRC=<neuronx-distributed-training checkout>/src
and Debian's torch (/usr/bin/python3, torch 1.13).  Run from anywhere:

    SHARDKIT_NXD_SRC=... SHARDKIT_NXDT_SRC=... nice -n 19 /usr/bin/python3 generate.py

What it does (see README.md for the results):
  1. writes a tiny deterministic HF Llama state dict (bf16) as full_gqa/checkpoint.pt
     (8 query heads, 2 KV heads) and full_mha/checkpoint.pt (8/8), each with config.json;
  2. runs NxDT's examples/checkpoint_converter_scripts/checkpoint_converter.py -- the
     documented entry point, i.e. NxD's scripts/checkpoint_converter.py
     CheckpointConverterBase -- unmodified, with --convert_from_full_state, once per case,
     cwd = this directory, so the argv recorded in manifest.json is the exact argv;
  3. writes one tag with shardkit's own code (the Trn2 runtime KV rule), clearly named;
  4. runs --convert_to_full_state on every tag (into a temp dir) and compares with the input;
  5. derives from the data which query heads / KV heads each rank holds;
  6. runs a few upstream functions that decide KV placement at runtime
     (qkv_linear._initialize_affine_weight, parallel_state.arrange_kv_groups);
  7. builds NxDT's HF Llama module tree and runs NxDT's optimizer grouping on it
     (optimizer_groups.json).
Everything goes to manifest.json / optimizer_groups.json next to this file.
"""

import contextlib
import hashlib
import io
import json
import os
import runpy
import shutil
import sys
import tempfile
import types

import torch

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import upstream_env as ue  # noqa: E402

SEED_GQA = 1234
SEED_MHA = 5678
H, NH, HD, FFN, VOCAB, LAYERS = 64, 8, 8, 96, 128, 4
DTYPE = torch.bfloat16


# --------------------------------------------------------------------------- full state

def hf_config(kv_heads):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_attention_heads": NH,
        "num_key_value_heads": kv_heads,
        "head_dim": HD,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def build_full_state(kv_heads, seed):
    """HF LlamaForCausalLM.state_dict() key names and order, random bf16 values."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.125, offset=0.0):
        return (torch.randn(*shape, generator=g) * scale + offset).to(DTYPE)

    sd = {"model.embed_tokens.weight": rnd(VOCAB, H, scale=1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rnd(NH * HD, H)
        sd[p + "self_attn.k_proj.weight"] = rnd(kv_heads * HD, H)
        sd[p + "self_attn.v_proj.weight"] = rnd(kv_heads * HD, H)
        sd[p + "self_attn.o_proj.weight"] = rnd(H, NH * HD)
        sd[p + "mlp.gate_proj.weight"] = rnd(FFN, H)
        sd[p + "mlp.up_proj.weight"] = rnd(FFN, H)
        sd[p + "mlp.down_proj.weight"] = rnd(H, FFN)
        sd[p + "input_layernorm.weight"] = rnd(H, scale=0.1, offset=1.0)
        sd[p + "post_attention_layernorm.weight"] = rnd(H, scale=0.1, offset=1.0)
    sd["model.norm.weight"] = rnd(H, scale=0.1, offset=1.0)
    sd["lm_head.weight"] = rnd(VOCAB, H)
    return sd


# --------------------------------------------------------------------------- cases

FULL = {"gqa": ("full_gqa/checkpoint.pt", "full_gqa/config.json", 2),
        "mha": ("full_mha/checkpoint.pt", "full_mha/config.json", 8)}


def from_full_argv(full, out, hw, tp, pp, m, extra):
    ckpt, cfg, _ = FULL[full]
    return (["--model_style", "hf", "--input_dir", ckpt, "--output_dir", out, "--config", cfg,
             "--hw_backend", hw, "--tp_size", str(tp), "--pp_size", str(pp), "--n_layers", str(LAYERS),
             "--kv_size_multiplier", str(m)] + extra + ["--convert_from_full_state"])


def to_full_argv(case, out):
    ckpt, cfg, _ = FULL[case["full"]]
    return (["--model_style", "hf", "--input_dir", os.path.join(case["dir"], "model"), "--output_dir", out,
             "--config", cfg, "--hw_backend", case["hw"], "--tp_size", str(case["tp"]),
             "--pp_size", str(case["pp"]), "--n_layers", str(LAYERS),
             "--kv_size_multiplier", str(case["m"])] + case["extra"] + ["--convert_to_full_state"])


QKV_LINEAR_FUSED = ["--qkv_linear", "True", "--fuse_qkv", "True"]
QKV_LINEAR_SPLIT = ["--qkv_linear", "True"]
MHA_STRIDE3 = ["--coalesce_qkv", "True", "--fuse_qkv", "True"]

CASES = [
    dict(name="trn1_tp8_pp2_kv4_fused", full="gqa", hw="trn1", tp=8, pp=2, m=4, extra=QKV_LINEAR_FUSED,
         qkv="weight_qkv", writer="upstream"),
    dict(name="trn1_tp8_pp2_kv4_split", full="gqa", hw="trn1", tp=8, pp=2, m=4, extra=QKV_LINEAR_SPLIT,
         qkv="weight_q/_k/_v", writer="upstream"),
    dict(name="trn1_tp4_pp1_kv2_fused", full="gqa", hw="trn1", tp=4, pp=1, m=2, extra=QKV_LINEAR_FUSED,
         qkv="weight_qkv", writer="upstream"),
    dict(name="trn2_tp4_pp1_kv2_fused_converter", full="gqa", hw="trn2", tp=4, pp=1, m=2, extra=QKV_LINEAR_FUSED,
         qkv="weight_qkv", writer="upstream"),
    dict(name="trn2_tp4_pp1_kv2_fused_runtime_rule_shardkit", full="gqa", hw="trn2", tp=4, pp=1, m=2,
         extra=QKV_LINEAR_FUSED, qkv="weight_qkv", writer="shardkit",
         derived_from="trn2_tp4_pp1_kv2_fused_converter"),
    dict(name="mha_tp4_pp2_stride3", full="mha", hw="trn1", tp=4, pp=2, m=1, extra=MHA_STRIDE3,
         qkv="qkv_proj.weight (stride 3)", writer="upstream"),
]
for _c in CASES:
    _c["dir"] = os.path.join("tags", _c["name"])


def converter_script():
    return os.path.join(os.path.dirname(ue.nxdt_src()), "examples", "checkpoint_converter_scripts",
                        "checkpoint_converter.py")


def run_converter(argv):
    """Run NxDT's checkpoint_converter.py as `python3 checkpoint_converter.py <argv>` (cwd = HERE)."""
    script = converter_script()
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [os.path.basename(script)] + list(argv)
    os.chdir(HERE)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return out.getvalue()


# --------------------------------------------------------------------------- inspection

def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def shard_files(case_dir):
    d = os.path.join(HERE, case_dir, "model")
    return sorted(os.listdir(d))


def load_shards(case):
    """{(tp_rank, pp_rank): state_dict} of one tag."""
    out = {}
    for fn in shard_files(case["dir"]):
        parts = fn[:-3].split("_")  # dp_rank_00_tp_rank_XX_pp_rank_YY
        tp, pp = int(parts[5]), int(parts[8])
        out[(tp, pp)] = torch.load(os.path.join(HERE, case["dir"], "model", fn), map_location="cpu")
    return out


def local_qkv(case, sd, layer, kv_heads):
    """Per-rank q, k, v rows of one layer, split the way NxDT's forward splits them."""
    tp, m = case["tp"], case["m"]
    p = f"model.layers.{layer}.self_attn."
    q_out = NH * HD // tp
    kv_out = kv_heads * HD * m // tp
    if p + "qkv_proj.weight_qkv" in sd:
        # qkv_linear.py GQAQKVLinearWithAsyncCommunication.forward: split [q, kv, kv]
        return torch.split(sd[p + "qkv_proj.weight_qkv"], [q_out, kv_out, kv_out], dim=0)
    if p + "qkv_proj.weight_q" in sd:
        return sd[p + "qkv_proj.weight_q"], sd[p + "qkv_proj.weight_k"], sd[p + "qkv_proj.weight_v"]
    if p + "qkv_proj.weight" in sd:
        # modeling_llama.py LlamaAttention.forward fused MHA path: split(split_size = heads*hd/tp)
        return torch.split(sd[p + "qkv_proj.weight"], q_out, dim=0)
    return sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"]


def match_heads(local, full, dim=0):
    """For each head_dim block of `local` (rows, or columns if dim=1) the index of the bit-identical
    block of `full`, or -1 (no full head matches)."""
    lb = torch.split(local, HD, dim=dim)
    fb = torch.split(full, HD, dim=dim)
    res = []
    for b in lb:
        hit = [j for j, f in enumerate(fb) if torch.equal(b, f)]
        res.append(hit[0] if len(hit) == 1 else -1)
    return res


def layer_pp_rank(case, layer):
    per = LAYERS // case["pp"]
    return layer // per


def derive_layout(case, full_sd, shards):
    kv_heads = FULL[case["full"]][2]
    group = NH // kv_heads
    per_layer = []
    for layer in range(LAYERS):
        pp = layer_pp_rank(case, layer)
        ranks = []
        for r in range(case["tp"]):
            sd = shards[(r, pp)]
            if not any(k.startswith(f"model.layers.{layer}.") for k in sd):
                raise AssertionError(f"layer {layer} not on pp rank {pp}")
            q, k, v = local_qkv(case, sd, layer, kv_heads)
            p = f"model.layers.{layer}.self_attn."
            qh = match_heads(q, full_sd[p + "q_proj.weight"])
            kh = match_heads(k, full_sd[p + "k_proj.weight"])
            vh = match_heads(v, full_sd[p + "v_proj.weight"])
            oh = match_heads(sd[p + "o_proj.weight"], full_sd[p + "o_proj.weight"], dim=1)
            n_rep = len(qh) // len(kh)
            # NxDT LlamaAttention.forward: repeat_kv(local kv, num_heads/num_kv_heads) -> local query
            # head j attends with local kv head j // n_rep.
            pairing_ok = (all(kh[j // n_rep] >= 0 and qh[j] >= 0 and qh[j] // group == kh[j // n_rep]
                              for j in range(len(qh))) and kh == vh and qh == oh)
            ranks.append({"q_heads": qh, "o_proj_col_heads": oh, "k_heads": kh, "v_heads": vh,
                          "pairing_ok": pairing_ok})
        per_layer.append(ranks)
    same = all(pl == per_layer[0] for pl in per_layer)
    ranks = per_layer[0]
    tp, m = case["tp"], case["m"]
    n = kv_heads * m // tp
    trn1 = [[(r * n + i) % kv_heads for i in range(n)] for r in range(tp)]
    trn2 = [[(r * n + i) // m for i in range(n)] for r in range(tp)]
    got = [x["k_heads"] for x in ranks]
    return {
        "same_for_all_layers": same,
        "pairing_ok_all_ranks_all_layers": all(x["pairing_ok"] for pl in per_layer for x in pl),
        "kv_placement_matches": {"trn1_repeat (slot r % (tp/m))": got == trn1,
                                 "trn2_repeat_interleave_head_level (slot r // m)": got == trn2},
        "per_rank": ranks,
    }


def describe_files(case):
    files = []
    for fn in shard_files(case["dir"]):
        path = os.path.join(HERE, case["dir"], "model", fn)
        sd = torch.load(path, map_location="cpu")
        files.append({
            "path": os.path.join(case["dir"], "model", fn),
            "bytes": os.path.getsize(path),
            "sha256": sha256(path),
            "tensors": [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                        for k, v in sd.items()],
        })
    return files


def compare_full(full_sd, got):
    missing = sorted(set(full_sd) - set(got))
    extra = sorted(set(got) - set(full_sd))
    mism = []
    for k in full_sd:
        if k in got:
            a, b = full_sd[k], got[k]
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                r = {"name": k, "want_shape": list(a.shape), "got_shape": list(b.shape), "got_dtype": str(b.dtype)}
                if a.shape == b.shape and a.dim() == 2 and a.shape[0] % HD == 0 and "_proj" in k:
                    r["got_row_blocks_are_full_heads"] = match_heads(b, a)
                mism.append(r)
    status = "bit-exact" if not (missing or extra or mism) else "differs"
    return {"status": status, "missing": missing, "extra": extra, "mismatched": mism}


def round_trip(case, full_sd):
    tmp = tempfile.mkdtemp(prefix="shardkit_rt_")
    out = os.path.join(tmp, case["name"])
    argv = to_full_argv(case, out)
    rec = {"argv": [a if a != out else "$TMP/" + case["name"] for a in argv]}
    try:
        run_converter(argv)
        got = torch.load(os.path.join(out, "checkpoint.pt"), map_location="cpu")
        rec.update(compare_full(full_sd, got))
    except Exception as e:  # record, do not hide
        rec.update({"status": "error", "error": f"{type(e).__name__}: {e}"})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rec


# --------------------------------------------------------------------------- shardkit-written tag

def write_trn2_runtime_rule(case, src_case, full_sd):
    """Trn2 KV placement as NxD's runtime lays it out, at KV-head granularity.

    NxD src/neuronx_distributed/modules/qkv_linear.py _initialize_affine_weight (L79-L87):
        TRN2: repeated_weight = torch.repeat_interleave(master_weight, tp_size_multiplier, dim=0)
              "(K0,K0,K0.... 8 times)(K1,K1,....) ... for all K heads"
        TRN1: repeated_weight = master_weight.repeat(tp_size_multiplier, 1)
    then create_local_weight gives rank r the r-th contiguous block (stride 1).  Read per head
    (as the comment and parallel_state.arrange_kv_groups' Trn2 branch L1615-L1628, which puts
    ranks k*m .. k*m+m-1 in one KV-shared group, both describe) rank r holds KV head
    (r * n + i) // m, n = kv_heads * m / tp.  (The code itself interleaves *rows*, not heads:
    see manifest.json "runtime_init_probe".)
    Q and o_proj stay as the converter's trn2 branch wrote them (heads in natural order,
    rank r holding query heads r*NH/tp ..), which is the order this KV rule needs.
    Everything else is copied from the converter's tag unchanged."""
    rewrite_kv_trn2_rule(os.path.join(HERE, src_case["dir"], "model"), os.path.join(HERE, case["dir"], "model"),
                         case["tp"], case["m"], FULL[case["full"]][2], full_sd)


def trn2_rule_kv(full_w, kv_heads, m, tp, tp_rank):
    """Rank tp_rank's rows of repeat_interleave(K heads, m) -- whole heads, see above."""
    kv_out = kv_heads * HD * m // tp
    rep = torch.repeat_interleave(full_w.view(kv_heads, HD, H), m, dim=0).reshape(kv_heads * m * HD, H)
    return rep.narrow(0, tp_rank * kv_out, kv_out)


def rewrite_kv_trn2_rule(src_dir, dst_dir, tp, m, kv_heads, full_sd):
    q_out = NH * HD // tp
    os.makedirs(dst_dir)
    for fn in sorted(os.listdir(src_dir)):
        tp_rank = int(fn[:-3].split("_")[5])
        sd = torch.load(os.path.join(src_dir, fn), map_location="cpu")
        out = {}
        for name, t in sd.items():
            if name.endswith("self_attn.qkv_proj.weight_qkv"):
                base = name[: -len("qkv_proj.weight_qkv")]
                t = torch.cat([t[:q_out]] + [trn2_rule_kv(full_sd[base + w], kv_heads, m, tp, tp_rank)
                                             for w in ("k_proj.weight", "v_proj.weight")], dim=0).clone()
            elif name.endswith("self_attn.qkv_proj.weight_k") or name.endswith("self_attn.qkv_proj.weight_v"):
                base = name[: -len("qkv_proj.weight_k")]
                w = "k_proj.weight" if name.endswith("_k") else "v_proj.weight"
                t = trn2_rule_kv(full_sd[base + w], kv_heads, m, tp, tp_rank).clone()
            out[name] = t
        torch.save(out, os.path.join(dst_dir, fn))


# --------------------------------------------------------------------------- runtime probes

def runtime_init_probe():
    """Run NxD's own KV-weight init / KV-group code (function bodies unmodified, see
    upstream_env.upstream_function) to see which master KV rows each tp rank gets."""
    hw_mod = ue.load_nxd_module("neuronx_distributed.utils.utils")
    hardware = hw_mod.hardware
    ensure, l_e0, l_e1 = ue.upstream_function("neuronx_distributed/parallel_layers/utils.py",
                                              "ensure_divisibility")
    divide, l_d0, l_d1 = ue.upstream_function("neuronx_distributed/parallel_layers/utils.py", "divide",
                                              ensure_divisibility=ensure)
    state = {"tp": 1, "rank": 0, "hw": "trn1"}
    clw, l_c0, l_c1 = ue.upstream_function(
        "neuronx_distributed/parallel_layers/layers.py", "create_local_weight", divide=divide,
        get_tensor_model_parallel_rank=lambda: state["rank"],
        get_tensor_model_parallel_size=lambda: state["tp"],
        is_torch_version_greater_than_2=lambda: False)  # torch 1.13 here; only matters for fp8
    iaw, l_i0, l_i1 = ue.upstream_function(
        "neuronx_distributed/modules/qkv_linear.py", "_initialize_affine_weight",
        set_tensor_model_parallel_attributes=lambda **kw: None,
        get_tensor_model_parallel_size=lambda: state["tp"],
        Parameter=torch.nn.Parameter, get_xla_rng_tracker=None, hardware=hardware,
        get_platform_target=lambda: state["hw"], create_local_weight=clw)
    akg, l_a0, l_a1 = ue.upstream_function("neuronx_distributed/parallel_layers/parallel_state.py",
                                           "arrange_kv_groups", hardware=hardware)

    def mark_rows(w):  # master row i := i, so local rows name the master rows they came from
        with torch.no_grad():
            w.copy_(torch.arange(w.shape[0], dtype=w.dtype)[:, None].expand_as(w))

    out = {"upstream": {
        "qkv_linear.py:_initialize_affine_weight": [l_i0, l_i1],
        "layers.py:create_local_weight": [l_c0, l_c1],
        "parallel_layers/utils.py:divide": [l_d0, l_d1],
        "parallel_state.py:arrange_kv_groups": [l_a0, l_a1]},
        "note": "kv_heads=2, head_dim=8 (k_proj has 16 rows); master row i initialised to value i",
        "runs": []}
    kv_heads = 2
    for hw in ("trn1", "trn2"):
        for tp, m in ((8, 4), (4, 2)):
            state.update(tp=tp, hw=hw)
            per = kv_heads * HD * m // tp
            ranks = []
            for r in range(tp):
                state["rank"] = r
                w = torch.empty(per, H)
                iaw(w, kv_heads * HD, H, per, 0, mark_rows, tp_size_multiplier=m)
                rows = [int(x) for x in w[:, 0].tolist()]
                heads = sorted({x // HD for x in rows})
                whole = [h for h in heads if rows == list(range(h * HD, h * HD + HD))]
                ranks.append({"rank": r, "master_rows": rows, "heads_touched": heads,
                              "is_exactly_one_whole_head": whole[0] if whole else None})
            groups = akg(1, tp, m, False, hardware(hw))
            out["runs"].append({"hw": hw, "tp": tp, "kv_size_multiplier": m, "ranks": ranks,
                                "arrange_kv_groups": groups})
    return out


def argparse_probe():
    """argparse type=bool: what `--fuse_qkv False` means to the converter."""
    cc = ue.load_checkpoint_converter()
    p = cc.CheckpointConverterBase().get_arg_parser()
    a = p.parse_args(["--output_dir", "x", "--hw_backend", "trn1", "--fuse_qkv", "False", "--qkv_linear", "False",
                      "--coalesce_qkv", "False", "--convert_from_full_state"])
    return {"argv": ["--fuse_qkv", "False", "--qkv_linear", "False", "--coalesce_qkv", "False"],
            "parsed": {"fuse_qkv": a.fuse_qkv, "qkv_linear": a.qkv_linear, "coalesce_qkv": a.coalesce_qkv}}


def side_runs(full_gqa, full_mha):
    """Converter runs whose output is inspected and thrown away (not fixtures)."""
    res = []
    tmp = tempfile.mkdtemp(prefix="shardkit_side_")
    try:
        # (a) Trn2 with separate q/k/v: does to_full give the input back although the KV
        #     placement (converter) and Q order (trn2 branch) disagree?
        d = os.path.join(tmp, "trn2_split")
        case = dict(name="trn2_tp4_pp1_kv2_split", full="gqa", hw="trn2", tp=4, pp=1, m=2,
                    extra=QKV_LINEAR_SPLIT, dir=d)
        argv = from_full_argv("gqa", d, "trn2", 4, 1, 2, QKV_LINEAR_SPLIT)
        run_converter(argv)
        lay = derive_layout(dict(case, dir=os.path.relpath(d, HERE)), full_gqa,
                            load_shards(dict(case, dir=os.path.relpath(d, HERE))))
        rt = round_trip(dict(case, dir=os.path.relpath(d, HERE)), full_gqa)
        res.append({"what": "trn2 tp4 m2, qkv_linear, NOT fused (not kept)",
                    "argv": [a.replace(d, "$TMP/trn2_split") for a in argv],
                    "pairing_ok_all_ranks_all_layers": lay["pairing_ok_all_ranks_all_layers"],
                    "kv_placement_matches": lay["kv_placement_matches"],
                    "k_heads_per_rank": [x["k_heads"] for x in lay["per_rank"]],
                    "q_heads_per_rank": [x["q_heads"] for x in lay["per_rank"]],
                    "round_trip": {"status": rt["status"],
                                   "argv": [a.replace(os.path.relpath(d, HERE), "$TMP/trn2_split") for a in rt["argv"]]}})
        # (d) same non-fused Trn2 tag with K/V re-laid by the Trn2 runtime rule (head level):
        #     forward-correct, but does to_full give the input back?
        d4 = os.path.join(tmp, "trn2_split_runtime_rule")
        rewrite_kv_trn2_rule(os.path.join(d, "model"), os.path.join(d4, "model"), 4, 2, 2, full_gqa)
        case4 = dict(case, name="trn2_tp4_pp1_kv2_split_runtime_rule", dir=os.path.relpath(d4, HERE))
        lay4 = derive_layout(case4, full_gqa, load_shards(case4))
        rt4 = round_trip(case4, full_gqa)
        res.append({"what": "the same with K/V rewritten by the Trn2 runtime rule, head level (not kept)",
                    "pairing_ok_all_ranks_all_layers": lay4["pairing_ok_all_ranks_all_layers"],
                    "k_heads_per_rank": [x["k_heads"] for x in lay4["per_rank"]],
                    "round_trip": {"status": rt4["status"],
                                   "argv": [a.replace(os.path.relpath(d4, HERE), "$TMP/trn2_split_runtime_rule")
                                            for a in rt4["argv"]],
                                   "mismatched": rt4.get("mismatched", [])}})
        # (b) MHA without --fuse_qkv: same files as with it?
        d2 = os.path.join(tmp, "mha_nofuse")
        argv = from_full_argv("mha", d2, "trn1", 4, 2, 1, ["--coalesce_qkv", "True"])
        run_converter(argv)
        ref = next(c for c in CASES if c["name"] == "mha_tp4_pp2_stride3")
        same = True
        for fn in shard_files(ref["dir"]):
            a = torch.load(os.path.join(HERE, ref["dir"], "model", fn))
            b = torch.load(os.path.join(d2, "model", fn))
            same &= list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        res.append({"what": "MHA without --fuse_qkv (not kept)",
                    "argv": [x.replace(d2, "$TMP/mha_nofuse") for x in argv],
                    "tensors_identical_to_mha_tp4_pp2_stride3": same})
        # (c) MHA without --coalesce_qkv: what attention names come out?
        d3 = os.path.join(tmp, "mha_nocoalesce")
        argv = from_full_argv("mha", d3, "trn1", 4, 2, 1, ["--fuse_qkv", "True"])
        run_converter(argv)
        sd = torch.load(os.path.join(d3, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        res.append({"what": "MHA without --coalesce_qkv (not kept)",
                    "argv": [x.replace(d3, "$TMP/mha_nocoalesce") for x in argv],
                    "layer0_attention_tensors_tp0": {k: list(v.shape) for k, v in sd.items()
                                                     if k.startswith("model.layers.0.self_attn")}})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


# --------------------------------------------------------------------------- optimizer groups

OPT_VARIANTS = [
    # name, kv_heads, tp, kv_shared_group_size, qkv_linear, fuse_qkv
    ("gqa_qkv_linear_fused_tp8_kv4", 2, 8, 4, True, True),
    ("gqa_qkv_linear_split_tp8_kv4", 2, 8, 4, True, False),
    ("gqa_plain_q_k_v_tp2", 2, 2, 1, False, False),
    ("mha_fused_stride3_tp4", 8, 4, 1, False, True),
]


def nxdt_config(kv_heads, kvm, qkv_linear, fuse_qkv):
    # Attributes NxDT's lightning_modules/model/hf_models/llama_model.py HFLLamaModule._get_model
    # sets on the HF LlamaConfig (L27-L77) plus the HF config.json fields.
    c = hf_config(kv_heads)
    c.update(pretraining_tp=1, sequence_parallel_enabled=False, qkv_linear=qkv_linear, fuse_qkv=fuse_qkv,
             kv_shared_group_size=kvm, use_flash_attention=False, use_ring_attention=False, lnc=1,
             transpose_nki_inputs=True, reduce_dtype=torch.float32, torch_dtype=torch.float32,
             pad_token_id=None, output_attentions=False, output_hidden_states=False, use_cache=False,
             return_dict=False)
    return ue._LlamaConfig(**c)


def build_nxdt_model(kv_heads, tp, kvm, qkv_linear, fuse_qkv):
    ml = ue.load_nxdt_modeling_llama()
    ue.set_tp(tp)
    return ml.LlamaForCausalLM(nxdt_config(kv_heads, kvm, qkv_linear, fuse_qkv))


class _PPStage(torch.nn.Module):
    """Emulates NxDPPModel.local_named_parameters (NxD pipeline/model.py L1822-L1832): the
    parameters of one pipeline stage under their *original* (global) names.  Stage membership
    follows the converter's placement (pipeline/partition.py create_partitions; embedding on
    the first stage, final norm and lm_head on the last)."""

    def __init__(self, model, pp, pp_rank):
        super().__init__()
        self._model = [model]
        self.pp, self.pp_rank = pp, pp_rank

    def local_named_parameters(self, recurse=True):
        per = LAYERS // self.pp
        for n, p in self._model[0].named_parameters():
            if n.startswith("model.layers."):
                stage = int(n.split(".")[2]) // per
            elif "embed_tokens" in n:
                stage = 0
            else:
                stage = self.pp - 1
            if stage == self.pp_rank:
                yield n, p


def optimizer_groups():
    ml = ue.load_nxdt_modeling_llama()
    mu = ue.load_nxdt_param_grouping()
    setup, s0, s1 = ue.upstream_function(
        "neuronx_distributed_training/lightning_modules/model/hf_models/base_model.py",
        "BaseHfModel.setup_optimizer_param_groups", root="nxdt",
        get_param_groups_by_weight_decay=mu.get_param_groups_by_weight_decay)
    # NxD trainer/model.py NxDModel: what NxDT's self.model is (nxd.initialize_parallel_model).
    nxd_model = ue.load_nxd_module("neuronx_distributed.trainer.model")
    out = {
        "upstream": {
            "nxdt_commit": ue.NXDT_COMMIT, "nxd_commit": ue.NXD_COMMIT,
            "grouping": "NxDT src/neuronx_distributed_training/utils/model_utils.py get_param_groups_by_weight_decay",
            "caller": f"NxDT src/neuronx_distributed_training/lightning_modules/model/hf_models/base_model.py "
                      f"BaseHfModel.setup_optimizer_param_groups L{s0}-L{s1}",
            "model_tree": "NxDT src/neuronx_distributed_training/models/hf_models/modeling_llama.py LlamaForCausalLM "
                          "(real classes; NxD parallel layers replaced by same-named stand-ins, see upstream_env.py)",
            "wrapper": "NxD src/neuronx_distributed/trainer/model.py NxDModel (real class)",
            "blobs": {
                "model_utils.py": ue.git_blob_sha1(mu.__file__),
                "base_model.py": ue.git_blob_sha1(os.path.join(
                    ue.nxdt_src(), "neuronx_distributed_training/lightning_modules/model/hf_models/base_model.py")),
                "modeling_llama.py": ue.git_blob_sha1(ml.__file__),
                "trainer/model.py": ue.git_blob_sha1(nxd_model.__file__),
            },
        },
        "variants": {},
    }
    for name, kv, tp, kvm, ql, fq in OPT_VARIANTS:
        model = build_nxdt_model(kv, tp, kvm, ql, fq)
        names = {id(p): n for n, p in model.named_parameters()}
        shapes = {n: list(p.shape) for n, p in model.named_parameters()}

        def run(wrapped, flag):
            self_ = types.SimpleNamespace(config=types.SimpleNamespace(model={"do_layer_norm_weight_decay": flag}),
                                          model=wrapped)
            setup(self_)
            return [{"weight_decay": g["weight_decay"], "params": [names[id(p)] for p in g["params"]]}
                    for g in self_._optimizer_param_groups]

        v = {"tp": tp, "kv_shared_group_size": kvm, "qkv_linear": ql, "fuse_qkv": fq,
             "num_key_value_heads": kv, "local_param_shapes": shapes, "pp1": {}, "pp2": {}}
        pp1 = nxd_model.NxDModel(model, {"pipeline_parallel_size": 1})
        for flag in (True, False):
            v["pp1"][f"do_layer_norm_weight_decay={str(flag).lower()}"] = run(pp1, flag)
        for r in range(2):
            wrapped = nxd_model.NxDModel(_PPStage(model, 2, r), {"pipeline_parallel_size": 2})
            v["pp2"][f"pp_rank_{r}"] = {f"do_layer_norm_weight_decay={str(f).lower()}": run(wrapped, f)
                                        for f in (True, False)}
        out["variants"][name] = v
    return out


# --------------------------------------------------------------------------- main

def main():
    cc = ue.load_checkpoint_converter()
    manifest = {
        "upstream": {
            "nxd": {"repo": "aws-neuron/neuronx-distributed", "commit": ue.NXD_COMMIT,
                    "checkpoint_converter.py blob": ue.git_blob_sha1(cc.__file__)},
            "nxdt": {"repo": "aws-neuron/neuronx-distributed-training", "commit": ue.NXDT_COMMIT,
                     "examples/checkpoint_converter_scripts/checkpoint_converter.py blob":
                         ue.git_blob_sha1(converter_script())},
            "entry_point": "python3 examples/checkpoint_converter_scripts/checkpoint_converter.py <argv> "
                           "(NxDT), cwd = this directory",
        },
        "torch": torch.__version__,
        "model": {"hidden": H, "heads": NH, "head_dim": HD, "ffn": FFN, "vocab": VOCAB, "layers": LAYERS,
                  "dtype": "bfloat16", "seeds": {"gqa": SEED_GQA, "mha": SEED_MHA}},
        "full": {}, "cases": [],
    }
    fulls = {}
    for key, seed in (("gqa", SEED_GQA), ("mha", SEED_MHA)):
        ckpt, cfg, kv = FULL[key]
        os.makedirs(os.path.join(HERE, os.path.dirname(ckpt)), exist_ok=True)
        sd = build_full_state(kv, seed)
        torch.save(sd, os.path.join(HERE, ckpt))
        with open(os.path.join(HERE, cfg), "w") as f:
            json.dump(hf_config(kv), f, indent=2)
            f.write("\n")
        fulls[key] = torch.load(os.path.join(HERE, ckpt), map_location="cpu")
        manifest["full"][key] = {"checkpoint": ckpt, "config": cfg, "bytes": os.path.getsize(os.path.join(HERE, ckpt)),
                                 "sha256": sha256(os.path.join(HERE, ckpt)),
                                 "tensors": [{"name": k, "shape": list(v.shape)} for k, v in sd.items()]}

    shutil.rmtree(os.path.join(HERE, "tags"), ignore_errors=True)
    for case in CASES:
        rec = {k: case[k] for k in ("name", "full", "hw", "tp", "pp", "m", "qkv", "writer")}
        rec["dir"] = case["dir"]
        if case["writer"] == "upstream":
            argv = from_full_argv(case["full"], case["dir"], case["hw"], case["tp"], case["pp"], case["m"],
                                  case["extra"])
            rec["argv"] = argv
            rec["converter_stdout_tail"] = run_converter(argv).strip().splitlines()[-1]
        else:
            src = next(c for c in CASES if c["name"] == case["derived_from"])
            write_trn2_runtime_rule(case, src, fulls[case["full"]])
            rec["argv"] = None
            rec["written_by"] = "generate.py write_trn2_runtime_rule (shardkit code, not upstream)"
            rec["derived_from"] = case["derived_from"]
        rec["files"] = describe_files(case)
        rec["layout"] = derive_layout(case, fulls[case["full"]], load_shards(case))
        rec["round_trip_to_full"] = round_trip(case, fulls[case["full"]])
        manifest["cases"].append(rec)
        print(f"{case['name']}: pairing_ok={rec['layout']['pairing_ok_all_ranks_all_layers']} "
              f"kv={rec['layout']['kv_placement_matches']} round_trip={rec['round_trip_to_full']['status']}",
              file=sys.stderr)

    manifest["side_runs"] = side_runs(fulls["gqa"], fulls["mha"])
    manifest["argparse_probe"] = argparse_probe()
    manifest["runtime_init_probe"] = runtime_init_probe()
    with open(os.path.join(HERE, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    with open(os.path.join(HERE, "optimizer_groups.json"), "w") as f:
        json.dump(optimizer_groups(), f, indent=1)
        f.write("\n")


def render_tables():
    """Markdown for README.md from manifest.json + forward_check.json (no upstream needed)."""
    with open(os.path.join(HERE, "manifest.json")) as f:
        man = json.load(f)
    fc = {}
    if os.path.exists(os.path.join(HERE, "forward_check.json")):
        with open(os.path.join(HERE, "forward_check.json")) as f:
            fc = {c["name"]: c for c in json.load(f)["cases"]}
    out = []
    for c in man["cases"]:
        out.append(f"### `{c['dir']}`\n")
        out.append(f"hw `{c['hw']}`, tp {c['tp']}, pp {c['pp']}, kv_size_multiplier {c['m']}, attention "
                   f"`{c['qkv']}`, full input `{man['full'][c['full']]['checkpoint']}`.\n")
        if c["argv"]:
            out.append("Written by the upstream converter (cwd = this directory):\n")
            out.append("```\npython3 checkpoint_converter.py " + " ".join(c["argv"]) + "\n```\n")
        else:
            out.append(f"Written by shardkit code: {c['written_by']}, from `tags/{c['derived_from']}` "
                       "(everything except K/V copied).\n")
        out.append("| file | bytes |\n|---|---:|")
        for fdesc in c["files"]:
            out.append(f"| `{os.path.relpath(fdesc['path'], c['dir'])}` | {fdesc['bytes']} |")
        out.append(f"| total | {sum(x['bytes'] for x in c['files'])} |\n")
        by_pp = {}
        for fdesc in c["files"]:
            pp = int(fdesc["path"][-5:-3])
            by_pp.setdefault(pp, []).append([(t["name"], tuple(t["shape"]), t["dtype"]) for t in fdesc["tensors"]])
        for pp, lists in sorted(by_pp.items()):
            same = all(x == lists[0] for x in lists)
            out.append(f"pp_rank {pp}: tensors in file order ({'identical names/shapes/dtype on every tp rank' if same else 'DIFFER between tp ranks'}):\n")
            out.append("```")
            for n, sh, dt in lists[0]:
                out.append(f"{n:55s} {list(sh)} {dt}")
            out.append("```\n")
        lay = c["layout"]
        out.append("Per tp rank, from the data (head blocks matched bit-exactly against the full tensors; "
                   f"same for all layers: {lay['same_for_all_layers']}):\n")
        out.append("| tp rank | query heads (q rows) | o_proj column heads | K heads | V heads | queries paired with their own KV group |")
        out.append("|---:|---|---|---|---|---|")
        for r, x in enumerate(lay["per_rank"]):
            out.append(f"| {r} | {x['q_heads']} | {x['o_proj_col_heads']} | {x['k_heads']} | {x['v_heads']} | "
                       f"{'yes' if x['pairing_ok'] else '**no**'} |")
        out.append("")
        km = lay["kv_placement_matches"]
        out.append("KV placement equals: " + ", ".join(f"{k}: {v}" for k, v in km.items()) + ".\n")
        rt = c["round_trip_to_full"]
        out.append("Round trip `--convert_to_full_state`:\n")
        out.append("```\npython3 checkpoint_converter.py " + " ".join(rt["argv"]) + "\n```\n")
        if rt["status"] == "error":
            out.append(f"result: **error** `{rt['error']}`\n")
        elif rt["status"] == "bit-exact":
            out.append("result: every tensor of the input back, bit-exact (same names, shapes, dtype, bytes).\n")
        else:
            out.append(f"result: **differs**: {json.dumps(rt['mismatched'])} missing {rt['missing']} extra {rt['extra']}\n")
        if c["name"] in fc:
            f = fc[c["name"]]
            ctl = f["min_over_layers_wrong_kv_control"]
            out.append(f"Forward check (max abs over 4 layers): pre-o_proj {f['max_abs_pre_o_proj']:.3e}, after o_proj "
                       f"row-parallel sum {f['max_abs_after_o_proj_sum']:.3e}; wrong-KV control "
                       f"{'n/a' if ctl is None else '%.3e' % ctl}"
                       + (f"; real NxDT LlamaAttention vs restatement {f['max_abs_nxdt_real_vs_restated']:.3e}"
                          if "max_abs_nxdt_real_vs_restated" in f else "") + f" -> {f['verdict']}.\n")
    print("\n".join(out))


if __name__ == "__main__":
    if sys.argv[1:] == ["--tables"]:
        render_tables()
    else:
        main()

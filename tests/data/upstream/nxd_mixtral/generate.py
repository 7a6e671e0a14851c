#!/usr/bin/python3
"""Ground-truth Mixtral (MoE) checkpoint tags, written by the real upstream code.

Upstream (read-only, imported from the paths below, never copied here):
  NxD   aws-neuron/neuronx-distributed            fbac349b61a3adbb123c2983835af692840ff62f  ("Release 2.29")
  NxDT  aws-neuron/neuronx-distributed-training   9169aa03f39efd4eb02da63891a7ed98defb1714  ("2.26.0")
  torch_xla pytorch/xla v2.9.0                     5fab7053df86c8d503b98d9e7202ca8b8d4978c7 (4 files, as ../nxd_tags)
  lightning_utilities Lightning-AI/utilities v0.11.9 5a31a072dc11f2c0b45af67da7d4362818d994df
  NeMo  NVIDIA/NeMo v2.1.0 633cb602777bffefbe12066b0c915c87e7b469e9 (nemo/core/optim/lr_scheduler.py only)

What runs (all unmodified upstream code, on CPU, each rank in turn in one
process; training steps one thread per rank so ZeRO-1's collectives move data):
  model      NxDT models/hf_models/modeling_mixtral.py MixtralForCausalLM, built
             from NxD's real MoE modules (modules/moe: RouterTopK, ExpertMLPs,
             MoE) and parallel layers, at tp 2, with ep 1 and ep 2 (dp 2).
  optimizer  NxD trainer.initialize_parallel_optimizer -> NeuronZero1Optimizer
             (ep 1) / NeuronEPZero1Optimizer (ep 2) over torch.optim.AdamW, as
             NxDT's BaseModelModule.configure_optimizers calls it, param groups
             from NxDT utils/model_utils.py get_param_groups_by_weight_decay
             (hf_models/base_model.py: no_decay = ["bias"]); NxDT's
             mixed_precision (XLA_DOWNCAST_BF16=1: fp32 torch dtype, fp64
             master weights and moments, use_master_weights_in_ckpt False).
  scheduler  NeMo CosineAnnealing (what NxDT's prepare_lr_scheduler builds).
  save       NxD trainer/checkpoint.py save_checkpoint(..., zero1_optimizer=True),
             plain .pt and xser; and at ep 2 NxDT NLPCheckpointIO.save_checkpoint.
  (generate_megatron.py does the same for NxDT's Megatron-style model;
  --moe-frequency 2 makes the dense/MoE variant, plain .pt only.)

LOCAL CHANGES (ep 2 only; applied here by monkeypatching, no upstream line edited):
  1. enable_spmd_rank=True for NxDT's ExpertMLPs (functools.partial on the name
     modeling_mixtral.py imported).  NxDT never passes it, and at ep > 1
     ExpertMLPsV2.__init__ then fails: "'ExpertMLPs' object has no attribute
     'spmd_rank'" (expert_mlps_v2.py: self.spmd_rank.initialize_expert_indices).
  2. The optimizer's param groups leave out parameters with requires_grad False
     (the int32 SPMDRank `rank` and `local_expert_indices` that change 1 adds).
     torch_xla's ZeRO-1 with use_grad_acc_hook registers a grad-accumulation
     hook on every parameter (param.expand_as(param).grad_fn), which fails on
     them; this run records the failure message in generate.out.txt.
  The SPMDRank tensors are still in the model state dict (saved as NxD's
  __init__ leaves them: zeros).

Exact command: see README.md.  Deterministic: values derive from crc32 seeds
of parameter names; every gradient is an elementwise function of the rank's
own parameter values (the same on every replica), so no data is read.
"""

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import traceback
import warnings
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

warnings.simplefilter("ignore")  # NxD's blockwise.py warns once per missing NKI kernel

import mixtral_stubs  # noqa: E402
import nxd_stubs  # noqa: E402  (../nxd_tags, put on sys.path by mixtral_stubs)
from nxd_stubs import SIM  # noqa: E402


def load_nxd_tags_module(filename):
    """A script of ../nxd_tags as a module, for its helpers.  Those scripts set
    torch's thread counts at import, which torch allows once per process, so
    the setters are inert while they load (this file sets them itself)."""
    path = os.path.join(HERE, "..", "nxd_tags", filename)
    spec = importlib.util.spec_from_file_location("nxd_tags_" + filename[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    setters = torch.set_num_threads, torch.set_num_interop_threads
    torch.set_num_threads = torch.set_num_interop_threads = lambda n: None
    try:
        spec.loader.exec_module(mod)
    finally:
        torch.set_num_threads, torch.set_num_interop_threads = setters
    return mod


torch.set_num_threads(1)
torch.set_num_interop_threads(1)
TAGS_GEN = load_nxd_tags_module("generate.py")  # write recorder, tid order, compactness check, env setter, Lightning loops

TP, DP = 2, 2  # the mesh (set_mesh); tp 2 dp 2 unless --tp / --dp say otherwise
STEPS = 2
TAG = "step_2"  # NxD's example tag naming (step_<N>)

# tiny Mixtral (HF config.json keys; NxDT's HFMixtralModule._get_model sets the
# moe keys from cfg.model.moe of examples/conf/hf_mixtral_8x7b_config.yaml:
# num_experts 8 -> 4 here, frequency 1, capacity_factor 2.0, top_k 2,
# normalize_top_k_affinities True, router_aux_loss_coef 0.02)
MODEL = dict(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1000000.0, pad_token_id=None,
    initializer_range=0.02, hidden_act="silu", pretraining_tp=1, sliding_window=None,
    max_position_embeddings=32, tie_word_embeddings=False,
    # set by HFMixtralModule._get_model
    return_dict=False, sequence_parallel_enabled=False, qkv_linear=False, kv_shared_group_size=1,
    use_flash_attention=False, num_local_experts=4, moe_frequency=1, attention_dropout=0.0,
    capacity_factor=2.0, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
    normalize_top_k_affinities=True,
    # read by NxDT's LlamaMLP / attention forward only
    selective_checkpoint_enabled=False,
)

ROUTE = dict(  # NxDT precision.type mixed_precision, zero1 True (hf_mixtral_8x7b_config.yaml)
    env={"XLA_DOWNCAST_BF16": "1"},
    optimizer_config={"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": 1.0},  # as ../nxd_tags: clipping needs torch.distributed collectives
    mixed_precision_config={"use_master_weights": True, "use_fp32_grad_acc": True,
                            "use_master_weights_in_ckpt": False},
    # optim: adamw lr 3e-4 weight_decay 0.1 betas [0.9, 0.95]; capturable True in the
    # yaml, False here: torch 1.13's CPU AdamW asserts CUDA tensors when capturable
    adamw=dict(lr=3e-4, weight_decay=0.1, betas=[0.9, 0.95], capturable=False),
    sched=dict(warmup_steps=1, constant_steps=0, min_lr=3.0e-5, max_steps=10),
)

LOCAL_CHANGES = []


def set_mesh(tp, dp):
    """The mesh every function here runs (world tp x dp, pp 1), set before setup()."""
    global TP, DP
    TP, DP = tp, dp


def note_change(text):
    if text not in LOCAL_CHANGES:
        LOCAL_CHANGES.append(text)


# --------------------------------------------------------------------------
# model and values
# --------------------------------------------------------------------------


def _gen(*key):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(key).encode()) & 0x7FFFFFFF)
    return g


def full_value(name, shape):
    t = torch.randn(shape, generator=_gen("init", name), dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * t
    return 0.02 * t


def local_box(full, param, ep_size):
    """This rank's part of a full tensor, by NxD's own partition functions:
    experts by parallel_state.get_experts_for_expert_parallel_rank (dim 0),
    then the tensor-parallel split by parallel_layers.layers.create_local_weight
    with the parameter's partition_dim / partition_stride (set by NxD's layers)."""
    from neuronx_distributed.parallel_layers import parallel_state as ps
    from neuronx_distributed.parallel_layers.layers import create_local_weight

    t = full
    if getattr(param, "expert_model_parallel", False) or (ep_size == 1 and full.dim() == 3):
        experts = ps.get_experts_for_expert_parallel_rank(ps.get_expert_model_parallel_rank(), full.shape[0], ep_size)
        t = t[experts]
    dim = getattr(param, "partition_dim", None)
    if getattr(param, "tensor_model_parallel", False) and dim is not None:
        t = create_local_weight(t, dim, param.shape[dim], getattr(param, "partition_stride", 1))
    assert tuple(t.shape) == tuple(param.shape), (tuple(t.shape), tuple(param.shape))
    return t.clone()


def full_shape(param, ep_size):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", None) is not None:
        shape[param.partition_dim] *= TP
    if getattr(param, "expert_model_parallel", False):
        shape[0] *= ep_size
    return shape


def build_model(mm, ep):
    return set_values(mm.MixtralForCausalLM(mixtral_stubs.MixtralConfig(**MODEL)), ep)


def set_values(model, ep):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point:
                continue  # SPMDRank int32 tensors: kept as NxD's __init__ leaves them
            p.copy_(local_box(full_value(name, full_shape(p, ep)), p, ep))
    return model


def param_groups(model):
    """NxDT utils/model_utils.py get_param_groups_by_weight_decay with
    hf_models/base_model.py's no_decay = ["bias"] (real function, loaded from NXDT_SRC)."""
    mu = nxd_stubs._load_source(
        "nxdt_model_utils",
        os.path.join(os.environ["NXDT_SRC"], "neuronx_distributed_training", "utils", "model_utils.py"))
    return mu.get_param_groups_by_weight_decay(model, ["bias"])


def without_frozen(groups):
    note_change("optimizer param groups: parameters with requires_grad False (SPMDRank int32) left out")
    return [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in groups]


def hf_model_and_groups(mm, ep):
    model = build_model(mm, ep)
    groups = param_groups(model)
    return model, (without_frozen(groups) if ep > 1 else groups)


def train(model, groups, nxd_config, lr_mod):
    """NxDT's optimizer construction (BaseModelModule.configure_optimizers) and
    STEPS steps; lr_mod None: no scheduler (constant lr)."""
    import neuronx_distributed.trainer.trainer as nxd_trainer

    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **ROUTE["adamw"])
    optimizer = nxd_trainer.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, groups, **plain.defaults)
    sched = lr_mod.CosineAnnealing(optimizer, **ROUTE["sched"]) if lr_mod else None
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    model.lrs = []
    for step in range(STEPS):
        model.lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad()
        loss = 0.0
        for name, p in named:
            g = 0.01 * torch.sin(1000.0 * p.detach() + step)  # elementwise: equal on every replica
            loss = loss + (p * g).sum()
        loss.backward()
        optimizer.step()
        if sched:
            sched.step()
    return model, optimizer, sched, groups


# --------------------------------------------------------------------------
# gathering the full state from every rank's in-memory state
# --------------------------------------------------------------------------


def _coords(rank):
    from neuronx_distributed.parallel_layers import parallel_state as ps

    SIM.set_rank(rank)
    c = dict(tp=ps.get_tensor_model_parallel_rank(), dp=ps.get_data_parallel_rank(),
             ep=ps.get_expert_model_parallel_rank(), edp=ps.get_expert_data_parallel_rank())
    SIM.set_rank(0)
    return c


def assemble(shape, pieces):
    """pieces: list of (rank, param-like, local tensor).  Each rank's box is
    found by running local_box (NxD's partition functions) on an index tensor;
    every element must be covered, and replicas must agree bit for bit."""
    full = torch.empty(shape, dtype=pieces[0][2].dtype)
    seen = torch.zeros(shape, dtype=torch.bool)
    idx_full = torch.arange(full.numel(), dtype=torch.int64).reshape(shape)
    for rank, param, local, ep in pieces:
        SIM.set_rank(rank)
        idx = local_box(idx_full, param, ep).reshape(-1)
        flat, fseen = full.view(-1), seen.view(-1)
        prev = flat[idx]
        if bool(fseen[idx].any()):
            ok = fseen[idx]
            if not torch.equal(prev[ok], local.reshape(-1)[ok]):
                raise SystemExit(f"replicas disagree (rank {rank})")
        flat[idx] = local.reshape(-1)
        fseen[idx] = True
    SIM.set_rank(0)
    assert bool(seen.all()), "some elements of a full tensor are on no rank"
    return full


def optimizer_param_order(groups, ep):
    """ZeRO-1 index -> parameter object: base_state/shape_info index k is the
    k-th parameter over the (sharded) param groups in order
    (torch_xla ZeroRedundancyOptimizer.state_dict); under
    NeuronEPZero1Optimizer the expert optimizer's indices start at
    ep_base_state_offset (its state_dict)."""
    params = [p for g in groups for p in g["params"]]
    if ep == 1:
        return {"non_expert": params, "expert": []}
    is_ep = lambda p: getattr(p, "expert_model_parallel", False)  # noqa: E731
    return {"non_expert": [p for p in params if not is_ep(p)], "expert": [p for p in params if is_ep(p)]}


def gather_full_state(trained, ep):
    names_of = {r: {id(p): n for n, p in trained[r][0].named_parameters()} for r in trained}
    full = {"model": {}, "optimizer": {}, "lrs": trained[0][0].lrs,
            "weight_decay": sorted({g.get("weight_decay", ROUTE["adamw"]["weight_decay"]) for g in trained[0][3] if g["params"]}),
            "config": dict(MODEL), "tp": TP, "dp": DP, "ep": ep, "steps": STEPS}
    sd0 = trained[0][0].state_dict()
    for name in sd0:
        if name not in dict(trained[0][0].named_parameters()):  # a persistent buffer (Megatron's inv_freq)
            if not all(torch.equal(m.state_dict()[name], sd0[name]) for m, _, _, _ in trained.values()):
                raise SystemExit(f"buffer {name} differs between ranks")
            full["model"][name] = sd0[name].clone()
            continue
        pieces = []
        for r, (model, _, _, _) in trained.items():
            p = dict(model.named_parameters())[name]
            pieces.append((r, p, p.detach(), ep))
        if not sd0[name].dtype.is_floating_point:
            continue
        full["model"][name] = assemble(full_shape(pieces[0][1], ep), pieces)
    # optimizer moments: the ZeRO-1 shard of each rank, put back along the
    # sharding group (dim 0, padded to a multiple of the group size), then the
    # tp/ep box of the parameter
    per_param = {}
    for r, (model, opt, _, groups) in trained.items():
        sd = opt.state_dict()
        order = optimizer_param_order(groups, ep)
        base = sd["base_state"]
        off = sd.get("ep_base_state_offset", 0)
        for kind, plist in order.items():
            for k, p in enumerate(plist):
                i = k + (off if kind == "expert" else 0)
                per_param.setdefault(names_of[r][id(p)], []).append((r, p, base[i], sd["shape_info"][i], kind))
    for name, items in per_param.items():
        for key in ("exp_avg", "exp_avg_sq"):
            locals_ = {}
            for r, p, st, shape, kind in items:
                locals_.setdefault(_param_coords(r, kind), []).append((r, p, st[key], shape, kind))
            pieces = []
            for _, shards in sorted(locals_.items()):
                shards.sort(key=lambda x: _shard_index(x[0], x[4]))
                cat = torch.cat([s[2] for s in shards], dim=0)[: shards[0][3][0]]
                assert list(cat.shape) == list(shards[0][3]), (name, cat.shape, shards[0][3])
                r0, p0 = shards[0][0], shards[0][1]
                pieces.append((r0, p0, cat, ep))
            full["optimizer"].setdefault(name, {})[key] = assemble(full_shape(pieces[0][1], ep), pieces)
        full["optimizer"][name]["step"] = items[0][2]["step"].clone()
    return full


def _param_coords(rank, kind):
    """The ranks that hold the same parameter shard (a ZeRO-1 sharding group)."""
    c = _coords(rank)
    return (c["tp"], c["ep"]) if kind == "expert" else (c["tp"],)


def _shard_index(rank, kind):
    c = _coords(rank)
    return c["edp"] if kind == "expert" else c["dp"]


# --------------------------------------------------------------------------
# setup
# --------------------------------------------------------------------------


def nxd_setup(ep):
    """Stubs, the mesh and NxD's config for tp 2, dp 2 and this ep (both model styles)."""
    mixtral_stubs.install(TP, ep, DP)
    import neuronx_distributed.trainer.trainer as nxd_trainer
    from neuronx_distributed.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel = lambda *a, **k: None
    nxd_stubs._note("parallel_state.initialize_model_parallel (generate.py, after the mesh is known)", "no-op",
                    "neuronx_distributed_config() calls it to build process groups; the mesh is already known")
    return nxd_trainer.neuronx_distributed_config(
        tensor_parallel_size=TP, pipeline_parallel_size=1, expert_parallel_size=ep,
        optimizer_config=dict(ROUTE["optimizer_config"]),
        mixed_precision_config=dict(ROUTE["mixed_precision_config"]), sequence_parallel=False)


def enable_spmd_rank(module, ep):
    """Local change 1, on the ExpertMLPs name `module` imported."""
    if ep > 1:
        module.ExpertMLPs = functools.partial(module.ExpertMLPs, enable_spmd_rank=True)
        note_change("ExpertMLPs(..., enable_spmd_rank=True) where NxDT builds it")


def setup(ep):
    nxd_config = nxd_setup(ep)
    nlp_overrides = nxd_stubs.install_nxdt(os.environ["NXDT_SRC"], os.environ["LIGHTNING_UTILITIES_SRC"],
                                           os.environ["NEMO_SRC"])
    nxd_stubs.rebind()
    mm = mixtral_stubs.import_nxdt_modeling_mixtral()
    enable_spmd_rank(mm, ep)
    lr_mod = nxd_stubs.load_nemo_lr_scheduler(os.environ["NEMO_SRC"])
    return mm, nxd_config, lr_mod, nlp_overrides


def probe_failures(mm, nxd_config, ep, out):
    """What happens without each local change (ep 2), recorded for the README."""
    P = lambda *a: print(*a, file=out)  # noqa: E731
    import neuronx_distributed.trainer.trainer as nxd_trainer

    if ep == 1:
        return
    real = mm.ExpertMLPs.func
    mm.ExpertMLPs = real
    try:
        SIM.set_rank(0)
        mm.MixtralForCausalLM(mixtral_stubs.MixtralConfig(**MODEL))
        P("without local change 1: MixtralForCausalLM builds (unexpected)")
    except Exception as e:  # noqa: BLE001
        P(f"without local change 1 (enable_spmd_rank): {type(e).__name__}: {e}")
    mm.ExpertMLPs = functools.partial(real, enable_spmd_rank=True)

    def body(rank):
        model = build_model(mm, ep)
        plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **ROUTE["adamw"])
        nxd_trainer.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, param_groups(model), **plain.defaults)

    try:
        SIM.run_threaded(body)
        P("without local change 2: the optimizer initialises (unexpected)")
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        where = [ln.strip().splitlines()[0] for ln in tb if ln.strip().startswith("File")][-2:]
        P(f"without local change 2 (SPMDRank params in the ZeRO-1 groups): {type(e).__name__}: {e}")
        P("  raised at: " + _relative(" | ".join(where)))
    P("")


def reference_check(full, ep, out):
    """An independent tp 1 / dp 1 run on the full tensors: AdamW (torch 1.13,
    fp64 master copies as NxD's ZeRO-1 with optimizer_dtype double) on the same
    elementwise gradients.  Equality with the gathered state checks the
    gathering (ZeRO-1 shard order, tp/ep boxes), not NxD."""
    P = lambda *a: print(*a, file=out)  # noqa: E731
    model = None
    names = list(full["optimizer"])  # parameters (not Megatron's inv_freq buffers)
    params = {}
    for n in names:
        shape = full["model"][n].shape
        params[n] = full_value(n, shape)
    masters = {n: torch.nn.Parameter(params[n].double()) for n in names}
    assert len(full["weight_decay"]) == 1, full["weight_decay"]  # every parameter in one group (no "bias" names)
    opt = torch.optim.AdamW(list(masters.values()), **dict(ROUTE["adamw"], weight_decay=full["weight_decay"][0]))
    lr_sched = TAGS_GEN  # noqa: F841  (learning rates are taken from the trained optimizer below)
    for step in range(STEPS):
        for n in names:
            g = 0.01 * torch.sin(1000.0 * params[n] + step)
            if ep > 1 and full["model"][n].dim() == 3:
                g = g * (1.0 / ep)  # NeuronEPZero1Optimizer._get_sharding_schemes: expert grads scaled by 1/ep
            masters[n].grad = g.double()
        for gr in opt.param_groups:
            gr["lr"] = full["lrs"][step]
        opt.step()
        for n in names:
            params[n] = masters[n].detach().float()
    bad = []
    for n in names:
        st = opt.state[masters[n]]
        for key, a, b in (("param", params[n], full["model"][n]), ("exp_avg", st["exp_avg"], full["optimizer"][n]["exp_avg"]),
                          ("exp_avg_sq", st["exp_avg_sq"], full["optimizer"][n]["exp_avg_sq"])):
            if not (a.dtype == b.dtype and torch.equal(a, b)):
                bad.append(f"{n}.{key} (max abs diff {(a.double() - b.double()).abs().max().item():.3g})")
    P(f"reference check (independent AdamW on the full tensors, {STEPS} steps, lrs {full['lrs']}): "
      + ("all parameters and moments equal bit for bit" if not bad else "DIFFERS: " + "; ".join(bad)))
    P("")
    del model


def moe_facts(name, base, trained, ep, xser, out, moe_rule):
    P = lambda *a: print(*a, file=out)  # noqa: E731
    model0 = trained[0][0]
    layers = [m for n, m in model0.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)][0]
    is_moe = [any(type(m).__name__ == "MoE" for m in layer.modules()) for layer in layers]
    P(f"MoE layers ({moe_rule}): {[i for i, x in enumerate(is_moe) if x]}; dense: "
      f"{[i for i, x in enumerate(is_moe) if not x]}; MoE modules: "
      f"{[n for n, m in model0.named_modules() if type(m).__name__ == 'MoE']}")
    for rel in sorted(_walk(base)):
        if "/tensor_" in rel or not rel.endswith(".pt") or os.path.isdir(os.path.join(base, rel)):
            continue
        obj = torch.load(os.path.join(base, rel))
        if rel.startswith("model/") and rel.endswith(".pt") and not rel.endswith(".info.pt"):
            P(f"  {rel}:")
            for k, v in obj.items():
                P(f"    {k}: {_desc(v)}")
        elif rel.endswith(".info.pt"):
            P(f"  {rel}: " + json.dumps({str(k): {a: str(b) if not isinstance(b, bool) else b for a, b in v.items()}
                                          for k, v in obj.items()} if isinstance(obj, dict) else str(obj)))
        elif rel.startswith("optim/"):
            P(f"  {rel}: top-level keys {list(obj)}")
            for k in ("ep_param_id_offset", "ep_param_group_offset", "ep_base_state_offset", "ep_shape_info_offset"):
                if k in obj:
                    P(f"    {k} = {obj[k]}")
            for gi, g in enumerate(obj["param_groups"]):
                P(f"    param_groups[{gi}]: params {g['params']} " + str({k: v for k, v in g.items() if k != 'params'}))
    folders = sorted({os.path.dirname(r) for r in _walk(base) if r.endswith(".tensors") or ".tensors/" in r})
    for d in folders:
        fs = sorted(os.listdir(os.path.join(base, d)), key=lambda f: int(f[7:-3]) if f.startswith("tensor_") else -1)
        P(f"  {d}/: {len(fs)} files: {fs}")
    # optimizer index -> parameter, per writer rank
    names_of = {id(p): n for n, p in model0.named_parameters()}
    order = optimizer_param_order(trained[0][3], ep)
    sd = trained[0][1].state_dict()
    off = sd.get("ep_base_state_offset", 0)
    P(f"  optimizer index order ({'NeuronEPZero1Optimizer' if ep > 1 else 'NeuronZero1Optimizer'}, same on every rank):")
    for kind, plist in order.items():
        for k, p in enumerate(plist):
            i = k + (off if kind == "expert" else 0)
            P(f"    {i}: {names_of[id(p)]} [{kind}] base_state shape {tuple(sd['base_state'][i]['exp_avg'].shape)} "
              f"shape_info {list(sd['shape_info'][i])}")
    for r in sorted(trained):
        c = _coords(r)
        P(f"  rank {r}: tp {c['tp']} dp {c['dp']} ep {c['ep']} edp {c['edp']} -> optim/dp_rank_{c['dp']:02d}_tp_rank_{c['tp']:02d}_pp_rank_00.pt"
          f" holds ep rank {c['ep']}'s experts" + (f" ({experts_of(c['ep'], ep)})" if True else ""))
    P("")


def experts_of(ep_rank, ep):
    from neuronx_distributed.parallel_layers import parallel_state as ps

    return ps.get_experts_for_expert_parallel_rank(ep_rank, MODEL["num_local_experts"], ep)


def _walk(base):
    for dp, dirs, fs in os.walk(base):
        for x in dirs + fs:
            yield os.path.relpath(os.path.join(dp, x), base)


def _desc(v):
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')} {list(v.shape)}" + (
            " expert_model_parallel" if getattr(v, "expert_model_parallel", False) else "")
    return type(v).__name__ + (f" tid={v.tid}" if hasattr(v, "tid") else "")


def _relative(text):
    for var in ("TORCH_XLA_SRC", "NXD_SRC", "NXDT_SRC"):
        text = text.replace(os.path.abspath(os.environ[var]) + "/", "$" + var + "/")
    return text


def write_manifest(root):
    """size and sha256 of every data file here (not the scripts, outputs, docs)."""
    manifest = {}
    for dp, dirs, fs in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(fs):
            p = os.path.join(dp, f)
            rel = os.path.relpath(p, root)
            if rel == "manifest.json" or f.endswith((".py", ".md", ".txt")):
                continue
            with open(p, "rb") as fh:
                b = fh.read()
            manifest[rel] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    with open(os.path.join(root, "manifest.json"), "w") as fh:
        json.dump(dict(sorted(manifest.items())), fh, indent=1)
        fh.write("\n")
    # git keeps no empty folder; NxDT's lossy xser save leaves two (see README)
    empty = sorted(os.path.relpath(dp, root) for dp, dirs, fs in os.walk(root) if not dirs and not fs)
    with open(os.path.join(root, "empty_dirs.txt"), "w") as fh:
        fh.write("".join(e + "\n" for e in empty))
    return manifest


NXDT_TAG = "hf_mixtral--step=2-consumed_samples=16.0.ckpt"  # exp_manager filename 'hf_mixtral--{step}-{consumed_samples}' + .ckpt
NXDT_DIRPATH = "/home/ubuntu/nemo_experiments/hf_mixtral/checkpoints"  # fixed, so user_content.pt does not depend on the run


def nxdt_model_cfg():
    """cfg.model of NxDT's examples/conf/hf_mixtral_8x7b_config.yaml with this
    run's sizes, resolved as NeMo ModelPT does, plus target / nemo_version.
    It has no `wrap_with_zero`, so NLPCheckpointIO passes zero1_optimizer=False."""
    from omegaconf import OmegaConf

    full = OmegaConf.load(os.path.join(os.environ["NXDT_SRC"], "..", "examples", "conf", "hf_mixtral_8x7b_config.yaml"))
    m = full.model
    m.encoder_seq_length = MODEL["max_position_embeddings"]
    m.num_layers = MODEL["num_hidden_layers"]
    m.hidden_size = MODEL["hidden_size"]
    m.moe.num_experts = MODEL["num_local_experts"]
    m.optim.sched.warmup_steps = ROUTE["sched"]["warmup_steps"]
    cfg = OmegaConf.create(OmegaConf.to_container(m, resolve=True))
    cfg.target = "neuronx_distributed_training.lightning_modules.model.hf_models.mixtral_model.HFMixtralModule"
    cfg.nemo_version = "2.1.0"
    return cfg


def lightning_checkpoint(model_sd, opt_sd, sched):
    """What Lightning 2.5.0's CheckpointConnector.dump_checkpoint() hands to
    NLPCheckpointIO.save_checkpoint (key order as it builds them; as ../nxd_tags)."""
    path = os.path.join(NXDT_DIRPATH, NXDT_TAG)
    score = torch.tensor(STEPS)
    cb_key = ("NeMoModelCheckpoint{'monitor': 'step', 'mode': 'max', 'every_n_train_steps': 200000, "
              "'every_n_epochs': None, 'train_time_interval': None}")
    return {
        "epoch": 0, "global_step": STEPS, "pytorch-lightning_version": "2.5.0", "state_dict": model_sd,
        "loops": TAGS_GEN.lightning_loops(STEPS),
        "callbacks": {cb_key: {"monitor": "step", "best_model_score": score, "best_model_path": path,
                               "current_score": score, "dirpath": NXDT_DIRPATH, "best_k_models": {path: score},
                               "kth_best_model_path": path, "kth_value": score, "last_model_path": ""}},
        "optimizer_states": [opt_sd], "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs", "hyper_parameters": {"cfg": nxdt_model_cfg()},
    }


def save_nxdt_route(trained, nlp_overrides, out_dir, writes, out):
    """NxDT's own save route at ep 2: NLPCheckpointIO.save_checkpoint ->
    nxd.save_checkpoint(..., zero1_optimizer=cfg.wrap_with_zero (unset -> False))."""
    import neuronx_distributed as nxd

    for xser in (False, True):
        name = f"nxdt_ep2_{'xser' if xser else 'pt'}"
        ckpt_dir = os.path.join(out_dir, name)
        if os.path.exists(ckpt_dir):
            shutil.rmtree(ckpt_dir)
        nxd.trainer.checkpoint.g_iostate = None

        def save(rank):
            model, optimizer, sched, _ = trained[rank]
            ckpt = lightning_checkpoint(dict(model.state_dict()), optimizer.state_dict(), sched)
            io = nlp_overrides.NLPCheckpointIO(async_save=False, weight_init_only=False, ptl_version="2.5.0")
            io.save_checkpoint(ckpt, os.path.join(ckpt_dir, NXDT_TAG), save_type_xser=xser)

        del writes[:]
        SIM.run_sequential(save)
        TAGS_GEN.check_compact(ckpt_dir)
        try:
            TAGS_GEN.report(name, NXDT_TAG, ckpt_dir, trained, list(writes), out)
        except FileNotFoundError as e:  # the provenance table reads every tensor file an X.pt refers to
            print(f"  (provenance stops here: {os.path.relpath(e.filename, ckpt_dir)} does not exist)", file=out)
        lost_optimizer_facts(os.path.join(ckpt_dir, NXDT_TAG), out)


def lost_optimizer_facts(base, out):
    P = lambda *a: print(*a, file=out)  # noqa: E731
    optim = os.path.join(base, "optim")
    P("  optim/ holds: " + str(sorted(os.listdir(optim))))
    for f in sorted(os.listdir(optim)):
        p = os.path.join(optim, f)
        if os.path.isdir(p):
            P(f"  optim/{f}/: {len(os.listdir(p))} files")
    P("  model/ holds: " + str(sorted(os.listdir(os.path.join(base, "model")))))
    P("")


def hf_moe_rule():
    return f"NxDT HF: 0-based layer_index % moe_frequency({MODEL['moe_frequency']}) == 0"


def stem_of(style, ep, moe_frequency):
    """Tag stem: <style>_ep<E>, or <style>_freq<F>_ep<E> for the moe_frequency variants,
    or <style>_tp<T>_dp<D>_ep<E> for a mesh other than tp 2 dp 2."""
    if (TP, DP) != (2, 2):
        return f"{style}_tp{TP}_dp{DP}_ep{ep}"
    return f"{style}_ep{ep}" if moe_frequency == 1 else f"{style}_freq{moe_frequency}_ep{ep}"


def save_and_report(stem, trained, ep, out_dir, writes, out, moe_rule, config=None, containers=(False, True)):
    """Gather and check the full state, then save it with NxD's save_checkpoint
    as <stem>_pt and <stem>_xser (ZeRO-1; containers: False = plain, True = xser),
    each with its report."""
    full = gather_full_state(trained, ep)
    if config is not None:
        full["config"] = config
    reference_check(full, ep, out)
    torch.save(full, os.path.join(out_dir, f"{stem}_full_state.pt"))
    for xser in containers:
        name = f"{stem}_{'xser' if xser else 'pt'}"
        ckpt_dir = os.path.join(out_dir, name)
        if os.path.exists(ckpt_dir):
            shutil.rmtree(ckpt_dir)
        import neuronx_distributed as nxd

        nxd.trainer.checkpoint.g_iostate = None  # a fresh CheckpointIOState per run, as in a new job

        def save(rank):
            model, optimizer, sched, _ = trained[rank]
            nxd.save_checkpoint(ckpt_dir, tag=TAG, model=dict(model.state_dict()),
                                optimizer=optimizer.state_dict(), scheduler=sched,
                                user_content={"total_steps": STEPS, "ep": ep, "tp": TP, "dp": DP},
                                use_xser=xser, num_kept_ckpts=None, async_save=False, zero1_optimizer=True)

        del writes[:]
        SIM.run_sequential(save)
        TAGS_GEN.check_compact(ckpt_dir)
        TAGS_GEN.report(name, TAG, ckpt_dir, trained, list(writes), out)
        moe_facts(name, os.path.join(ckpt_dir, TAG), trained, ep, xser, out, moe_rule)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, choices=[1, 2])
    ap.add_argument("--moe-frequency", type=int, default=1,
                    help="a variant with dense layers between MoE ones (plain .pt only, no NxDT-route tags)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (world = tp x dp)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel size; dp 4 ep 2 makes expert-dp 2")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--list-stubs", action="store_true")
    ap.add_argument("--manifest", action="store_true", help="only (re)write manifest.json")
    args = ap.parse_args()
    if args.manifest:
        m = write_manifest(args.out)
        print(f"manifest.json: {len(m)} files, {sum(v['bytes'] for v in m.values())} bytes")
        return
    ep, freq = args.ep, args.moe_frequency
    set_mesh(args.tp, args.dp)
    MODEL["moe_frequency"] = freq
    mm, nxd_config, lr_mod, nlp_overrides = setup(ep)
    writes = TAGS_GEN.record_writes()
    if args.list_stubs:
        for n, what, why, aff in nxd_stubs.STUB_NOTES:
            print(f"- {n}\n    does: {what}\n    why: {why}\n    changes bytes on disk: {aff}")
        return
    out = sys.stdout
    if freq == 1 and (TP, DP) == (2, 2):  # recorded once, at the first mesh
        probe_failures(mm, nxd_config, ep, out)
    old = TAGS_GEN.set_env(ROUTE["env"])
    trained = SIM.run_threaded(lambda r: train(*hf_model_and_groups(mm, ep), nxd_config, lr_mod))
    save_and_report(stem_of("hf", ep, freq), trained, ep, args.out, writes, out, hf_moe_rule(),
                    containers=(False, True) if freq == 1 else (False,))
    if ep == 2 and freq == 1 and (TP, DP) == (2, 2):
        save_nxdt_route(trained, nlp_overrides, args.out, writes, out)
    TAGS_GEN.set_env(old)


if __name__ == "__main__":
    main()

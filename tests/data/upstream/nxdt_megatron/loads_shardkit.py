#!/usr/bin/env python3
"""Run NxDT's / NxD's own resume code (unmodified, on CPU) on checkpoint tags that shardkit wrote,
into the Megatron-style GPT / Llama model and ZeRO-1 optimizer that NxDT builds for their configs.

Regenerate (upstream sources extracted as in README.md; NOT vendored here; Debian torch 1.13):

    mkdir -p /tmp/up/{nxd,nxdt,nemo,xla}
    git --git-dir=<NxD git dir>  archive fbac349b61a3adbb123c2983835af692840ff62f | tar -x -C /tmp/up/nxd
    git --git-dir=<NxDT git dir> archive 9169aa03f39efd4eb02da63891a7ed98defb1714 | tar -x -C /tmp/up/nxdt
    git --git-dir=<NeMo git dir> archive v2.1.0 nemo/collections/nlp/modules/common/megatron | tar -x -C /tmp/up/nemo
    git --git-dir=<xla git dir>  archive v2.9.0 torch_xla/distributed | tar -x -C /tmp/up/xla
    export SHARDKIT_NXD_SRC=/tmp/up/nxd/src SHARDKIT_NXDT_SRC=/tmp/up/nxdt/src \\
           SHARDKIT_NEMO_SRC=/tmp/up/nemo SHARDKIT_XLA_SRC=/tmp/up/xla PYTHONDONTWRITEBYTECODE=1
    G='/tmp/nxdt_load/gpt/checkpoints/tiny_gpt--step=4-consumed_samples=32.0.ckpt'
    L='/tmp/nxdt_load/llama/checkpoints/tiny_llama--step=4-consumed_samples=32.0.ckpt'
    nice -n 19 /usr/bin/python3 loads_shardkit.py \\
        --tag gpt conf/tiny_gpt.yaml "$G" \\
        --tag llama conf/tiny_llama.yaml "$L" model.num_kv_heads=2 distributed_strategy.zero1=True \\
        > loads_shardkit.out.txt
(config paths are relative to the shardkit repo root; trailing key=value words are OmegaConf
dot-list overrides, as on NxDT's command line: the ones the tags were trained with, e.g.
shardkit-train conf/tiny_llama.yaml model.num_kv_heads=2 distributed_strategy.zero1=True.)
An earlier run found that conf/tiny_llama.yaml did not set share_embeddings_and_output_weights, whose
NxDT default is True (megatron_gpt_model.py L116), while shardkit-train defaulted to False: NxDT then
built a tied model and the strict key check still passed (both names exist), the embedding silently
taking the output layer's values. shardkit-train now defaults to True as NxDT does and the config
says False. --probe NAME CONF TAG [overrides] loads into what NxDT builds from other overrides and
reports without failing. Exit status is non-zero if a --tag load fails.

Per tag, two resume routes run on freshly built model + optimizer objects:

  route "nxdt" (what NxDT's Lightning resume does, in its order):
     NxDT NLPCheckpointIO.load_checkpoint(tag, load_type_xser)   [-> NxD load_checkpoint(model={}, optimizer={})]
     NxDT NLPDDPStrategy.load_model_state_dict(checkpoint)       [-> BaseModelModule.load_state_dict(strict=False)
                                                                   -> NxDModel.load_state_dict; raises on missing keys]
     Lightning Strategy.load_optimizer_state_dict (restated: optimizer.load_state_dict(optimizer_states[0]))
                                                                 [-> NxDOptimizer -> NeuronZero1Optimizer
                                                                   -> torch_xla ZeroRedundancyOptimizer.load_state_dict]
  route "nxd" (real objects handed to NxD):
     NxD load_checkpoint(dir, tag, model=<NxDModel>, optimizer=<NxDOptimizer>)   (strict=True default;
     NxD itself calls optimizer.load_state_dict, then model.load_state_dict(..., strict=True))

Stand-ins: megatron_env.py's (see README.md) plus, for NxD's checkpoint.py, the few listed in STUBS below.
"""

import argparse
import hashlib
import io
import logging
import os
import sys
import traceback
import types
import warnings

import torch

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, HERE)
import megatron_env as me  # noqa: E402
import importlib.util  # noqa: E402

# this directory's generate.py (megatron_env puts ../hf_llama, which has its own generate.py, first on sys.path)
_spec = importlib.util.spec_from_file_location("nxdt_megatron_generate", os.path.join(HERE, "generate.py"))
gen = importlib.util.module_from_spec(_spec)  # EXPECTED_BLOBS, zero1_class, AdamWDifferentiableKw, aliases
_spec.loader.exec_module(gen)

ue = me.ue

# git blob ids of the upstream files this script adds to generate.py's list (git ls-tree at the pins)
EXTRA_BLOBS = {
    "nxd": {
        "neuronx_distributed/trainer/checkpoint.py": "ed7a2655323c58f41520baaddee135224c2b24b9",
        "neuronx_distributed/trainer/checkpoint_storage.py": "d9a87c57bb16f2eb601f6d57a9fe911c6711c0d1",
    },
    "nxdt": {
        "neuronx_distributed_training/lightning_modules/nlp_overrides.py": "59e9e53a9642c8be700c29c93e678209b5912ac0",
        "neuronx_distributed_training/lightning_modules/model/base.py": "c9d9faa92ee14e64df2a4661e9561c9616394282",
        "neuronx_distributed_training/utils/utils.py": "1b7a747d7d69c659feb53567cecaa7b8ccf3fd12",
    },
}

STUBS = [
    "torch.distributed.is_initialized -> True, get_rank -> 0, get_world_size -> 1 (NxD load_checkpoint asserts "
    "is_initialized; one process, world size 1; no process group exists)",
    "torch_xla.core.xla_model.rendezvous -> no-op (world size 1)",
    "torch_xla.runtime.local_process_count -> 1 (NxD parallel_layers/utils.get_local_world_size, PJRT_DEVICE=NEURON)",
    "neuronx_distributed.optimizer package: __init__ skipped (as all packages in megatron_env); its two names "
    "(NeuronZero1Optimizer, NeuronEPZero1Optimizer) set from the real zero_redundancy_optimizer.py, as its __init__ does",
    "neuronx_distributed.pipeline.NxDPPModel -> placeholder class (checkpoint.py only uses it in isinstance; pp = 1)",
    "NxDT nemo.utils.logging (nlp_overrides) -> a logger whose messages are recorded in this report; NxD's "
    "checkpoint.py logger (real get_logger) has its stdout handler replaced by a recorder (no timestamps)",
    "NxDT nlp_overrides Float16Module -> fresh class nothing is an instance of (NxDT's models are not wrapped in it)",
    "Lightning Strategy.load_optimizer_state_dict (lightning 2.5.0, not installed) restated: "
    "for optimizer, opt_state in zip(self.optimizers, optimizer_states): optimizer.load_state_dict(opt_state) "
    "(its _optimizer_to_device(optimizer, root_device) is a CPU no-op here)",
    "model.use_cpu_initialization=True added when the config leaves it unset (shardkit's do): NxDT's default False "
    "initialises on xm.xla_device(); only where the initial values are made changes (they are overwritten by the load)",
    "torch.optim.AdamW (NeMo's 'adamw' = torch.optim.AdamW) -> generate.AdamWDifferentiableKw: accepts "
    "differentiable=False (torch 1.13 Optimizer.__setstate__ adds it to defaults; torch_xla init_zero passes it back)",
    "ZeRO-1 device -> generate.zero1_class (device stand-in, see README): on CPU, torch_xla's "
    "param.data.to('cpu') does not copy, so where the shard dtype equals the parameter dtype (Llama, fp32) each "
    "base-optimizer shard ALIASES its model parameter (two shards of one tied Parameter alias the same tensor)",
    "XLA_DOWNCAST_BF16 set as NxDT examples/training_orchestrator.py does (mixed_precision: 1, fp32: 0). With it and "
    "use_master_weights, NxD trainer.py L281-L283 sets optimizer_dtype=torch.double: on a Neuron device f64 is "
    "stored as fp32 and fp32 as bf16; on CPU the host dtypes stay (model fp32, GPT shards/Adam state float64). "
    "Comparisons below cast the loaded tensor to the file's dtype and say which casts occurred "
    "(fp32<->f64 and bf16->fp32 are exact)",
]


# --------------------------------------------------------------------------- helpers

def sha256_file(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def tbytes(t):
    t = t.detach().reshape(-1).contiguous()
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def tsha(t):
    return hashlib.sha256(tbytes(t)).hexdigest()[:16]


def same_bytes(a, b):
    return a.dtype == b.dtype and list(a.shape) == list(b.shape) and tbytes(a) == tbytes(b)


def dt(d):
    return str(d).replace("torch.", "")


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.msgs = []

    def emit(self, r):
        self.msgs.append(f"{r.levelname}: {r.getMessage()}")


# --------------------------------------------------------------------------- environment

def setup_env():
    ns = me.load()
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    xm.rendezvous = lambda *a, **k: None
    xr.local_process_count = lambda: 1
    torch.distributed.is_initialized = lambda: True
    torch.distributed.get_rank = lambda group=None: 0
    torch.distributed.get_world_size = lambda group=None: 1
    os.environ.setdefault("PJRT_DEVICE", "NEURON")
    opt_pkg = sys.modules["neuronx_distributed.optimizer"]
    opt_pkg.NeuronZero1Optimizer = ns.zero.NeuronZero1Optimizer
    opt_pkg.NeuronEPZero1Optimizer = ns.zero.NeuronEPZero1Optimizer
    pipe = sys.modules["neuronx_distributed.pipeline"]
    if not hasattr(pipe, "NxDPPModel"):
        pipe.NxDPPModel = type("NxDPPModel", (torch.nn.Module,), {"__doc__": "placeholder (isinstance only)"})
    import importlib
    ckpt = importlib.import_module("neuronx_distributed.trainer.checkpoint")
    nxd = types.SimpleNamespace(load_checkpoint=ckpt.load_checkpoint)  # as neuronx_distributed/__init__ exports it
    nxd_rec = Recorder()  # NxD's logger prints timestamps to stdout: record its messages instead
    for h in list(ckpt.logger.handlers):
        ckpt.logger.removeHandler(h)
    ckpt.logger.addHandler(nxd_rec)
    ckpt.logger.propagate = False

    rec = Recorder()
    nemo_log = logging.getLogger("nxdt.nemo.utils.logging")
    nemo_log.addHandler(rec)
    nemo_log.setLevel(logging.DEBUG)
    nemo_log.propagate = False
    from omegaconf import OmegaConf, DictConfig, ListConfig
    nlp = "neuronx_distributed_training/lightning_modules/nlp_overrides.py"
    get_attr, g0, g1 = ue.upstream_function("neuronx_distributed_training/utils/utils.py", "get_attribute_from_cfg",
                                            root="nxdt", OmegaConf=OmegaConf, DictConfig=DictConfig,
                                            ListConfig=ListConfig)
    io_load, a0, a1 = ue.upstream_function(nlp, "NLPCheckpointIO.load_checkpoint", root="nxdt", nxd=nxd, os=os,
                                           logging=nemo_log, _PATH=str)
    lmsd, b0, b1 = ue.upstream_function(nlp, "NLPDDPStrategy.load_model_state_dict", root="nxdt",
                                        Float16Module=type("Float16Module", (), {}), logging=nemo_log,
                                        get_attribute_from_cfg=get_attr, Mapping=dict)
    keys_ign, c0, c1 = ue.upstream_function(nlp, "NLPDDPStrategy._key_patterns_to_be_ignored", root="nxdt")
    base_lsd, d0, d1 = ue.upstream_function("neuronx_distributed_training/lightning_modules/model/base.py",
                                            "BaseModelModule.load_state_dict", root="nxdt")
    ns.functions_run.setdefault(nlp, []).extend([
        f"NLPCheckpointIO.load_checkpoint L{a0}-L{a1}", f"NLPDDPStrategy.load_model_state_dict L{b0}-L{b1}",
        f"NLPDDPStrategy._key_patterns_to_be_ignored L{c0}-L{c1}"])
    ns.functions_run["neuronx_distributed_training/lightning_modules/model/base.py"] = [
        f"BaseModelModule.load_state_dict L{d0}-L{d1}"]
    ns.functions_run["neuronx_distributed_training/utils/utils.py"] = [f"get_attribute_from_cfg L{g0}-L{g1}"]
    ns.ckpt, ns.nxd = ckpt, nxd
    ns.io_load, ns.load_model_state_dict, ns.key_patterns, ns.base_load_state_dict = io_load, lmsd, keys_ign, base_lsd
    ns.nemo_log_records = rec
    ns.nxd_log_records = nxd_rec
    return ns


# --------------------------------------------------------------------------- build as NxDT does

def load_cfg(path, overrides):
    from omegaconf import OmegaConf
    cfg = OmegaConf.load(path)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return cfg


def nxd_config_for(cfg):
    """NxDT lightning_modules/model/base.py _initialize_nxd_config L105-L161, restated for the keys that
    NxD's optimizer code reads (it calls nxd.neuronx_distributed_config, not run here)."""
    ptype = cfg.precision.get("type")
    if ptype == "manual":
        umw = cfg.precision.get("master_weights", False)
        acc = cfg.precision.get("fp32_grad_acc", False)
    else:
        umw = ptype in ("mixed_precision", "mixed_precisionSR", "autocast")
        acc = ptype in ("mixed_precision", "mixed_precisionSR", "autocast")
    z1 = cfg.distributed_strategy.get("zero1", True)
    clip = cfg.trainer.get("gradient_clip_val", None)
    return {
        "pipeline_parallel_size": cfg.distributed_strategy.get("pipeline_model_parallel_size", 1),
        "optimizer_config": {"zero_one_enabled": z1, "grad_clipping": clip is not None, "max_grad_norm": clip},
        "mixed_precision_config": {
            "use_master_weights": umw and z1, "use_fp32_grad_acc": acc and z1,
            "use_master_weights_in_ckpt":
                cfg.exp_manager.checkpoint_callback_params.get("use_master_weights_in_ckpt", False) and z1},
        "sequence_parallel": cfg.distributed_strategy.get("sequence_parallel", False),
    }


def build(ns, cfg, padded_vocab):
    """NxDT ModelModule.model_provider_func (unmodified) + NxDModel at pp = 1 + NeMo groups +
    NxD initialize_optimizer_from_class (unmodified) wrapped in NxDOptimizer."""
    me.set_tp(cfg.distributed_strategy.get("tensor_model_parallel_size", 1), 0)
    if cfg.model.get("use_cpu_initialization") is None:
        # shardkit's configs leave it unset (NxDT then initialises on the XLA device, xm.xla_device());
        # NxDT's example configs set it True.  Only the device of the initial values changes.
        from omegaconf import open_dict
        with open_dict(cfg):
            cfg.model.use_cpu_initialization = True
    torch.manual_seed(cfg.get("seed", 1234))
    self_ = types.SimpleNamespace(config=cfg, padded_vocab_size=padded_vocab, is_resuming_from_checkpoint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ns.provider(self_)
    nxd_config = nxd_config_for(cfg)
    wrapped = ns.nxd_model.NxDModel(model, nxd_config)
    lm = types.SimpleNamespace(config=cfg, model=wrapped)
    ns.setup(lm)  # NxDT MegatronGPTModel.setup_optimizer_param_groups -> NeMo
    groups = lm._optimizer_param_groups
    optim = cfg.model.optim
    defaults = dict(lr=float(optim.lr), weight_decay=float(optim.get("weight_decay", 0.0)),
                    betas=tuple(float(b) for b in optim.get("betas", (0.9, 0.999))))
    init = ns.initialize_optimizer_from_class  # NxD, both branches (ZeRO-1 or optimizer_class(params))
    init.__globals__["NeuronZero1Optimizer"] = gen.zero1_class(ns)
    lvl = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        zopt = init(nxd_config, gen.AdamWDifferentiableKw, groups, **defaults)
    logging.getLogger().setLevel(lvl)
    warns = sorted({str(x.message).split(";")[0] for x in w})
    opt = ns.nxd_optim.NxDOptimizer(zopt, nxd_config)
    return types.SimpleNamespace(model=model, wrapped=wrapped, lm=lm, opt=opt, zopt=zopt, nxd_config=nxd_config,
                                 groups=groups, defaults=defaults, warns=warns)


# --------------------------------------------------------------------------- checks

def positions(b):
    """(position, wrapper param, names) over the wrapper's groups, in order."""
    al = gen.aliases(b.model)
    out = []
    for g in b.zopt.param_groups:
        for p in g["params"]:
            out.append((len(out), p, al[id(p)]))
    return out


def check_model(out, b, file_sd, label):
    ok = True
    sd = b.wrapped.state_dict()
    casts = set()
    bad = []
    for k, v in file_sd.items():
        if k not in sd:
            continue
        m = sd[k]
        if m.dtype != v.dtype:
            casts.add(f"{dt(v.dtype)}->{dt(m.dtype)}")
        if not same_bytes(m, v.to(m.dtype)):
            bad.append(k)
    extra = sorted(set(sd) - set(file_sd))
    out.append(f"    {label}: {len(file_sd) - len(bad)}/{len(file_sd)} model tensors equal the file's bytes"
               f" (after the cast load_state_dict does: {', '.join(sorted(casts)) or 'none'})"
               + (f"; model keys not in file: {extra}" if extra else ""))
    for k in bad:
        m = sd[k]
        eq = [k2 for k2, v2 in file_sd.items() if k2 != k and list(v2.shape) == list(m.shape)
              and same_bytes(m, v2.to(m.dtype))]
        out.append(f"      DIFFERS: {k}" + (f" -- it holds the file's {eq}" if eq else ""))
        ok = False
    return ok


def check_optimizer(out, b, file_opt, label):
    ok = True
    sd_groups = file_opt["param_groups"]
    mine = b.zopt.param_groups
    sizes_f = [len(g["params"]) for g in sd_groups]
    sizes_m = [len(g["params"]) for g in mine]
    out.append(f"    {label}: wrapper param_groups sizes {sizes_m}, file {sizes_f}: "
               f"{'equal' if sizes_m == sizes_f else 'DIFFER'}")
    ok &= sizes_m == sizes_f
    for gi, (gm, gf) in enumerate(zip(mine, sd_groups)):
        diff = {k: (gm.get(k), gf.get(k)) for k in set(gm) | set(gf) if k != "params" and gm.get(k) != gf.get(k)}
        out.append(f"      group {gi} options after load "
                   f"{ {k: v for k, v in sorted(gm.items()) if k != 'params'} }"
                   + (f"; differ from file: {diff}" if diff else "; = file's"))
    if not hasattr(b.zopt, "base_optimizer"):
        st = b.zopt.state
        dropped = sorted(k for k in file_opt if k not in ("state", "param_groups"))
        out.append(f"      plain {type(b.zopt).__mro__[1].__name__}: parameters with Adam state after load: "
                   f"{sum(1 for p in {id(q): q for g in mine for q in g['params']}.values() if p in st)}"
                   f"/{len({id(q) for g in mine for q in g['params']})} (file top-level 'state' = "
                   f"{file_opt['state']!r}); file keys torch's load_state_dict does not read: {dropped}")
        if dropped:
            out.append("      => the file's Adam moments (in base_state) are NOT loaded: the optimizer restarts its "
                       "moments from zero")
            ok = False
        return ok
    base = b.zopt.base_optimizer
    shards = [s for g in base.param_groups for s in g["params"]]
    pos = positions(b)
    ids = [i for g in sd_groups for i in g["params"]]
    out.append(f"      file param ids, in position order: {ids}")
    out.append(f"      torch's id->shard map (zip of file ids with the base optimizer's {len(shards)} shards):")
    seen = {}
    for (p, param, names), i in zip(pos, ids):
        seen[i] = p
    for (p, param, names), i in zip(pos, ids):
        tag = "" if seen[i] == p else f"  (id {i} re-mapped to position {seen[i]}: later wins)"
        out.append(f"        position {p:2d} <- file id {i:2d}  {names[0]}"
                   + (f"  [same Parameter also at: {', '.join(names[1:])}]" if len(names) > 1 else "") + tag)
    orphans = sorted(k for k in base.state if not torch.is_tensor(k))
    with_state = [p for p, s in enumerate(shards) if s in base.state]
    out.append(f"      shards with Adam state after load: {len(with_state)}/{len(shards)}"
               + (f"; missing at positions {sorted(set(range(len(shards))) - set(with_state))}"
                  if len(with_state) != len(shards) else "")
               + (f"; ORPHAN int keys left in base state (matched no shard): {orphans}" if orphans else ""))
    ok &= len(with_state) == len(shards) and not orphans
    fbs = file_opt["base_state"]
    nbad = 0
    casts = set()
    for p, s in enumerate(shards):
        i = ids[p]
        if s not in base.state or i not in fbs:
            continue
        st = base.state[s]
        fst = fbs[i]
        if set(st) != set(fst):
            out.append(f"        position {p}: state keys {sorted(st)} != file {sorted(fst)}")
            nbad += 1
            continue
        for k in sorted(fst):
            a, f = st[k], fst[k]
            if torch.is_tensor(f):
                if torch.is_tensor(a) and a.dtype != f.dtype:
                    casts.add(f"{k}: file {dt(f.dtype)} -> loaded {dt(a.dtype)}")
                if not (torch.is_tensor(a) and same_bytes(a.to(f.dtype), f) and same_bytes(f.to(a.dtype), a)):
                    out.append(f"        position {p}: base state {k} differs from file id {i} "
                               f"({dt(a.dtype) if torch.is_tensor(a) else type(a).__name__} vs {dt(f.dtype)})")
                    nbad += 1
            elif a != f:
                out.append(f"        position {p}: base state {k} {a!r} != file {f!r}")
                nbad += 1
    steps = sorted({(dt(fbs[i]["step"].dtype), float(fbs[i]["step"])) if torch.is_tensor(fbs[i]["step"])
                    else ("python", fbs[i]["step"]) for i in fbs})
    out.append(f"      base state per shard == file base_state[file id] (exp_avg, exp_avg_sq, step; bytes after "
               f"cast; casts: {sorted(casts) or 'none'}): {'all equal' if nbad == 0 else f'{nbad} DIFFER'}; "
               f"file steps: {steps}")
    ok &= nbad == 0
    smw = file_opt.get("sharded_master_weights")
    if smw is not None:
        nbad = 0
        mcasts = sorted({f"file {dt(smw[ids[p]].dtype)} -> shard {dt(s.dtype)}" for p, s in enumerate(shards)})
        for p, s in enumerate(shards):
            if not (same_bytes(s.data.to(smw[ids[p]].dtype), smw[ids[p]]) and
                    same_bytes(smw[ids[p]].to(s.dtype), s.data)):
                nbad += 1
                out.append(f"        position {p}: shard != file sharded_master_weights[{ids[p]}]"
                           f" ({dt(s.dtype)} {list(s.shape)} vs {dt(smw[ids[p]].dtype)} {list(smw[ids[p]].shape)})")
        out.append(f"      shard data == file sharded_master_weights[file id] (bytes after cast; {', '.join(mcasts)}): "
                   f"{'all ' + str(len(shards)) + ' equal' if nbad == 0 else f'{nbad} DIFFER'}")
        ok &= nbad == 0
        # which values the model parameters hold at the end
        n_master = sum(1 for p, param, names in pos if same_bytes(param.data, smw[ids[p]].to(param.dtype)))
        out.append(f"      model parameters at the end equal their position's fp32 master weight: {n_master}/{len(pos)} "
                   f"positions" + (" (ZeRO-1 load_state_dict's allgather_weights_and_update_full_parameter ran last)"
                                   if n_master == len(pos) else
                                   " (the model file's values were loaded after the optimizer's allgather)"))
    return ok


def file_facts(out, name, model_sd, opt_sd):
    smw = opt_sd.get("sharded_master_weights")
    fbs = opt_sd["base_state"]
    out.append(f"  file optim: keys {list(opt_sd)}; top-level state {opt_sd['state']!r}; "
               f"param_groups sizes {[len(g['params']) for g in opt_sd['param_groups']]}; "
               f"base_state ids {sorted(fbs)}; shape_info ids {sorted(opt_sd.get('shape_info', {}))}"
               + (f"; sharded_master_weights ids {sorted(smw)}" if smw is not None else "; no sharded_master_weights"))
    shp_bad = [i for i, s in opt_sd.get("shape_info", {}).items()
               if i in fbs and list(fbs[i]["exp_avg"].shape) != list(s)]
    out.append(f"  file base_state exp_avg shapes == shape_info: {'yes' if not shp_bad else f'NO at {shp_bad}'}")
    return


def run_route(ns, route, cfg, tag_path, file_model, file_opt, out):
    b = build(ns, cfg, file_model["language_model.embedding.word_embeddings.weight"].shape[0])
    ckdir, tag = os.path.dirname(tag_path), os.path.basename(tag_path)
    ok = True
    ns.nemo_log_records.msgs.clear()
    ns.nxd_log_records.msgs.clear()
    if route == "nxdt":
        out.append("  route nxdt: NLPCheckpointIO.load_checkpoint -> NLPDDPStrategy.load_model_state_dict -> "
                   "optimizer.load_state_dict(optimizer_states[0])")
        step = "NLPCheckpointIO.load_checkpoint(tag, load_type_xser=False)"
        try:
            io_self = types.SimpleNamespace(_weight_init_only=False, ptl_version="2.5.0")
            xser = ns.ckpt.create_checkpoint_storage(ckdir).is_checkpoint_xser(tag)
            ck = ns.io_load(io_self, tag_path, xser)
            for m in ns.nxd_log_records.msgs:
                out.append(f"         NxD log: {m}")
            out.append(f"    OK   {step} (xser={xser}): keys {sorted(ck)}; state_dict {len(ck['state_dict'])} "
                       f"tensors; optimizer_states {len(ck['optimizer_states'])}; global_step {ck.get('global_step')}, "
                       f"consumed_samples {ck.get('consumed_samples')}")
            same = all(same_bytes(ck["state_dict"][k], v) for k, v in file_model.items()) and \
                set(ck["state_dict"]) == set(file_model)
            out.append(f"         returned state_dict == torch.load of the model file (keys, bytes): {same}")
        except Exception as e:  # noqa: BLE001
            out.append(f"    FAIL {step}: {type(e).__name__}: {e}")
            out.extend("      " + l for l in traceback.format_exc().rstrip().splitlines()[-6:])
            return False
        step = "NLPDDPStrategy.load_model_state_dict(checkpoint)"
        results = []

        def lm_load_state_dict(state_dict, strict=False):
            r = ns.base_load_state_dict(b.lm, state_dict, strict=strict)  # NxDT BaseModelModule.load_state_dict
            results.append((strict, r))
            return r
        lightning_module = types.SimpleNamespace(model=b.wrapped, config=cfg, load_state_dict=lm_load_state_dict)
        try:
            ns.load_model_state_dict(types.SimpleNamespace(lightning_module=lightning_module,
                                                           _key_patterns_to_be_ignored=lambda: ns.key_patterns(None)),
                                     ck)
            strict, r = results[0]
            out.append(f"    OK   {step}: model.load_state_dict(strict={strict}) -> missing_keys "
                       f"{list(r.missing_keys)}, unexpected_keys {list(r.unexpected_keys)}")
            ok &= not r.missing_keys and not r.unexpected_keys
        except Exception as e:  # noqa: BLE001
            out.append(f"    FAIL {step}: {type(e).__name__}: {e}")
            ok = False
        for m in ns.nemo_log_records.msgs:
            out.append(f"         NxDT log: {m}")
        ns.nemo_log_records.msgs.clear()
        step = "NxDModel.load_state_dict(state_dict, strict=True)"
        try:
            r = b.wrapped.load_state_dict(ck["state_dict"], strict=True)
            out.append(f"    OK   {step}: missing_keys {list(r.missing_keys)}, unexpected_keys "
                       f"{list(r.unexpected_keys)}")
        except Exception as e:  # noqa: BLE001
            out.append(f"    FAIL {step}: {type(e).__name__}: {e}")
            ok = False
        ok &= check_model(out, b, file_model, "after model load")
        step = "optimizer.load_state_dict(checkpoint['optimizer_states'][0]) [NxDOptimizer]"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for optimizer, opt_state in zip([b.opt], ck["optimizer_states"]):  # Lightning, restated
                    optimizer.load_state_dict(opt_state)
            out.append(f"    OK   {step}")
        except Exception as e:  # noqa: BLE001
            out.append(f"    FAIL {step}: {type(e).__name__}: {e}")
            out.extend("      " + l for l in traceback.format_exc().rstrip().splitlines()[-6:])
            return False
        ok &= check_optimizer(out, b, file_opt, "after optimizer load")
    else:
        out.append("  route nxd: NxD load_checkpoint(dir, tag, model=<NxDModel>, optimizer=<NxDOptimizer>), strict=True")
        step = "nxd load_checkpoint(model=NxDModel, optimizer=NxDOptimizer)"
        calls = []
        orig_model_lsd = b.wrapped.load_state_dict
        orig_opt_lsd = b.opt.load_state_dict

        def model_lsd(state_dict, strict=True):
            r = orig_model_lsd(state_dict, strict=strict)
            calls.append(f"NxDModel.load_state_dict(strict={strict}) -> missing_keys {list(r.missing_keys)}, "
                         f"unexpected_keys {list(r.unexpected_keys)}")
            return r

        def opt_lsd(state_dict):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                orig_opt_lsd(state_dict)
            calls.append("NxDOptimizer.load_state_dict(<optim file>) returned")
        b.wrapped.load_state_dict = model_lsd  # instance attribute: records the call, then runs NxDModel's own
        b.opt.load_state_dict = opt_lsd
        try:
            uc = ns.nxd.load_checkpoint(ckdir, tag, model=b.wrapped, optimizer=b.opt)
            out.append(f"    OK   {step}: user_content keys {sorted(uc) if isinstance(uc, dict) else uc}")
        except Exception as e:  # noqa: BLE001
            out.append(f"    FAIL {step}: {type(e).__name__}: {e}")
            out.extend("      " + l for l in traceback.format_exc().rstrip().splitlines()[-6:])
            ok = False
        finally:
            del b.wrapped.load_state_dict, b.opt.load_state_dict
        for m in ns.nxd_log_records.msgs:
            out.append(f"         NxD log: {m}")
        for c in calls:
            out.append(f"         NxD called {c}")
        if not ok:
            return False
        ok &= check_model(out, b, file_model, "after load (NxD loads the optimizer first, then the model)")
        ok &= check_optimizer(out, b, file_opt, "after load")
    out.append(f"    route {route}: {'PASS' if ok else 'FAIL'}")
    return ok


def manifest_vs_model(out, cfg, man, b, file_model):
    mm = man.get("model", {})
    cm = cfg.model
    rows = file_model["language_model.embedding.word_embeddings.weight"].shape[0]
    mult = cm.get("make_vocab_size_divisible_by", 128) * cfg.distributed_strategy.get("tensor_model_parallel_size", 1)
    padded = -(-mm.get("vocab_size", 0) // mult) * mult
    checks = {
        "num_layers": cm.num_layers, "hidden_size": cm.hidden_size, "ffn_hidden_size": cm.ffn_hidden_size,
        "num_attention_heads": cm.num_attention_heads, "num_kv_heads": cm.get("num_kv_heads", None),
        "normalization": cm.get("normalization"), "activation": cm.get("activation"),
        "has_bias": cm.get("has_bias"), "position_embedding_type": cm.get("position_embedding_type"),
        "max_position_embeddings": cm.max_position_embeddings,
        "share_embeddings_and_output_weights": cm.get("share_embeddings_and_output_weights"),
        "make_vocab_size_divisible_by": cm.get("make_vocab_size_divisible_by"),
    }
    diffs = {k: (v, mm.get(k)) for k, v in checks.items() if mm.get(k) != v}
    out.append(f"  manifest model vs config: {'all equal' if not diffs else f'DIFFER {diffs}'} "
               f"({', '.join(f'{k}={v}' for k, v in checks.items())})")
    out.append(f"  padded_vocab_size = word_embeddings rows = {rows}; manifest vocab_size {mm.get('vocab_size')} "
               f"padded to a multiple of {mult} = {padded}: {'equal' if padded == rows else 'DIFFER'}")
    out.append(f"  manifest grid {man.get('grid')}; config zero1 = {cfg.distributed_strategy.get('zero1')}")
    return not diffs and padded == rows


def run_tag(ns, name, conf, tag_path, overrides, out):
    import json
    from omegaconf import OmegaConf
    cfg = load_cfg(os.path.join(REPO, conf) if not os.path.isabs(conf) else conf, overrides)
    tag = os.path.basename(tag_path)
    out.append(f"## {name}: tag {tag}")
    out.append(f"  config {conf} (overrides: {' '.join(overrides) or 'none'}; harness adds model.use_cpu_initialization=True "
               f"when unset: CPU instead of XLA-device initial values)")
    files = ["model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt",
             "user_content.pt", "scheduler.pt", "manifest.json"]
    for f in files:
        p = os.path.join(tag_path, f)
        out.append(f"  sha256 {sha256_file(p)}  {f}" if os.path.exists(p) else f"  (absent) {f}")
    with open(os.path.join(tag_path, "manifest.json")) as f:
        man = json.load(f)
    file_model = torch.load(os.path.join(tag_path, files[0]), map_location="cpu")
    file_opt = torch.load(os.path.join(tag_path, files[1]), map_location="cpu")
    os.environ["XLA_DOWNCAST_BF16"] = "1" if cfg.precision.get("type") in ("mixed_precision", "mixed_precision_SR") \
        else "0"  # as NxDT examples/training_orchestrator.py sets it (read by the model's forward only)
    b = build(ns, cfg, file_model["language_model.embedding.word_embeddings.weight"].shape[0])
    ok = manifest_vs_model(out, cfg, man, b, file_model)
    pos = positions(b)
    mdt = sorted({dt(p.dtype) for p in b.model.parameters()})
    fdt = sorted({dt(v.dtype) for v in file_model.values()})
    out.append(f"  built: {type(b.model).__name__} in NxDModel(pp=1); state_dict {len(b.wrapped.state_dict())} keys, "
               f"{len(list(b.model.parameters()))} unique parameters, dtype {mdt} (file: {fdt}); "
               f"NeMo groups sizes {[len(g['params']) for g in b.groups]} "
               f"(do_layer_norm_weight_decay={cfg.model.get('do_layer_norm_weight_decay', False)})")
    out.append(f"  nxd_config: optimizer_config {b.nxd_config['optimizer_config']}, mixed_precision_config "
               f"{b.nxd_config['mixed_precision_config']}; optimizer {type(b.zopt).__mro__[1].__name__ if hasattr(b.zopt, 'base_optimizer') else type(b.zopt).__name__}"
               + (f" (save_master_weights={b.zopt.save_master_weights}, use_grad_acc_hook={b.zopt.use_grad_acc_hook}, "
                  f"higher_cc_precision={b.zopt.higher_cc_precision}, optimizer_dtype={dt(b.zopt.optimizer_dtype)})"
                  if hasattr(b.zopt, "base_optimizer") else "")
               + f"; construction warnings {b.warns}")
    dups = {}
    for p, param, names in pos:
        dups.setdefault(id(param), []).append((p, names[0]))
    for v in dups.values():
        if len(v) > 1:
            out.append(f"  same Parameter at optimizer positions {[p for p, _ in v]}: "
                       f"{gen.aliases(b.model)[id(pos[v[0][0]][1])]}")
    missing = sorted(set(b.wrapped.state_dict()) - set(file_model))
    unexpected = sorted(set(file_model) - set(b.wrapped.state_dict()))
    out.append(f"  key sets: file {len(file_model)} keys, model {len(b.wrapped.state_dict())}; "
               f"missing {missing}; unexpected {unexpected}")
    shape_bad = [k for k, v in file_model.items() if k in b.wrapped.state_dict()
                 and list(v.shape) != list(b.wrapped.state_dict()[k].shape)]
    out.append(f"  shapes: {'all equal' if not shape_bad else f'DIFFER {shape_bad}'}")
    file_facts(out, name, file_model, file_opt)
    smw = file_opt.get("sharded_master_weights")
    if smw is not None:
        ids = [i for g in file_opt["param_groups"] for i in g["params"]]
        nb = 0
        for (p, param, names), i in zip(pos, ids):
            k = names[0]
            if k in file_model and not same_bytes(smw[i].to(file_model[k].dtype), file_model[k]):
                nb += 1
        out.append(f"  file model tensor == bf16 round of its master weight (round-to-nearest-even cast): "
                   f"{'all ' + str(len(ids)) + ' positions' if nb == 0 else f'{nb} differ'}")
        for v in dups.values():
            if len(v) > 1:
                a, c = ids[v[0][0]], ids[v[1][0]]
                out.append(f"  tied weight: file sharded_master_weights[{a}] == [{c}]: {same_bytes(smw[a], smw[c])}; "
                           f"base_state[{a}] == base_state[{c}]: "
                           f"{all(same_bytes(file_opt['base_state'][a][k], file_opt['base_state'][c][k]) for k in ('exp_avg', 'exp_avg_sq', 'step'))}")
    for route in ("nxdt", "nxd"):
        ok &= run_route(ns, route, cfg, tag_path, file_model, file_opt, out)
    out.append(f"  {name}: {'PASS' if ok else 'FAIL'}")
    return ok


def check_blobs():
    roots = {"nxd": me.nxd_src(), "nxdt": me.nxdt_src(), "nemo": me.nemo_src(), "xla": me.xla_src()}
    ran = {r: {} for r in roots}
    for root, rel, path in me.upstream_files_loaded():
        ran[root][rel] = ue.git_blob_sha1(path)
    for root, rel in [("nxdt", "neuronx_distributed_training/lightning_modules/model/megatron/megatron_gpt_model.py"),
                      ("nxd", "neuronx_distributed/trainer/trainer.py"),
                      ("nxd", "neuronx_distributed/utils/__init__.py")] + \
            [(r, f) for r, fs in EXTRA_BLOBS.items() for f in fs]:
        ran[root][rel] = ue.git_blob_sha1(os.path.join(roots[root], rel))
    bad = []
    for root, files in ran.items():
        for rel, blob in files.items():
            exp = gen.EXPECTED_BLOBS[root].get(rel) or EXTRA_BLOBS.get(root, {}).get(rel)
            if exp != blob:
                bad.append(f"{root}:{rel} blob {blob} expected {exp}")
    if bad:
        raise SystemExit("upstream trees are not at the pinned commits:\n  " + "\n  ".join(bad))
    return ran


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", nargs="+", action="append", default=[], metavar="NAME CONF TAG [k=v ...]",
                    help="a load that must pass (sets the exit status)")
    ap.add_argument("--probe", nargs="+", action="append", default=[], metavar="NAME CONF TAG [k=v ...]",
                    help="same, reported only (does not set the exit status)")
    args = ap.parse_args()
    ns = setup_env()
    body = []
    ok = True
    summary = []
    for kind, t in [("tag", t) for t in args.tag] + [("probe", t) for t in args.probe]:
        if len(t) < 3:
            raise SystemExit(f"--{kind} needs NAME CONF TAG_PATH [key=value ...]")
        name, conf, tag_path, *over = t
        if kind == "probe":
            body.append(f"# probe {name}: reported only; its outcome does not set the exit status")
        try:
            r = run_tag(ns, name, conf, os.path.abspath(tag_path.rstrip("/")), over, body)
        except Exception as e:  # noqa: BLE001
            body.append(f"  {name}: FAIL (harness error) {type(e).__name__}: {e}")
            body.extend("    " + l for l in traceback.format_exc().rstrip().splitlines()[-8:])
            r = False
        if kind == "tag":
            ok &= r
        summary.append(f"#   {kind} {name}: {'PASS' if r else 'FAIL'} ({' '.join(over) or 'no overrides'})")
        body.append("")
    body.append("# summary:")
    body.extend(summary)
    ran = check_blobs()
    head = ["# loads_shardkit: NxDT/NxD resume code run on shardkit checkpoint tags (CPU, unmodified upstream)",
            f"# torch {torch.__version__}",
            f"# NxDT aws-neuron/neuronx-distributed-training {me.NXDT_COMMIT}",
            f"# NxD  aws-neuron/neuronx-distributed {me.NXD_COMMIT}",
            f"# NeMo NVIDIA/NeMo {me.NEMO_TAG} {me.NEMO_COMMIT}",
            f"# torch_xla pytorch/xla {me.XLA_TAG} {me.XLA_COMMIT}",
            "# upstream files that ran (git blob ids, checked):"]
    for root in ("nxdt", "nxd", "nemo", "xla"):
        for rel, blob in sorted(ran[root].items()):
            head.append(f"#   {root} {blob} {rel}")
    head.append("# functions compiled verbatim out of larger files (line numbers kept):")
    for f, fs in sorted(ns.functions_run.items()):
        head.append(f"#   {f}: {'; '.join(fs)}")
    head.append("# stand-ins added here (beyond megatron_env.py's, see README.md):")
    head.extend(f"#   - {s}" for s in STUBS)
    head.append("")
    print("\n".join(head + body + [f"# result: {'OK' if ok else 'FAILED'}"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

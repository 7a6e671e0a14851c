#!/usr/bin/python3
"""Ground-truth NxD / NxDT checkpoint tags, written by the real upstream code.

Upstream (read-only, imported from the paths below, never copied here):
  NxD   aws-neuron/neuronx-distributed            fbac349b61a3adbb123c2983835af692840ff62f  ("Release 2.29")
  NxDT  aws-neuron/neuronx-distributed-training   9169aa03f39efd4eb02da63891a7ed98defb1714  ("2.26.0")
  torch_xla pytorch/xla v2.9.0                     5fab7053df86c8d503b98d9e7202ca8b8d4978c7
        (only torch_xla/utils/{utils,serialization}.py,
         torch_xla/distributed/zero_redundancy_optimizer.py and the
         ToXlaTensorArena class of torch_xla/core/xla_model.py are used;
         these are byte-identical in v2.8.1)
  lightning_utilities Lightning-AI/utilities v0.11.9 5a31a072dc11f2c0b45af67da7d4362818d994df
  NeMo  NVIDIA/NeMo v2.1.0 633cb602777bffefbe12066b0c915c87e7b469e9
        (only nemo/core/optim/lr_scheduler.py: the CosineAnnealing NxDT uses)

Exact command (Debian 12, /usr/bin/python3 3.11, python3-torch 1.13.1+dfsg-4,
python3-omegaconf 2.2.2, python3-boto3, python3-tenacity, python3-packaging):

  U=/tmp/upstream
  git --git-dir=<nxd.git>  archive fbac349b61a3adbb123c2983835af692840ff62f | tar -x -C $U/nxd
  git --git-dir=<nxdt.git> archive 9169aa03f39efd4eb02da63891a7ed98defb1714 | tar -x -C $U/nxdt
  git --git-dir=<xla.git>  archive v2.9.0 torch_xla/utils/serialization.py torch_xla/utils/utils.py \
      torch_xla/distributed/zero_redundancy_optimizer.py torch_xla/core/xla_model.py | tar -x -C $U/xla
  git --git-dir=<lightning-utilities.git> archive v0.11.9 src | tar -x -C $U/lutil
  mkdir -p $U/nemo/nemo/core/optim && git --git-dir=<nemo.git> show v2.1.0:nemo/core/optim/lr_scheduler.py \
      > $U/nemo/nemo/core/optim/lr_scheduler.py
  NXD_SRC=$U/nxd/src NXDT_SRC=$U/nxdt/src TORCH_XLA_SRC=$U/xla \
  LIGHTNING_UTILITIES_SRC=$U/lutil/src NEMO_SRC=$U/nemo \
      nice -n 19 /usr/bin/python3 generate.py            # writes the 4 tags next to this file

Stubs: see nxd_stubs.py (every stub is listed there in STUB_NOTES, printed by
`generate.py --list-stubs`, and copied into README.md).  In short: torch_xla's
runtime parts, torch_neuronx/neuronxcc import-time names, NxD's parallel_state
rank/size/group getters (computed from the REAL NxD rank mesh), torch.distributed
rank/world/is_initialized, NxDPPModel (placeholder; the PP-local state dict is
handed over as the plain dict NxDPPModel.local_state_dict() would return),
quantization enum, and Lightning/NeMo/apex import-time placeholders.  No
upstream line is changed.

Ranks: tp=2 pp=2 dp=2 (world 8).  Training (4 ZeRO-1 steps) runs one thread per
rank so that reduce-scatter/all-gather move real data between the dp replicas;
saving calls the upstream save for rank 0, 1, ..., 7 in turn in one thread.

Deterministic: every tensor value derives from fixed seeds (crc32 of the
parameter name, step, dp rank); rerunning gives byte-identical files (checked:
see README "Reproducibility").
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import zlib
from collections import OrderedDict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

import nxd_stubs  # noqa: E402
from nxd_stubs import SIM  # noqa: E402

TP, PP, DP = 2, 2, 2
STEPS = 4

# tiny Megatron-style Llama (NxDT models/megatron, position_embedding_type=rope,
# normalization=rmsnorm, activation=swiglu, has_bias=False,
# share_embeddings_and_output_weights=False)
NUM_LAYERS = 4
HIDDEN = 16
HEADS = 4
KV_HEADS = 4  # == HEADS -> ParallelAttention builds one `query_key_value` (GQA would give query + key_value)
FFN = 32
VOCAB = 64
HEAD_DIM = HIDDEN // HEADS
ROPE_BASE = 10000

# NxD's auto partition puts the transformer layers evenly on the stages; the
# embedding goes with the first stage, final norm and output layer with the last.
LAYERS_OF_STAGE = {0: [0, 1], 1: [2, 3]}


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------


def full_param_specs():
    """name -> (global shape, tp partition dim or None, kind).  Order is the
    module registration order of NxDT's GPTModel (state_dict order)."""
    specs = OrderedDict()
    specs["language_model.embedding.word_embeddings.weight"] = ((VOCAB, HIDDEN), 0, "w")  # ParallelEmbedding (vocab split)
    for i in range(NUM_LAYERS):
        p = f"language_model.encoder.layers.{i}."
        specs[p + "input_layernorm.weight"] = ((HIDDEN,), None, "norm")  # NxD RMSNorm
        specs[p + "self_attention.query_key_value.weight"] = ((3 * HEADS * HEAD_DIM, HIDDEN), 0, "w")  # ColumnParallelLinear
        specs[p + "self_attention.core_attention.rotary_emb.inv_freq"] = ((HEAD_DIM // 2,), None, "inv_freq")  # buffer
        specs[p + "self_attention.dense.weight"] = ((HIDDEN, HEADS * HEAD_DIM), 1, "w")  # RowParallelLinear
        specs[p + "post_attention_layernorm.weight"] = ((HIDDEN,), None, "norm")
        specs[p + "mlp.dense_h_to_4h.weight"] = ((2 * FFN, HIDDEN), 0, "w")  # ColumnParallelLinear, swiglu -> 2*ffn
        specs[p + "mlp.dense_4h_to_h.weight"] = ((HIDDEN, FFN), 1, "w")  # RowParallelLinear
    specs["language_model.encoder.final_layernorm.weight"] = ((HIDDEN,), None, "norm")
    specs["language_model.output_layer.weight"] = ((VOCAB, HIDDEN), 0, "w")  # ColumnParallelLinear
    return specs


def _gen(*key):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(key).encode()) & 0x7FFFFFFF)
    return g


def full_init(name, shape, kind):
    if kind == "inv_freq":  # RotaryEmbedding.__init__ (models/megatron/rotary_pos_embedding.py)
        return 1.0 / (ROPE_BASE ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    t = torch.randn(shape, generator=_gen("init", name), dtype=torch.float32)
    if kind == "norm":
        return 1.0 + 0.05 * t
    return 0.02 * t


def full_grad(name, shape, step, dp_rank):
    return 0.01 * torch.randn(shape, generator=_gen("grad", name, step, dp_rank), dtype=torch.float32)


def tp_slice(t, dim, tp_rank):
    if dim is None:
        return t.clone()
    return t.chunk(TP, dim=dim)[tp_rank].clone()


def stage_of(name):
    if ".embedding." in name:
        return 0
    if ".layers." in name:
        i = int(name.split(".layers.")[1].split(".")[0])
        return 0 if i in LAYERS_OF_STAGE[0] else 1
    return PP - 1


class M(torch.nn.Module):
    pass


def build_stage_module(pp_rank, tp_rank, dtype):
    """A module tree with NxDT GPTModel's attribute names holding this rank's
    shards.  Only the modules of this pipeline stage exist (what
    NxDPPModel.local_stage_modules holds).  The RotaryEmbedding module is one
    object shared by every layer's core_attention, as in NxDT's
    ParallelTransformer (one `rope`, passed to every layer)."""
    specs = full_param_specs()
    root = M()
    lm = M()
    root.add_module("language_model", lm)
    rope = M()
    inv = full_init("inv_freq", None, "inv_freq")
    rope.register_buffer("inv_freq", inv)  # persistent buffer -> in state_dict
    rope_added = False

    def get(path):
        mod = root
        for part in path:
            if not hasattr(mod, part) or getattr(mod, part) is None:
                mod.add_module(part, M())
            mod = getattr(mod, part)
        return mod

    for name, (shape, pdim, kind) in specs.items():
        if stage_of(name) != pp_rank:
            continue
        parts = name.split(".")
        if kind == "inv_freq":
            ca = get(parts[:-2])
            ca.add_module("rotary_emb", rope)
            rope_added = True
            continue
        mod = get(parts[:-1])
        data = tp_slice(full_init(name, shape, kind), pdim, tp_rank).to(dtype)
        mod.register_parameter(parts[-1], torch.nn.Parameter(data))
    if rope_added:
        rope.to(dtype)  # module.to(dtype) casts floating buffers too
    return root


def local_state_dict(root):
    """NxDPPModel.local_state_dict(): a plain dict (no _metadata) in the
    stage module's state_dict order."""
    out = {}
    out.update(root.state_dict())
    return dict(out)


# --------------------------------------------------------------------------
# optimizer / scheduler, per route
# --------------------------------------------------------------------------


def nxd_param_groups(root):
    """examples/training/llama/training_utils.py:get_param_groups_by_weight_decay
    (NxD's own llama pretraining example): names with 'bias'/'norm' -> no decay."""
    named = list(root.named_parameters())
    no_decay = ["bias", "norm"]
    return [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def nxdt_param_groups(root):
    """NeMo v2.1.0 nemo/collections/nlp/modules/common/megatron/utils.py:
    get_params_for_weight_decay_optimization, as NxDT's MegatronGPTModel calls it.
    NxD's RMSNorm is none of (FusedLayerNorm, FastLayerNorm, MixedFusedRMSNorm),
    so every (bias-free) parameter lands in the single weight-decay group."""
    wd = {"params": [], "is_expert": False}
    wd_exp = {"params": [], "is_expert": True}
    no_wd = {"params": [], "weight_decay": 0.0, "is_expert": False}
    for module_ in root.modules():
        for name, param in module_._parameters.items():
            if param is None:
                continue
            if name.endswith("bias"):
                no_wd["params"].append(param)
            elif not getattr(param, "allreduce", True):
                wd_exp["params"].append(param)
            else:
                wd["params"].append(param)
    return tuple(g for g in (wd, wd_exp, no_wd) if len(g["params"]) > 0)


def load_nxd_example_lr():
    path = os.path.join(os.environ["NXD_SRC"], "..", "examples", "training", "llama", "lr.py")
    return nxd_stubs._load_source("nxd_example_lr", os.path.abspath(path))


ROUTES = {
    # NxD's own example route (examples/training/llama/tp_pp_llama_hf_pretrain/run_llama_nxd.py):
    # bf16 model, ZeRO-1 with fp32 master weights kept in the checkpoint.
    "nxd": dict(
        model_dtype=torch.bfloat16,
        env={"XLA_DOWNCAST_BF16": None},
        optimizer_config={"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": 1.0},
        mixed_precision_config={
            "use_master_weights": True,
            "use_fp32_grad_acc": True,
            "use_master_weights_in_ckpt": True,
        },
        adamw=dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01),
        sched=dict(max_steps=10, min_lr=3e-5, warmup_steps=2, constant_steps=0),
    ),
    # NxDT megatron_llama_7B_config.yaml: precision.type=mixed_precision
    # (training_orchestrator.py sets XLA_DOWNCAST_BF16=1 -> fp32 torch dtype on
    # the model, optimizer_dtype=torch.double in NxD's
    # initialize_optimizer_from_class), zero1=True, use_master_weights_in_ckpt=False.
    "nxdt": dict(
        model_dtype=torch.float32,
        env={"XLA_DOWNCAST_BF16": "1"},
        optimizer_config={"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": 1.0},
        mixed_precision_config={
            "use_master_weights": True,
            "use_fp32_grad_acc": True,
            "use_master_weights_in_ckpt": False,
        },
        adamw=dict(lr=3e-4, weight_decay=0.1, betas=[0.9, 0.95], capturable=False),
        sched=dict(warmup_steps=2, constant_steps=0, min_lr=3.0e-5, max_steps=10),
    ),
}


def set_env(env):
    old = {}
    for k, v in env.items():
        old[k] = os.environ.get(k)
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return old


def train_rank(route, nxd_mods, lr_mod, rank):
    """One rank: build its shards, wrap them in NxD's real ZeRO-1 optimizer
    (nxd.initialize_parallel_optimizer), run STEPS optimizer steps on
    synthetic gradients, return (stage module, NxDOptimizer, scheduler)."""
    import neuronx_distributed.trainer.trainer as nxd_trainer
    from neuronx_distributed.parallel_layers import parallel_state as ps

    cfg = ROUTES[route]
    tp_rank = ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    root = build_stage_module(pp_rank, tp_rank, cfg["model_dtype"])

    nxd_config = nxd_mods["nxd_config"][route]
    if route == "nxd":
        groups = nxd_param_groups(root)
        optimizer = nxd_trainer.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, groups, **cfg["adamw"])
        sched = lr_mod.CosineAnnealing(optimizer, last_epoch=-1, **cfg["sched"])
    else:
        groups = nxdt_param_groups(root)
        # BaseModelModule.configure_optimizers: NeMo first builds the plain
        # optimizer, then NxDT re-creates it through NxD with **its .defaults
        plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **cfg["adamw"])
        optimizer = nxd_trainer.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, groups, **plain.defaults)
        sched = lr_mod.CosineAnnealing(optimizer, **cfg["sched"])

    specs = full_param_specs()
    named = dict(root.named_parameters())
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = 0.0
        for name, p in named.items():
            shape, pdim, _ = specs[name]
            g = tp_slice(full_grad(name, shape, step, dp_rank), pdim, tp_rank)
            loss = loss + (p.float() * g).sum()
        loss.backward()
        optimizer.step()
        sched.step()
    return root, optimizer, sched


# --------------------------------------------------------------------------
# Lightning-style checkpoint dict (NxDT user content)
# --------------------------------------------------------------------------


def nxdt_model_cfg():
    """cfg.model of NxDT's examples/conf/megatron_llama_7B_config.yaml, tiny
    sizes, resolved (NeMo ModelPT.__init__ runs convert_model_config_to_dict_config
    -> OmegaConf.to_container(resolve=True)) plus the two keys ModelPT adds."""
    from omegaconf import OmegaConf

    full = OmegaConf.load(os.path.join(os.environ["NXDT_SRC"], "..", "examples", "conf", "megatron_llama_7B_config.yaml"))
    m = full.model
    m.encoder_seq_length = 32
    m.num_layers = NUM_LAYERS
    m.hidden_size = HIDDEN
    m.ffn_hidden_size = FFN
    m.num_attention_heads = HEADS
    m.num_kv_heads = KV_HEADS
    m.optim.sched.warmup_steps = ROUTES["nxdt"]["sched"]["warmup_steps"]
    cfg = OmegaConf.create(OmegaConf.to_container(m, resolve=True))
    cfg.target = "neuronx_distributed_training.lightning_modules.model.megatron.megatron_gpt_model.MegatronGPTModel"
    cfg.nemo_version = "2.1.0"
    return cfg


def _progress(n, processed=True, started=True):
    d = {"ready": n, "completed": n}
    if started:
        d["started"] = n
    if processed:
        d["processed"] = n
    return d


def lightning_loops(step):
    """Hand-built after Lightning 2.5.0's _Loop.state_dict() layout (not run)."""

    def bp(n):
        return {"total": _progress(n), "current": _progress(n), "is_last_batch": False}

    return {
        "fit_loop": {
            "state_dict": {},
            "epoch_loop.state_dict": {"_batches_that_stepped": step},
            "epoch_loop.batch_progress": bp(step),
            "epoch_loop.scheduler_progress": {
                "total": _progress(step, False, False),
                "current": _progress(step, False, False),
            },
            "epoch_loop.automatic_optimization.state_dict": {},
            "epoch_loop.automatic_optimization.optim_progress": {
                "optimizer": {
                    "step": {"total": _progress(step, False, False), "current": _progress(step, False, False)},
                    "zero_grad": {"total": _progress(step, False), "current": _progress(step, False)},
                }
            },
            "epoch_loop.manual_optimization.state_dict": {},
            "epoch_loop.manual_optimization.optim_step_progress": {
                "total": _progress(0, False, False),
                "current": _progress(0, False, False),
            },
            "epoch_loop.val_loop.state_dict": {},
            "epoch_loop.val_loop.batch_progress": bp(0),
            "epoch_progress": {"total": {"ready": 1, "started": 1, "processed": 0, "completed": 0},
                               "current": {"ready": 1, "started": 1, "processed": 0, "completed": 0}},
        },
        "validate_loop": {"state_dict": {}, "batch_progress": bp(0)},
        "test_loop": {"state_dict": {}, "batch_progress": bp(0)},
        "predict_loop": {"state_dict": {}, "batch_progress": {"total": _progress(0), "current": _progress(0)}},
    }


# what exp_manager would use as dirpath (the real one is <exp_dir>/checkpoints);
# fixed so that user_content.pt does not depend on where the generator ran
NXDT_DIRPATH = "/home/ubuntu/nemo_experiments/megatron_llama/checkpoints"


def lightning_checkpoint(model_sd, opt_sd, sched, ckpt_dir, tag, step):
    """What Lightning 2.5.0 CheckpointConnector.dump_checkpoint() would hand
    to NLPDDPStrategy.save_checkpoint -> NLPCheckpointIO.save_checkpoint.
    Key order as dump_checkpoint builds it."""
    from omegaconf import DictConfig  # noqa: F401

    ckpt_dir = NXDT_DIRPATH
    path = os.path.join(ckpt_dir, tag)
    score = torch.tensor(step)
    cb_key = ("NeMoModelCheckpoint{'monitor': 'step', 'mode': 'max', 'every_n_train_steps': %d, "
              "'every_n_epochs': None, 'train_time_interval': None}" % step)
    ckpt = {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": model_sd,
        "loops": lightning_loops(step),
        "callbacks": {
            cb_key: {
                "monitor": "step",
                "best_model_score": score,
                "best_model_path": path,
                "current_score": score,
                "dirpath": ckpt_dir,
                "best_k_models": {path: score},
                "kth_best_model_path": path,
                "kth_value": score,
                "last_model_path": "",
            }
        },
        "optimizer_states": [opt_sd],
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"cfg": nxdt_model_cfg()},  # DictConfig; NLPCheckpointIO turns it into a dict
    }
    return ckpt


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

TAGS = {
    "nxd_xser": ("nxd", True, "step_4"),
    "nxd_pt": ("nxd", False, "step_4"),
    "nxdt_xser": ("nxdt", True, "megatron_llama--step=4-consumed_samples=32.0.ckpt"),
    "nxdt_pt": ("nxdt", False, "megatron_llama--step=4-consumed_samples=32.0.ckpt"),
}


def check_compact(root_dir):
    """Every tensor in every written file must own a compact storage (what a
    device->CPU copy gives on real hardware); a CPU view would drag its whole
    base storage into the file."""
    bad = []
    for dp, _, fs in os.walk(root_dir):
        for f in fs:
            if not f.endswith(".pt"):
                continue
            obj = torch.load(os.path.join(dp, f), map_location="cpu")
            stack = [obj]
            while stack:
                o = stack.pop()
                if isinstance(o, torch.Tensor):
                    if o.storage_offset() != 0 or o.storage().size() != o.numel():
                        bad.append(os.path.join(dp, f))
                elif isinstance(o, dict):
                    stack.extend(o.values())
                elif isinstance(o, (list, tuple)):
                    stack.extend(o)
    if bad:
        raise SystemExit(f"non-compact tensors in {sorted(set(bad))}")


def record_writes():
    """Instrumentation only (pass-through): remember which simulated rank
    wrote which file, for the README's writer tables."""
    from neuronx_distributed.trainer.checkpoint_storage import FilesysCheckpointStorage

    writes = []
    orig_obj, orig_txt = FilesysCheckpointStorage.save_object, FilesysCheckpointStorage.save_text

    def save_object(self, obj, filename):
        writes.append((SIM.rank, os.path.join(self._dirname, filename)))
        return orig_obj(self, obj, filename)

    def save_text(self, text, filename):
        writes.append((SIM.rank, os.path.join(self._dirname, filename)))
        return orig_txt(self, text, filename)

    FilesysCheckpointStorage.save_object = save_object
    FilesysCheckpointStorage.save_text = save_text
    nxd_stubs._note(
        "FilesysCheckpointStorage.save_object/save_text (generate.py)",
        "pass-through wrappers that log (simulated rank, file) before calling the real method",
        "instrumentation for the writer tables in generate.out.txt",
    )
    return writes


def tid_order(obj):
    """Tensors of obj in the order the real ToXlaTensorArena collects them
    (= xser tid order)."""
    import torch_xla.core.xla_model as xm

    arena = xm._RealToXlaTensorArena(lambda ts: ts, lambda v: isinstance(v, torch.Tensor))
    arena._tensors = []
    arena._collect_tensors(obj)
    return list(arena._tensors)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def report(name, tag, ckpt_dir, trained_route, writes, out):
    """Writer of every file, and for every saved tensor the ranks whose
    in-memory state it equals."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    base = os.path.join(ckpt_dir, tag)
    P = lambda *a: print(*a, file=out)  # noqa: E731
    P(f"### {name}/{tag}")
    by_file = {}
    for r, f in writes:
        by_file.setdefault(os.path.relpath(f, base), []).append(r)
    P("writer ranks per file (rank = global rank; tp/pp/dp coordinates below):")
    for r in range(SIM.world_size):
        SIM.set_rank(r)
        P(f"  rank {r}: tp={ps.get_tensor_model_parallel_rank()} pp={ps.get_pipeline_model_parallel_rank()} "
          f"dp={ps.get_data_parallel_rank()}")
    SIM.set_rank(0)
    multi = {f: rs for f, rs in by_file.items() if len(rs) > 1}
    for f in sorted(by_file, key=lambda x: (x.count("/"), x)):
        if "/tensor_" in f:
            continue
        P(f"  {f}: written by rank(s) {by_file[f]}")
    folders = sorted({os.path.dirname(f) for f in by_file if "/tensor_" in f})
    for d in folders:
        per_rank = {}
        for f, rs in by_file.items():
            if os.path.dirname(f) == d:
                tid = int(os.path.basename(f)[len("tensor_"):-len(".pt")])
                for r in rs:
                    per_rank.setdefault(r, []).append(tid)
        P(f"  {d}/tensor_<tid>.pt written by: " + "; ".join(
            f"rank {r} -> tids {sorted(t)}" for r, t in sorted(per_rank.items())))
    if multi:
        P(f"  files written more than once: {multi}")

    # provenance of optimizer data
    coords = {}
    for r in range(SIM.world_size):
        SIM.set_rank(r)
        coords[r] = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_data_parallel_rank())
    states = {}
    for r in range(SIM.world_size):
        SIM.set_rank(r)
        states[r] = tid_order(trained_route[r][1].state_dict())
    SIM.set_rank(0)
    xser = any(f.endswith(".tensors") for f in folders)
    P("optimizer tensor provenance: for each saved optimizer tensor (by tid = position in the real "
      "ToXlaTensorArena order), the dp ranks (same tp/pp) whose in-memory optimizer state holds an equal tensor:")
    for f in sorted(by_file):
        if not f.startswith("optim/") or "/tensor_" in f or f.endswith(".info.pt"):
            continue
        b = os.path.basename(f)
        tp_r, pp_r = int(b.split("tp_rank_")[1][:2]), int(b.split("pp_rank_")[1][:2])
        cands = [r for r in range(SIM.world_size) if coords[r][:2] == (tp_r, pp_r)]
        if xser:
            ref = torch.load(os.path.join(base, f))
            n = len(tid_order_refs(ref))
            saved = [torch.load(os.path.join(base, f + ".tensors", f"tensor_{i}.pt")) for i in range(n)]
        else:
            saved = tid_order(torch.load(os.path.join(base, f)))
        groups = {}
        for i, t in enumerate(saved):
            src = tuple(coords[r][2] for r in cands if _same(states[r][i], t))
            groups.setdefault(src, []).append(i)
        P(f"  {f} ({len(saved)} tensors): " + "; ".join(
            f"dp {list(k) if k else 'NONE'}: tids {v}" for k, v in sorted(groups.items())))
    P("")


def tid_order_refs(ref):
    import torch_xla.core.xla_model as xm
    import torch_xla.utils.serialization as xser

    arena = xm._RealToXlaTensorArena(lambda ts: ts, lambda v: isinstance(v, xser.TensorReference))
    arena._tensors = []
    arena._collect_tensors(ref)
    return list(arena._tensors)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--only", nargs="*", choices=sorted(TAGS), default=sorted(TAGS))
    ap.add_argument("--list-stubs", action="store_true")
    args = ap.parse_args()

    mods = nxd_stubs.install(TP, PP, DP, with_nxdt=True)

    import neuronx_distributed as nxd
    import neuronx_distributed.trainer.trainer as nxd_trainer
    from neuronx_distributed.parallel_layers import parallel_state as ps

    nlp_overrides = mods["nlp_overrides"]
    nemo_lr = nxd_stubs.load_nemo_lr_scheduler(os.environ["NEMO_SRC"])
    nxd_lr = load_nxd_example_lr()

    # neuronx_distributed_config() calls initialize_model_parallel(); the mesh
    # is already set up from the real function (mesh_only=True) in nxd_stubs
    ps.initialize_model_parallel = lambda *a, **k: None
    nxd_stubs._note(
        "parallel_state.initialize_model_parallel (generate.py, after the mesh is known)",
        "no-op",
        "neuronx_distributed_config() calls it to build process groups; the mesh was already taken "
        "from the real function with mesh_only=True",
    )
    nxd_config = {}
    for route, cfg in ROUTES.items():
        nxd_config[route] = nxd_trainer.neuronx_distributed_config(
            tensor_parallel_size=TP,
            pipeline_parallel_size=PP,
            optimizer_config=dict(cfg["optimizer_config"]),
            mixed_precision_config=dict(cfg["mixed_precision_config"]),
            sequence_parallel=False,
        )
    nxd_mods = {"nxd_config": nxd_config}
    writes = record_writes()
    if args.list_stubs:
        for n, what, why, aff in nxd_stubs.STUB_NOTES:
            print(f"- {n}\n    does: {what}\n    why: {why}\n    changes bytes on disk: {aff}")
        return

    trained = {}
    for route in sorted({TAGS[t][0] for t in args.only}):
        old = set_env(ROUTES[route]["env"])
        lr_mod = nxd_lr if route == "nxd" else nemo_lr
        trained[route] = SIM.run_threaded(lambda r, route=route, lr_mod=lr_mod: train_rank(route, nxd_mods, lr_mod, r))
        set_env(old)

    for name in args.only:
        route, xser, tag = TAGS[name]
        ckpt_dir = os.path.join(args.out, name)
        if os.path.exists(ckpt_dir):
            shutil.rmtree(ckpt_dir)
        nxd.trainer.checkpoint.g_iostate = None  # a fresh CheckpointIOState per run, as in a new job

        def save(rank):
            root, optimizer, sched = trained[route][rank]
            model_sd = local_state_dict(root)
            if route == "nxd":
                nxd.save_checkpoint(
                    ckpt_dir,
                    tag=tag,
                    model=model_sd,
                    optimizer=optimizer.state_dict(),
                    scheduler=sched,
                    user_content={
                        "total_steps": STEPS,
                        "batch_idx": STEPS - 1,
                        "epoch": 0,
                        "cli_args": {
                            "tensor_parallel_size": TP,
                            "pipeline_parallel_size": PP,
                            "use_zero1_optimizer": 1,
                            "use_master_weight_in_ckpt": True,
                            "save_load_xser": int(xser),
                            "lr": ROUTES["nxd"]["adamw"]["lr"],
                            "max_steps": ROUTES["nxd"]["sched"]["max_steps"],
                        },
                    },
                    use_xser=xser,
                    num_kept_ckpts=None,
                    async_save=False,
                    zero1_optimizer=True,
                )
            else:
                ckpt = lightning_checkpoint(model_sd, optimizer.state_dict(), sched, ckpt_dir, tag, STEPS)
                io = nlp_overrides.NLPCheckpointIO(async_save=False, weight_init_only=False, ptl_version="2.5.0")
                io.save_checkpoint(ckpt, os.path.join(ckpt_dir, tag), save_type_xser=xser)

        del writes[:]
        SIM.run_sequential(save)
        check_compact(ckpt_dir)
        report(name, tag, ckpt_dir, trained[route], list(writes), sys.stdout)

    # a manifest of what was written (sha256 per file) for the README / CI
    manifest = {}
    for name in sorted(TAGS):
        base = os.path.join(args.out, name)
        if not os.path.isdir(base):
            continue
        for dp, _, fs in sorted(os.walk(base)):
            for f in sorted(fs):
                p = os.path.join(dp, f)
                with open(p, "rb") as fh:
                    b = fh.read()
                manifest[os.path.relpath(p, args.out)] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    with open(os.path.join(args.out, "manifest.json"), "w") as fh:
        json.dump(dict(sorted(manifest.items())), fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()

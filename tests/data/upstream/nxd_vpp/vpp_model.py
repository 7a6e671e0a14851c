"""The tiny HF-style Llama of this fixture, wrapped in NxD's REAL pipeline
wrapper (neuronx_distributed/pipeline/model.py: NxDPPModel) with
virtual_pipeline_size 2.  Shared by generate.py and load_check.py.

Why the model classes are restated here: NxD's llama example
(examples/training/llama/modeling_llama_nxd.py) subclasses HF transformers
4.48 classes, and transformers is not installed (no PyPI on this machine).
The classes below keep that file's module tree and attribute names
(LlamaForCausalLM.model.{embed_tokens,layers.N,norm,rotary_emb}, lm_head;
layer.{self_attn.{qkv_proj,o_proj},mlp.{gate_up_proj,down_proj},
input_layernorm,post_attention_layernorm}) and build every parallel layer
with NxD's own classes (ParallelEmbedding, ColumnParallelLinear,
RowParallelLinear, GQAQKVColumnParallelLinear with fuse_qkv=True), with the
arguments modeling_llama_nxd.py passes.  HF's LlamaRotaryEmbedding (4.48)
registers inv_freq with persistent=False, so it is in no state dict; the same
here.  The layers' forward is never run: NxDPPModel traces the model
symbolically and every transformer layer is a leaf.

Pipeline config = run_llama_nxd.py's (examples/training/llama/tp_pp_llama_hf_pretrain):
transformer_layer_cls=LlamaDecoderLayer, auto_partition=True,
input_names=[input_ids, attention_mask, labels], output_loss_value_spec=(True, False),
leaf_module_cls=[LlamaRMSNorm, LlamaRotaryEmbedding], use_zero1_optimizer,
use_optimizer_wrapper; virtual_pipeline_size=VPP.  One difference:
tracer_cls="torch" (NxD's TorchTracerWrapper) instead of the default for an
HF PreTrainedModel (HFTracerWrapper, which subclasses transformers' HFTracer);
see README "Stubs and substitutions".
"""

import os
import sys
import zlib
from functools import partial

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "nxd_tags"))

import nxd_stubs  # noqa: E402  (reused, not copied)
from nxd_stubs import SIM  # noqa: E402

TP, PP, DP, VPP = 2, 2, 2, 2
NUM_LAYERS = 8
HIDDEN = 8
HEADS = 4
KV_HEADS = 2  # GQA: 2 query heads per KV head
HEAD_DIM = HIDDEN // HEADS
FFN = 16
VOCAB = 32
ROPE_BASE = 10000.0
NUM_MICROBATCHES = 2
parallel_cross_entropy = None  # NxD's, set by install()

# --------------------------------------------------------------------------
# stubs this fixture adds to nxd_tags/nxd_stubs.py (listed in README)
# --------------------------------------------------------------------------


def install(with_nxdt=False):
    """nxd_stubs.install, then the real neuronx_distributed.pipeline package
    in place of nxd_stubs' placeholder (checkpoint.py's isinstance check and
    model_utils.get_model_sequential then see the real NxDPPModel)."""
    mods = nxd_stubs.install(TP, PP, DP, with_nxdt=with_nxdt)
    root = os.path.join(os.environ["NXD_SRC"], "neuronx_distributed")
    nxd_stubs._pkg_shell("neuronx_distributed.pipeline", os.path.join(root, "pipeline"))
    nxd_stubs._new_module(
        "torch_xla.distributed.parallel_loader",
        MpDeviceLoader=type("MpDeviceLoader", (), {"__init__": lambda self, *a, **k: None}),
    )
    nxd_stubs._note(
        "neuronx_distributed.pipeline (nxd_vpp: replaces nxd_stubs' NxDPPModel placeholder)",
        "package object whose __init__.py is not executed; pipeline/model.py, partition.py, trace.py, "
        "scheduler.py, comm.py load unchanged from NXD_SRC",
        "the placeholder is what nxd_tags needed; this fixture runs the real wrapper",
    )
    nxd_stubs._note(
        "torch_xla.distributed.parallel_loader.MpDeviceLoader (nxd_vpp)",
        "inert placeholder class (import-time only)",
        "pipeline/model.py imports it at module level; it is used only by run_train/run_eval, not run here",
    )
    import neuronx_distributed.parallel_layers.parallel_state as ps
    import neuronx_distributed.pipeline.model as pp_model
    import neuronx_distributed.trainer.checkpoint as ckpt

    _install_group_objects(ps)
    from neuronx_distributed.trainer.post_partition_hooks import PostPartitionHooks

    sys.modules["neuronx_distributed.trainer"].hooks = PostPartitionHooks()
    nxd_stubs._note(
        "neuronx_distributed.trainer.hooks (nxd_vpp)",
        "set to PostPartitionHooks(), the one line of trainer/__init__.py that NxDPPModel.partition() needs",
        "nxd_stubs does not run trainer/__init__.py (see its note)",
    )
    ps.initialize_kv_group = lambda *a, **k: None
    nxd_stubs._note(
        "parallel_state.initialize_kv_group (nxd_vpp)",
        "no-op",
        "GQAQKVColumnParallelLinear.__init__ calls it to build the KV replication process groups "
        "(kv_size_multiplier=1 here: no replication); no process groups exist in this simulation",
    )
    # a module global, as in modeling_llama_nxd.py: fx autowraps it (NxD PARALLEL_FUNCTIONS) by global name
    global parallel_cross_entropy
    from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy

    sys.modules["neuronx_distributed.pipeline"].NxDPPModel = pp_model.NxDPPModel
    ckpt.NxDPPModel = pp_model.NxDPPModel
    nxd_stubs.rebind()
    mods["ckpt"] = ckpt
    return mods


class _SimGroup:
    """Stands for one of NxD's process groups: size()/rank() of the calling
    simulated rank within the real replica groups of `kind`."""

    def __init__(self, kind):
        self.kind = kind

    def size(self):
        return len(SIM.group_of(self.kind))

    def rank(self):
        return SIM.index_in(self.kind)

    def __repr__(self):
        return f"<simulated {self.kind} group>"


def _install_group_objects(ps):
    kinds = {
        "get_tensor_model_parallel_group": "tp_groups",
        "get_data_parallel_group": "dp_groups",
        "get_pipeline_model_parallel_group": "pp_groups",
        "get_context_model_parallel_group": "cp_groups",
    }
    for fn, kind in kinds.items():
        grp = _SimGroup(kind)
        stub = (lambda grp=grp: lambda as_list=False: SIM.group_of(grp.kind) if as_list else grp)()
        nxd_stubs._REBIND[getattr(ps, fn)] = stub
        setattr(ps, fn, stub)
    real_ws, real_rank = torch.distributed.get_world_size, torch.distributed.get_rank
    torch.distributed.get_world_size = lambda group=None: group.size() if isinstance(group, _SimGroup) else real_ws()
    torch.distributed.get_rank = lambda group=None: group.rank() if isinstance(group, _SimGroup) else real_rank()
    nxd_stubs._note(
        "parallel_state.get_{tensor_model,data,pipeline_model,context_model}_parallel_group (nxd_vpp)",
        "a group object whose size()/rank() are the calling simulated rank's, in the real replica groups "
        "(as_list=True: that rank's group as a list); torch.distributed.get_world_size/get_rank(group=it) "
        "answer from it",
        "NxD's parallel layers (ParallelEmbedding, ColumnParallelLinear, RowParallelLinear) read their tp size "
        "and rank from the tp group at construction; no process groups exist in this simulation",
    )


# --------------------------------------------------------------------------
# model (module tree and names of modeling_llama_nxd.py; see module docstring)
# --------------------------------------------------------------------------


def _init_normal(std, w):  # modeling_llama_nxd.py:_init_normal
    return nn.init.normal_(w, mean=0.0, std=std)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, dtype, eps=1e-6):
        super().__init__()
        # HF makes it fp32; here it takes the model dtype so that every parameter is bf16, as in
        # nxd_tags' "nxd" route (a bf16 model with fp32 master weights in the ZeRO-1 state)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, h):
        return h


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # HF 4.48: persistent=False

    def forward(self, x, position_ids):
        return (x, x)


class LlamaAttention(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
        from neuronx_distributed.parallel_layers.layers import RowParallelLinear

        init_method = partial(_init_normal, 0.02)
        self.qkv_proj = GQAQKVColumnParallelLinear(
            HIDDEN, [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], bias=False, gather_output=False,
            init_method=init_method, sequence_parallel_enabled=False, kv_size_multiplier=1,
            fuse_qkv=True, dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            HEADS * HEAD_DIM, HIDDEN, bias=False, input_is_parallel=True, init_method=init_method,
            sequence_parallel_enabled=False, dtype=dtype,
        )


class LlamaMLP(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear

        init_method = partial(_init_normal, 0.02)
        self.gate_up_proj = ColumnParallelLinear(
            HIDDEN, 2 * FFN, stride=2, bias=False, gather_output=False, init_method=init_method,
            sequence_parallel_enabled=False, dtype=dtype,
        )
        self.down_proj = RowParallelLinear(
            FFN, HIDDEN, bias=False, input_is_parallel=True, init_method=init_method,
            sequence_parallel_enabled=False, dtype=dtype,
        )


class LlamaDecoderLayer(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.self_attn = LlamaAttention(dtype)
        self.mlp = LlamaMLP(dtype)
        self.input_layernorm = LlamaRMSNorm(HIDDEN, dtype)
        self.post_attention_layernorm = LlamaRMSNorm(HIDDEN, dtype)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        return hidden_states


class LlamaModel(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        from neuronx_distributed.parallel_layers.layers import ParallelEmbedding

        self.embed_tokens = ParallelEmbedding(
            VOCAB, HIDDEN, None, init_method=partial(_init_normal, 0.02), sequence_parallel_enabled=False, dtype=dtype,
        )
        self.layers = nn.ModuleList([LlamaDecoderLayer(dtype) for _ in range(NUM_LAYERS)])
        self.norm = LlamaRMSNorm(HIDDEN, dtype)
        self.rotary_emb = LlamaRotaryEmbedding()

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.embed_tokens(input_ids)
        # one value, not unpacked: torch 1.13's fx cannot iterate a Proxy under Python 3.11
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask, position_embeddings)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear

        self.model = LlamaModel(dtype)
        self.lm_head = ColumnParallelLinear(
            HIDDEN, VOCAB, bias=False, gather_output=False, init_method=partial(_init_normal, 0.02),
            sequence_parallel_enabled=False, dtype=dtype,
        )

    def forward(self, input_ids, attention_mask, labels):
        position_ids = torch.cumsum(attention_mask, -1) - 1  # traceable (no Python int from a Proxy)
        h = self.model(input_ids, attention_mask, position_ids)
        logits = self.lm_head(h)
        loss = parallel_cross_entropy(logits, labels).mean()
        return loss, logits


# --------------------------------------------------------------------------
# values: fixed seeds, in the tp-concatenated ("full") layout
# --------------------------------------------------------------------------


def _gen(*key):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(key).encode()) & 0x7FFFFFFF)
    return g


def partition_dim_of(name, p):
    """NxD's own metadata on the parameter (set_tensor_model_parallel_attributes),
    except for GQAQKVColumnParallelLinear's fused weight_qkv: fbac349's
    initialize_weight_biases() replaces it by a new Parameter (cat of the
    initialised q/k/v views) that carries no tensor_model_parallel attribute.
    Each rank's weight_qkv is [q_r; k_r; v_r], so the full tensor here is the
    rank blocks stacked on dim 0."""
    if getattr(p, "tensor_model_parallel", False):
        return p.partition_dim
    return 0 if name.endswith("qkv_proj.weight_qkv") else None


def full_shape(name, p):
    d = partition_dim_of(name, p)
    shape = list(p.shape)
    if d is not None:
        shape[d] *= TP
    return shape


def full_init(name, shape):
    t = torch.randn(shape, generator=_gen("init", name), dtype=torch.float32)
    return 1.0 + 0.05 * t if name.endswith("norm.weight") else 0.02 * t


def full_grad(name, shape, step, dp_rank):
    return 0.01 * torch.randn(shape, generator=_gen("grad", name, step, dp_rank), dtype=torch.float32)


def tensor_sha256(t):
    """sha256 of a tensor's bytes, row-major (what generate.out.txt and load_check.out.txt print)."""
    import hashlib

    t = t.detach().reshape(-1).contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def tp_slice(t, dim, tp_rank):
    return t.clone() if dim is None else t.chunk(TP, dim=dim)[tp_rank].clone()


def build_model(dtype):
    """LlamaForCausalLM with this rank's tp shards; every value set from the
    fixed seeds (full tensor sliced with the parameter's own partition_dim)."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    m = LlamaForCausalLM(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            full = full_init(name, full_shape(name, p))
            p.data.copy_(tp_slice(full, partition_dim_of(name, p), tp_rank).to(p.dtype))
    return m


def pipeline_config(zero1=True):
    """run_llama_nxd.py's pipeline_config, tiny."""
    from neuronx_distributed.parallel_layers import mappings

    return {
        "transformer_layer_cls": LlamaDecoderLayer,
        "num_microbatches": NUM_MICROBATCHES,
        "output_loss_value_spec": (True, False),
        "input_names": ["input_ids", "attention_mask", "labels"],
        "virtual_pipeline_size": VPP,
        "auto_partition": True,
        "trace_file_path": None,
        "param_init_fn": None,
        "leaf_module_cls": [LlamaRMSNorm.__name__, LlamaRotaryEmbedding.__name__],
        "use_zero1_optimizer": zero1,
        "use_optimizer_wrapper": True,
        "deallocate_pipeline_outputs": False,
        "fuse_microbatches": False,
        "autowrap_modules": [mappings],
        "tracer_cls": "torch",
    }


# --------------------------------------------------------------------------
# NxD's llama example route (nxd_tags ROUTES["nxd"]): bf16 model, ZeRO-1 with
# fp32 master weights kept in the checkpoint
# --------------------------------------------------------------------------

OPTIMIZER_CONFIG = {"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": 1.0}
MIXED_PRECISION_CONFIG = {"use_master_weights": True, "use_fp32_grad_acc": True, "use_master_weights_in_ckpt": True}
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)


def nxd_config():
    """NxD's neuronx_distributed_config for this run.  Its call of
    initialize_model_parallel is a no-op here (the mesh is already the real
    one, from nxd_stubs)."""
    import neuronx_distributed.trainer.trainer as nxd_trainer
    from neuronx_distributed.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel = lambda *a, **k: None
    nxd_stubs._note("parallel_state.initialize_model_parallel (after the mesh is known)", "no-op",
                    "as in nxd_tags/generate.py")
    return nxd_trainer.neuronx_distributed_config(
        tensor_parallel_size=TP, pipeline_parallel_size=PP, pipeline_config=pipeline_config(),
        optimizer_config=dict(OPTIMIZER_CONFIG), mixed_precision_config=dict(MIXED_PRECISION_CONFIG),
        sequence_parallel=False,
    )


class AdamWTorch2Args(torch.optim.AdamW):
    """torch.optim.AdamW that accepts (and drops) `differentiable`, as
    torch >= 2.0's AdamW does.  Debian's torch 1.13 Optimizer.__setstate__
    adds defaults['differentiable'] during load_state_dict, and the ZeRO-1
    optimizer's load_state_dict -> init_zero() then re-creates the base
    optimizer with **defaults; 1.13's AdamW refuses the keyword.  Used by
    load_check.py only (the class is not saved in any checkpoint file)."""

    def __init__(self, params, differentiable=False, **kw):
        super().__init__(params, **kw)


def build_rank(config, optimizer_class=torch.optim.AdamW):
    """NxD's initialize_parallel_model (NxDPPModel inside NxDModel) and
    initialize_parallel_optimizer with the example's weight-decay groups, for
    the calling simulated rank.  Ranks are built one after another (fx
    tracing patches globals)."""
    import neuronx_distributed.trainer.trainer as nxd_trainer

    cfg = dict(config, pipeline_config=dict(config["pipeline_config"]))
    model = nxd_trainer.initialize_parallel_model(cfg, build_model, False, torch.bfloat16)
    groups = example_param_groups(model)
    optimizer = nxd_trainer.initialize_parallel_optimizer(cfg, optimizer_class, groups, **ADAMW)
    return model, optimizer


def example_param_groups(model):
    """examples/training/llama/training_utils.py:get_param_groups_by_weight_decay,
    taken from NXD_SRC and run unchanged (the file's other imports need a
    dataset stack, so only this function is compiled)."""
    import ast

    path = os.path.join(os.environ["NXD_SRC"], "..", "examples", "training", "llama", "training_utils.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_param_groups_by_weight_decay"]
    ns = {}
    exec(compile(ast.Module(body=fn, type_ignores=[]), path, "exec"), ns)
    return ns["get_param_groups_by_weight_decay"](model)

"""Import unmodified upstream NxDT Megatron / NxD / NeMo / torch_xla files on a CPU-only box.

Nothing here is upstream code.  This module fills ``sys.modules`` with small stand-ins for
what the upstream files import but this box does not have (torch_xla runtime, apex,
einops, transformers, megatron-core, most of NeMo, NxD parallel_state), and makes upstream
package ``__init__``s be skipped, so individual upstream files import from the trees named by

    SHARDKIT_NXD_SRC   .../neuronx-distributed/src            (holds neuronx_distributed/)
    SHARDKIT_NXDT_SRC  .../neuronx-distributed-training/src   (holds neuronx_distributed_training/)
    SHARDKIT_NEMO_SRC  .../NeMo                               (holds nemo/)
    SHARDKIT_XLA_SRC   .../xla                                (holds torch_xla/)

Generic helpers (_stub, _stub_pkg, _real_pkg, _Unavailable, upstream_function, git_blob_sha1)
are imported from ../hf_llama/upstream_env.py.  Every stand-in below either raises when
called, or is a no-parameter / identity restatement whose docstring says what it restates and
why it cannot change the recorded structure.  No upstream line is changed or copied.
"""

import enum
import importlib
import logging
import os
import sys
import types

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "hf_llama"))
import upstream_env as ue  # noqa: E402  (generic helpers only)

NXD_COMMIT = ue.NXD_COMMIT            # fbac349b61a3adbb123c2983835af692840ff62f
NXDT_COMMIT = ue.NXDT_COMMIT          # 9169aa03f39efd4eb02da63891a7ed98defb1714
NEMO_TAG, NEMO_COMMIT = "v2.1.0", "633cb602777bffefbe12066b0c915c87e7b469e9"
XLA_TAG, XLA_COMMIT = "v2.9.0", "5fab7053df86c8d503b98d9e7202ca8b8d4978c7"


def _src(var, marker, hint):
    p = os.environ.get(var)
    if not p or not os.path.isdir(os.path.join(p, marker)):
        raise SystemExit(f"set {var} to {hint} (the dir holding {marker}/)")
    return os.path.abspath(p)


def nxd_src():
    return _src("SHARDKIT_NXD_SRC", "neuronx_distributed", "neuronx-distributed/src")


def nxdt_src():
    return _src("SHARDKIT_NXDT_SRC", "neuronx_distributed_training", "neuronx-distributed-training/src")


def nemo_src():
    return _src("SHARDKIT_NEMO_SRC", "nemo", "a NeMo v2.1.0 tree")


def xla_src():
    return _src("SHARDKIT_XLA_SRC", "torch_xla", "a pytorch/xla v2.9.0 tree")


# --------------------------------------------------------------------------- parallel state

PS = {"tp": 1, "tp_rank": 0}  # what the parallel_state stand-in reports (pp = dp = cp = ep = 1)


class FakeGroup:
    """Stand-in for the tp ProcessGroup: NxD layers.py only calls .size() and .rank() on it
    (and torch.distributed.get_world_size(group) which, for a non-WORLD group, returns
    group.size() without needing an initialised process group)."""

    def size(self):
        return PS["tp"]

    def rank(self):
        return PS["tp_rank"]


def set_tp(size, rank=0):
    PS["tp"], PS["tp_rank"] = size, rank


def _is_size1(groups):
    return groups is None or all(len(g) == 1 for g in groups)


# --------------------------------------------------------------------------- stubs

def _torch_xla_stubs():
    """torch_xla: only what the files that run touch.  Collectives are identities over groups of
    size 1 (dp = 1 here); anything else raises."""
    ue._stub_pkg("torch_xla", sync=lambda: None)
    ue._stub_pkg("torch_xla.core")

    def xla_device(*a, **k):
        # Only reached by code paths not taken here (NxDT configs set use_cpu_initialization: True).
        raise RuntimeError("xm.xla_device() not available on this CPU box")

    def reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, pin_layout=True, groups=None, **k):
        assert _is_size1(groups) and shard_count == 1, "only dp=1 is supported here"
        return input * scale  # a sum over one rank, scaled, is the input scaled

    def all_gather(value, dim=0, pin_layout=True, groups=None, **k):
        assert _is_size1(groups), "only dp=1 is supported here"
        return value  # gathering one shard is the shard

    def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True, **k):
        assert _is_size1(groups), "only groups of size 1 are supported here"
        return inputs

    ue._stub("torch_xla.core.xla_model", xla_device=xla_device, unlazy=lambda tensors: None,
             mark_step=lambda *a, **k: None, REDUCE_SUM="sum", REDUCE_MAX="max",
             reduce_scatter=reduce_scatter, all_gather=all_gather, all_reduce=all_reduce)
    ue._stub("torch_xla.core.xla_env_vars")
    ue._stub("torch_xla.runtime", global_device_count=lambda: 1, global_ordinal=lambda: 0,
             local_ordinal=lambda: 0, world_size=lambda: 1)
    ue._stub_pkg("torch_xla.utils")
    ue._stub("torch_xla.utils.serialization")
    ue._stub("torch_xla.utils.checkpoint")
    ue._real_pkg("torch_xla.distributed", os.path.join(xla_src(), "torch_xla", "distributed"))
    ue._stub_pkg("torch_neuronx")
    ue._stub("torch_neuronx.utils")


class _ApexAttnMaskType(enum.Enum):
    # restates NVIDIA/apex apex/transformer/enums.py AttnMaskType (padding = 1, causal = 2)
    padding = 1
    causal = 2


class _ApexAttnType(enum.Enum):
    # restates apex/transformer/enums.py AttnType
    self_attn = 1
    cross_attn = 2


class _ApexModelType(enum.Enum):
    # restates apex/transformer/enums.py ModelType
    encoder_or_decoder = 1
    encoder_and_decoder = 2


class FusedScaleMaskSoftmax(nn.Module):
    """Stand-in for apex.transformer.functional.fused_softmax.FusedScaleMaskSoftmax, an
    nn.Module with no parameters and no buffers (so it adds nothing to state_dict or to the
    optimizer groups).  Forward is not available here."""

    def __init__(self, *args):
        super().__init__()
        self.args = args

    def forward(self, *a, **k):
        raise RuntimeError("FusedScaleMaskSoftmax stand-in: forward not available")


def _fresh_norm_class(name):
    # A class nothing in the model tree is an instance of: on a Neuron box NxD's LayerNorm /
    # RMSNorm are not apex classes, so NeMo's isinstance(module_, (FusedLayerNorm, FastLayerNorm,
    # MixedFusedRMSNorm)) is False for them.
    return type(name, (nn.Module,), {"__doc__": f"fresh stand-in for apex {name} (never instantiated here)"})


def _listify_model(model):
    # restates apex/transformer/pipeline_parallel/schedules/common.py listify_model:
    # a list is returned as is, anything else is wrapped in a one-element list.
    if isinstance(model, list):
        return model
    return [model]


def _apex_stubs():
    ue._stub_pkg("apex")
    ue._stub_pkg("apex.transformer")
    ue._stub("apex.transformer.enums", AttnMaskType=_ApexAttnMaskType, AttnType=_ApexAttnType,
             ModelType=_ApexModelType)
    ue._stub_pkg("apex.transformer.functional")
    ue._stub("apex.transformer.functional.fused_softmax", FusedScaleMaskSoftmax=FusedScaleMaskSoftmax)
    ue._stub_pkg("apex.normalization", MixedFusedRMSNorm=_fresh_norm_class("MixedFusedRMSNorm"))
    ue._stub("apex.normalization.fused_layer_norm", FusedLayerNorm=_fresh_norm_class("FusedLayerNorm"),
             MixedFusedLayerNorm=_fresh_norm_class("MixedFusedLayerNorm"))
    ue._stub_pkg("apex.transformer.layers")
    ue._stub("apex.transformer.layers.layer_norm", FastLayerNorm=_fresh_norm_class("FastLayerNorm"))
    ue._stub_pkg("apex.transformer.pipeline_parallel")
    ue._stub_pkg("apex.transformer.pipeline_parallel.schedules")
    ue._stub("apex.transformer.pipeline_parallel.schedules.common", listify_model=_listify_model)
    # apex._autocast_utils / apex.contrib are deliberately absent: NeMo's fused_bias_* and
    # layer_norm_1p.py then take their own ImportError fallbacks (not used by these models).


class _AdapterModuleMixin:
    """Stand-in for NeMo nemo/core/classes/mixins/adapter_mixins.py AdapterModuleMixin.  Only
    set_accepted_adapter_types() is called at construction (it records adapter class names);
    no adapter is ever added, so the mixin adds no parameter, buffer or submodule."""

    def set_accepted_adapter_types(self, adapter_types):
        self._accepted_adapter_types = {str(t) for t in adapter_types}


def _cfg(target):
    return type(target.rsplit(".", 1)[-1], (), {"_target_": target})


def _nemo_stubs():
    root = os.path.join(nemo_src(), "nemo")
    ue._real_pkg("nemo", root)
    ue._stub("nemo.utils", logging=logging.getLogger("nemo"),
             logging_mode=types.SimpleNamespace(ONCE="once", EVERY="every"))
    ue._stub_pkg("nemo.core", adapter_mixins=types.SimpleNamespace(AdapterModuleMixin=_AdapterModuleMixin))
    for sub in ("collections", "collections/nlp", "collections/nlp/modules", "collections/nlp/modules/common",
                "collections/nlp/modules/common/megatron"):
        ue._real_pkg("nemo." + sub.replace("/", "."), os.path.join(root, sub))
    ue._stub_pkg("nemo.collections.common")
    ue._stub_pkg("nemo.collections.common.parts")
    # Adapter config classes: only their _target_ string is read at construction.
    ue._stub("nemo.collections.common.parts.adapter_modules",
             LinearAdapterConfig=_cfg("nemo.collections.common.parts.adapter_modules.LinearAdapter"))
    ue._stub_pkg("nemo.collections.nlp.modules.common.megatron.adapters")
    pa = "nemo.collections.nlp.modules.common.megatron.adapters.parallel_adapters"
    ue._stub(pa, AdapterName=types.SimpleNamespace(),
             InfusedAdapterConfig=_cfg(pa + ".InfusedAdapter"),
             MLPInfusedAdapterConfig=_cfg(pa + ".MLPInfusedAdapter"),
             ParallelLinearAdapterConfig=_cfg(pa + ".ParallelLinearAdapter"))
    # megatron-core: NeMo's MegatronModule.__init__ raises unless `from megatron.core import
    # ModelParallelConfig, parallel_state, tensor_parallel` succeeds (NxDT installs megatron-core);
    # nothing from it is called when building these models.
    ue._stub_pkg("megatron")
    ue._stub_pkg("megatron.core")
    ue._stub_pkg("megatron.core.tensor_parallel")
    ue._stub("megatron.core.tensor_parallel.layers")
    ue._stub("megatron.core.parallel_state")


def _misc_stubs():
    ue._stub("einops")  # rearrange / repeat: forward-only
    ue._stub_pkg("transformers")
    ue._stub("transformers.utils")  # is_torch_xla_available: forward-only


def _torch_layernorm_bias_shim():
    """NxD parallel_layers/layer_norm.py LayerNorm passes `bias=` to torch.nn.LayerNorm, a keyword
    torch added in 2.1; this box has torch 1.13.  While layer_norm.py is imported, torch.nn.LayerNorm
    is temporarily this subclass, which restates torch>=2.1 LayerNorm.__init__'s `bias` handling
    (bias=True: weight then bias parameters, as in 1.13; bias=False: no bias parameter).  Restored
    right after the import; NxD's LayerNorm is still an instance of torch.nn.LayerNorm."""
    base = torch.nn.LayerNorm

    class LayerNormWithBiasKw(base):
        def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None,
                     dtype=None):
            super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device,
                             dtype=dtype)
            if elementwise_affine and not bias:
                self.register_parameter("bias", None)

    return base, LayerNormWithBiasKw


def _nxd(tr):
    """NxD: real files for the parallel layers and norms; parallel_state replaced."""
    root = os.path.join(nxd_src(), "neuronx_distributed")
    ue._real_pkg("neuronx_distributed", root)
    for sub in ("pipeline", "utils", "parallel_layers", "trainer", "modules", "modules/moe", "quantization",
                "optimizer", "overrides", "kernels"):
        ue._real_pkg("neuronx_distributed." + sub.replace("/", "."), os.path.join(root, sub))
    # neuronx_distributed/utils/__init__.py defines cpu_mode() etc.; it is a package __init__,
    # so it is executed (unmodified) into the package object instead of being skipped.
    pkg = sys.modules["neuronx_distributed.utils"]
    init = os.path.join(root, "utils", "__init__.py")
    with open(init) as f:
        exec(compile(f.read(), init, "exec"), pkg.__dict__)
    tr["neuronx_distributed/utils/__init__.py"] = init

    group = FakeGroup()
    ue._stub("neuronx_distributed.parallel_layers.parallel_state",
             model_parallel_is_initialized=lambda: True,
             get_tensor_model_parallel_group=lambda *a, **k: group,
             get_tensor_model_parallel_size=lambda: PS["tp"],
             get_tensor_model_parallel_rank=lambda: PS["tp_rank"],
             get_aot_mode=lambda: False,
             get_pipeline_model_parallel_size=lambda: 1,
             get_pipeline_model_parallel_rank=lambda: 0,
             get_context_model_parallel_size=lambda: 1,
             get_expert_model_parallel_size=lambda: 1,
             get_data_parallel_size=lambda: 1,
             get_data_parallel_rank=lambda: 0,
             get_data_parallel_replica_groups=lambda: [[0]],
             get_tensor_model_parallel_replica_groups=lambda: [[0]],
             rmsg=lambda m: m)
    ue._stub("neuronx_distributed.parallel_layers.mappings")  # collectives: forward-only
    ue._stub("neuronx_distributed.parallel_layers.loss_functions")

    def comm_all_reduce(reduce_type, inputs, groups=None, **k):
        assert _is_size1(groups), "only groups of size 1 are supported here"
        return inputs

    ue._stub("neuronx_distributed.parallel_layers.comm", all_reduce=comm_all_reduce)
    # quantization_config.py needs torch.uint16 (torch >= 2.3) at import; layers.py only uses
    # QuantizedDtype in isinstance() checks, which are False for the float32 dtypes used here.
    ue._stub("neuronx_distributed.quantization.quantization_config",
             QuantizedDtype=type("QuantizedDtype", (), {"__doc__": "fresh stand-in, never instantiated"}))
    for m in ("model", "routing", "expert_mlps", "loss_function"):
        ue._stub(f"neuronx_distributed.modules.moe.{m}")  # MoE: num_moe_experts = 1, never built

    base, shim = _torch_layernorm_bias_shim()
    torch.nn.LayerNorm = shim
    try:
        importlib.import_module("neuronx_distributed.parallel_layers.layer_norm")
    finally:
        torch.nn.LayerNorm = base
    for m in ("parallel_layers.layers", "modules.rms_norm", "trainer.model"):
        importlib.import_module("neuronx_distributed." + m)


_LOADED = {}


def load():
    """Import everything; returns a namespace of the upstream modules/functions used."""
    if _LOADED:
        return _LOADED["ns"]
    tr = {}
    # transformer.py (torch < 2.1 branch) reads torch.utils.checkpoint.checkpoint without importing
    # the submodule; on a full install something else has imported it already.
    import torch.utils.checkpoint  # noqa: F401
    _torch_xla_stubs()
    _apex_stubs()
    _misc_stubs()
    _nemo_stubs()
    _nxd(tr)
    nx = os.path.join(nxdt_src(), "neuronx_distributed_training")
    ue._real_pkg("neuronx_distributed_training", nx)
    for sub in ("models", "models/megatron", "lightning_modules", "lightning_modules/model",
                "lightning_modules/model/megatron", "utils"):
        ue._real_pkg("neuronx_distributed_training." + sub.replace("/", "."), os.path.join(nx, sub))
    gpt = importlib.import_module("neuronx_distributed_training.models.megatron.gpt_model")
    nemo_utils = importlib.import_module("nemo.collections.nlp.modules.common.megatron.utils")
    zero = importlib.import_module("neuronx_distributed.optimizer.zero_redundancy_optimizer")
    nxd_optim = importlib.import_module("neuronx_distributed.trainer.optimizer")
    nxd_model = importlib.import_module("neuronx_distributed.trainer.model")

    # Functions compiled verbatim out of files too heavy to import whole (line numbers kept).
    mgm = "neuronx_distributed_training/lightning_modules/model/megatron/megatron_gpt_model.py"
    provider, p0, p1 = ue.upstream_function(mgm, "ModelModule.model_provider_func", root="nxdt",
                                            GPTModel=gpt.GPTModel)
    setup, s0, s1 = ue.upstream_function(
        mgm, "MegatronGPTModel.setup_optimizer_param_groups", root="nxdt",
        get_all_params_for_weight_decay_optimization=nemo_utils.get_all_params_for_weight_decay_optimization,
        get_params_for_weight_decay_optimization=nemo_utils.get_params_for_weight_decay_optimization)
    from packaging import version
    init_opt, o0, o1 = ue.upstream_function(
        "neuronx_distributed/trainer/trainer.py", "initialize_optimizer_from_class", root="nxd",
        parallel_state=sys.modules["neuronx_distributed.parallel_layers.parallel_state"],
        NeuronZero1Optimizer=zero.NeuronZero1Optimizer, NeuronEPZero1Optimizer=zero.NeuronEPZero1Optimizer,
        version=version, os=os, logger=logging.getLogger("nxd"),
        get_delay_tracing=sys.modules["neuronx_distributed.utils.model_utils"].get_delay_tracing)
    funcs = {
        mgm: [f"ModelModule.model_provider_func L{p0}-L{p1}",
              f"MegatronGPTModel.setup_optimizer_param_groups L{s0}-L{s1}"],
        "neuronx_distributed/trainer/trainer.py": [f"initialize_optimizer_from_class L{o0}-L{o1}"],
    }
    ns = types.SimpleNamespace(gpt=gpt, nemo_utils=nemo_utils, zero=zero, nxd_optim=nxd_optim,
                               nxd_model=nxd_model, provider=provider, setup=setup,
                               initialize_optimizer_from_class=init_opt, functions_run=funcs,
                               extra_files=tr)
    _LOADED["ns"] = ns
    return ns


def upstream_files_loaded():
    """(root name, path relative to that root, absolute path) of every upstream file imported."""
    roots = [("nxd", nxd_src()), ("nxdt", nxdt_src()), ("nemo", nemo_src()), ("xla", xla_src())]
    out = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if not f or not os.path.isfile(f):
            continue
        f = os.path.abspath(f)
        for name, r in roots:
            if f.startswith(r + os.sep):
                out.add((name, os.path.relpath(f, r), f))
    return sorted(out)

"""Stand-ins that NxDT's Mixtral models and NxD's MoE modules need on a CPU box,
on top of ../nxd_tags/nxd_stubs.py (imported, not copied).

Every stand-in is noted in nxd_stubs.STUB_NOTES through nxd_stubs._note, so
`generate.py --list-stubs` prints them all.  No upstream line is changed here;
the two LOCAL CHANGES that expert parallelism needs are applied by generate.py
(see LOCAL_CHANGES there), not here.
"""

import importlib.util
import os
import sys
import types

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "nxd_tags"))

import nxd_stubs  # noqa: E402
from nxd_stubs import SIM, _new_module, _note  # noqa: E402,F401


class _PlaceholderMeta(type):
    """A class whose unknown class attributes are again placeholders
    (BlockShardStrategy.HI_LO, nl.float32, ...)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        ph = _PlaceholderMeta(name, (object,), {"__init__": lambda self, *a, **k: None})
        setattr(cls, name, ph)
        return ph

    def __call__(cls, *a, **k):
        return super().__call__()


class _AutoPkg(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        ph = _PlaceholderMeta(name, (object,), {"__init__": lambda self, *a, **k: None,
                                                "__module__": self.__name__})
        setattr(self, name, ph)
        return ph


class _AutoFinder:
    """Serves _AutoPkg modules for the Neuron-only packages that NxD's MoE code
    imports at module level (NKI kernels, compiler enums); none is called on
    the paths run here."""

    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.roots or fullname.startswith(tuple(r + "." for r in self.roots)):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _AutoPkg(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def install_neuron_kernel_placeholders():
    roots = ["nkilib", "nki", "neuronxcc.nki.compiler", "neuronxcc.nki.language", "neuronxcc.nki.isa",
             "torch_neuronx.xla_impl", "torch_neuronx.pyhlo"]
    sys.meta_path.insert(0, _AutoFinder(roots))
    for name in ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki._pre_prod_kernels", "torch_neuronx"):
        sys.modules[name].__class__ = _AutoPkg  # nxd_stubs' empty modules: unknown names -> placeholders
    _note(", ".join(roots),
          "import-time placeholders: any attribute is an inert class whose attributes are again placeholders",
          "NxD's MoE files (expert_mlps.py, blockwise.py, moe_fused_tkg*.py) import NKI kernels and compiler "
          "enums at module level; the kernels are never called here (no blockwise NKI path on CPU)")


class _Group:
    """What NxD's modules ask of a ProcessGroup at construction time: size()
    and rank(), answered from the real replica groups of the simulated mesh."""

    def __init__(self, kind):
        self.kind = kind

    def size(self):
        return len(SIM.group_of(self.kind)) if self.kind else SIM.world_size

    def rank(self):
        return SIM.index_in(self.kind) if self.kind else SIM.rank


def _group_getter(kind):
    def get(as_list=False):
        if as_list:
            return [list(g) for g in getattr(SIM.groups, kind)] if kind else [list(range(SIM.world_size))]
        return _Group(kind)
    return get


def _quantization_placeholders(root):
    import enum

    class QuantizedDtype(enum.Enum):
        INT8 = torch.int8

    nxd_stubs._pkg_shell("neuronx_distributed.quantization", os.path.join(root, "quantization"))
    m = _AutoPkg("neuronx_distributed.quantization.quantization_config")
    m.__path__ = []
    m.QuantizedDtype = QuantizedDtype
    m.is_ocp_mx_quantized = lambda *a, **k: False
    sys.modules[m.__name__] = m
    d = _AutoPkg("neuronx_distributed.quantization.dequantize")
    sys.modules[d.__name__] = d
    _note("neuronx_distributed.quantization.quantization_config, .dequantize (mixtral_stubs)",
          "QuantizedDtype enum with INT8 only, is_ocp_mx_quantized() -> False, other names placeholders",
          "the real module needs torch dtypes torch 1.13 lacks; no quantized layer is built here")
    return m


def install(tp, ep, dp):
    """nxd_stubs.install for pp 1 with an expert-parallel degree: the mesh is
    the REAL initialize_model_parallel(..., expert_model_parallel_size=ep,
    mesh_only=True); ProcessGroup getters answer size()/rank() from it."""
    os.environ.setdefault("PJRT_DEVICE", "NEURON")
    os.environ.setdefault("NXD_LOG_LEVEL", "error")
    nxd_src = nxd_stubs._env_path("NXD_SRC")
    nxd_stubs._install_torch_xla(nxd_stubs._env_path("TORCH_XLA_SRC"))
    nxd_stubs._install_neuron_sdk_stubs()
    install_neuron_kernel_placeholders()
    root = os.path.join(nxd_src, "neuronx_distributed")
    nxd_stubs._pkg_shell("neuronx_distributed", root)
    quant = _quantization_placeholders(root)
    import neuronx_distributed.parallel_layers.parallel_state as ps

    real_init = ps.initialize_model_parallel
    ps.initialize_model_parallel = lambda **k: real_init(expert_model_parallel_size=ep, **k)
    nxd_stubs._install_nxd(nxd_src, tp, 1, dp)
    ps.initialize_model_parallel = real_init
    sys.modules["neuronx_distributed.quantization.quantization_config"] = quant
    _note("initialize_model_parallel (mesh, mixtral_stubs.install)",
          f"the real function called with expert_model_parallel_size={ep}, mesh_only=True",
          "nxd_stubs._install_nxd passes tp and pp only")
    getters = dict(
        get_world_group=None,
        get_tensor_model_parallel_group="tp_groups",
        get_expert_model_parallel_group="ep_model_groups",
        get_expert_data_parallel_group="ep_data_groups",
        get_data_parallel_group="dp_groups",
        get_pipeline_model_parallel_group="pp_groups",
        get_context_model_parallel_group="cp_groups",
    )
    for name, kind in getters.items():
        assert hasattr(ps, name), name
        fn = _group_getter(kind)
        nxd_stubs._REBIND[getattr(ps, name)] = fn
        setattr(ps, name, fn)
    nxd_stubs.rebind()
    _note("parallel_state process-group getters (world, tp, ep-model, ep-data, dp, pp, cp)",
          "objects with size()/rank() from the real mesh's replica groups; as_list=True gives the groups",
          "NxD's MoE modules read group sizes at construction; no process group exists here")
    ws, rk = torch.distributed.get_world_size, torch.distributed.get_rank
    torch.distributed.get_world_size = lambda group=None: group.size() if isinstance(group, _Group) else ws(group)
    torch.distributed.get_rank = lambda group=None: group.rank() if isinstance(group, _Group) else rk(group)
    _note("torch.distributed.get_world_size/get_rank with a group (mixtral_stubs)",
          "the size / index of the caller in that group (a _Group above); without a group as nxd_stubs",
          "NxD's parallel layers take their tp size from torch.distributed.get_world_size(group=tp group)")
    ckpt = nxd_stubs.import_nxd_checkpoint()
    nxd_stubs.rebind()
    return ckpt


# --------------------------------------------------------------------------
# transformers (not installable for torch 1.13): the base classes NxDT's
# models/hf_models/modeling_mixtral.py subclasses, restated from HF
# transformers' modeling_mixtral.py / configuration_mixtral.py (4.5x).  Only
# __init__-time behaviour matters: NxDT's subclasses build every module
# themselves; the bases add no parameters except where restated below.
# --------------------------------------------------------------------------


class MixtralConfig:
    """transformers.MixtralConfig stand-in: plain attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _identity_decorator_factory(*a, **k):
    if len(a) == 1 and callable(a[0]) and not k:
        return a[0]
    return lambda f: f


def install_transformers():
    if "transformers" in sys.modules:
        return

    def mod(name, **attrs):
        m = _new_module(name, pkg_path=[], **attrs)
        return m

    mod("transformers")
    mod("transformers.activations", ACT2FN={"silu": nn.SiLU()})
    mod("transformers.modeling_outputs",
        MoeCausalLMOutputWithPast=type("MoeCausalLMOutputWithPast", (), {}),
        MoeModelOutputWithPast=type("MoeModelOutputWithPast", (), {}))
    import logging as _logging

    mod("transformers.utils",
        add_start_docstrings=_identity_decorator_factory,
        add_start_docstrings_to_model_forward=_identity_decorator_factory,
        replace_return_docstrings=_identity_decorator_factory,
        auto_docstring=_identity_decorator_factory,
        logging=types.SimpleNamespace(get_logger=_logging.getLogger))
    mod("transformers.models")
    mod("transformers.models.llama")
    mod("transformers.models.llama.modeling_llama", LlamaMLP=type("LlamaMLP", (nn.Module,), {}))
    mod("transformers.models.mixtral")
    mod("transformers.models.mixtral.configuration_mixtral", MixtralConfig=MixtralConfig)

    class MixtralPreTrainedModel(nn.Module):
        # PreTrainedModel.__init__ keeps the config; post_init() runs HF weight
        # init, which does not matter: generate.py sets every value afterwards.
        def __init__(self, config, *a, **k):
            nn.Module.__init__(self)
            self.config = config

        def post_init(self):
            pass

    class MixtralRMSNorm(nn.Module):
        # HF MixtralRMSNorm.__init__: weight = ones(hidden_size), variance_epsilon = eps
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

    class MixtralRotaryEmbedding(nn.Module):
        # HF MixtralRotaryEmbedding.__init__ (default rope): inv_freq =
        # 1 / base^(arange(0, dim, 2)/dim), registered with persistent=False
        # (so it is NOT in the state dict); attention_scaling = 1.0.
        def __init__(self, config, device=None):
            super().__init__()
            self.rope_type = "default"
            dim = config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.original_inv_freq = self.inv_freq
            self.attention_scaling = 1.0

    def _unused(*a, **k):
        raise RuntimeError("transformers function stand-in called")

    mod("transformers.models.mixtral.modeling_mixtral",
        MixtralAttention=type("MixtralAttention", (nn.Module,), {}),
        MixtralDecoderLayer=type("MixtralDecoderLayer", (nn.Module,), {}),
        MixtralForCausalLM=type("MixtralForCausalLM", (MixtralPreTrainedModel,), {}),
        MixtralModel=type("MixtralModel", (MixtralPreTrainedModel,), {}),
        MixtralPreTrainedModel=MixtralPreTrainedModel,
        MixtralRMSNorm=MixtralRMSNorm,
        MixtralRotaryEmbedding=MixtralRotaryEmbedding,
        apply_rotary_pos_emb=_unused, repeat_kv=_unused, rotate_half=_unused)
    _note("transformers (activations, modeling_outputs, utils, llama.LlamaMLP, mixtral.*)",
          "base classes restated from HF's modeling_mixtral.py: PreTrainedModel keeps config and post_init() "
          "does nothing; MixtralRMSNorm(weight=ones, variance_epsilon); MixtralRotaryEmbedding (inv_freq "
          "buffer, persistent=False as in HF, so not saved); config = plain attributes; decorators identity; "
          "forward helpers raise if called",
          "transformers is not installable for Debian's torch 1.13; NxDT's modeling_mixtral.py subclasses these",
          "no: every saved parameter is created by NxDT/NxD code; values are set by generate.py")
    _new_module("neuronx_distributed.kernels", pkg_path=[])
    _new_module("neuronx_distributed.kernels.flash_attn", nki_flash_attn_func=_unused)
    _note("neuronx_distributed.kernels.flash_attn.nki_flash_attn_func", "raises if called",
          "NKI kernel imported by modeling_mixtral.py; flash attention is off (fusions.flash_attention False)")


def import_nxdt_modeling_mixtral():
    install_transformers()
    nxdt_src = nxd_stubs._env_path("NXDT_SRC")
    root = os.path.join(nxdt_src, "neuronx_distributed_training")
    nxd_stubs._pkg_shell("neuronx_distributed_training", root)
    nxd_stubs._pkg_shell("neuronx_distributed_training.models", os.path.join(root, "models"))
    nxd_stubs._pkg_shell("neuronx_distributed_training.models.hf_models", os.path.join(root, "models", "hf_models"))
    import neuronx_distributed_training.models.hf_models.modeling_mixtral as mm

    nxd_stubs.rebind()
    return mm

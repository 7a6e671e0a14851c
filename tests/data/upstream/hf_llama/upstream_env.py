"""Import unmodified upstream NxD / NxDT code on a CPU-only box.

Nothing here is upstream code.  This module only fills ``sys.modules`` with
small stand-ins for what the upstream files import but this box does not have
(torch_xla, torch_neuronx, transformers, ...) and makes the upstream *package*
``__init__``s be skipped (they import the whole training stack), so that
individual upstream files can be imported from the paths given by

    SHARDKIT_NXD_SRC   .../neuronx-distributed/src           (holds neuronx_distributed/)
    SHARDKIT_NXDT_SRC  .../neuronx-distributed-training/src  (holds neuronx_distributed_training/)

Every stand-in either raises when called or is a restatement that names the
upstream lines it restates.  No upstream line is changed or copied here.
"""

import hashlib
import importlib
import logging
import os
import re
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

# Commits the fixtures were generated from (checked against the trees given).
NXD_COMMIT = "fbac349b61a3adbb123c2983835af692840ff62f"
NXDT_COMMIT = "9169aa03f39efd4eb02da63891a7ed98defb1714"


def nxd_src():
    p = os.environ.get("SHARDKIT_NXD_SRC")
    if not p or not os.path.isdir(os.path.join(p, "neuronx_distributed")):
        raise SystemExit("set SHARDKIT_NXD_SRC to neuronx-distributed/src (the dir holding neuronx_distributed/)")
    return os.path.abspath(p)


def nxdt_src():
    p = os.environ.get("SHARDKIT_NXDT_SRC")
    if not p or not os.path.isdir(os.path.join(p, "neuronx_distributed_training")):
        raise SystemExit("set SHARDKIT_NXDT_SRC to neuronx-distributed-training/src")
    return os.path.abspath(p)


def git_blob_sha1(path):
    """git's blob id of a file, so a reader can check which upstream file ran."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --------------------------------------------------------------------------- helpers

class _Unavailable:
    """Stand-in object for an upstream dependency that must not be used here."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"stub {self._name} called: not available on this CPU-only box")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}")


class _AutoModule(types.ModuleType):
    """Module whose unknown attributes are _Unavailable stand-ins (for `from X import a, b`)."""

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        v = _Unavailable(f"{self.__name__}.{item}")
        setattr(self, item, v)
        return v


def _stub(name, auto=True, **attrs):
    m = (_AutoModule if auto else types.ModuleType)(name)
    m.__dict__.update(attrs)
    m.__file__ = f"<stub {name}>"
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, m)
    return m


def _stub_pkg(name, **attrs):
    m = _stub(name, **attrs)
    m.__path__ = []
    return m


def _real_pkg(name, path):
    """A package whose real __init__ is skipped but whose real submodules import from `path`."""
    if name in sys.modules and getattr(sys.modules[name], "__path__", None) == [path]:
        return sys.modules[name]
    m = types.ModuleType(name)
    m.__path__ = [path]
    m.__file__ = os.path.join(path, "__init__.py (skipped)")
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, m)
    return m


def _stub_torch_xla():
    if "torch_xla" in sys.modules:
        return
    _stub_pkg("torch_xla")
    _stub_pkg("torch_xla.utils")
    _stub("torch_xla.utils.serialization")  # xser.save/load -> raise (we run with --save_xser unset)
    _stub_pkg("torch_xla.core")
    _stub("torch_xla.core.xla_model")
    _stub("torch_xla.core.xla_env_vars")
    _stub("torch_xla.runtime")
    _stub_pkg("torch_neuronx")
    _stub("torch_neuronx.utils")


# --------------------------------------------------------------------------- converter

_TP = {"size": 1, "rank": 0}  # what the parallel_state stand-in reports


def load_checkpoint_converter():
    """Import NxD's src/neuronx_distributed/scripts/checkpoint_converter.py unmodified.

    Real upstream modules it pulls in: pipeline/partition.py (create_partitions,
    stage_to_pipeline_parallel_rank), utils/logger.py, utils/serialization.py,
    scripts/yaml_converter.py.  Stand-ins: torch_xla.utils.serialization (xser;
    unused because --save_xser/--load_xser stay unset), parallel_state (only
    get_pipeline_model_parallel_{rank,size} and rmsg are imported by partition.py;
    the converter passes pp_size explicitly so they are never called),
    trainer.checkpoint._xser_load_data and trainer.checkpoint_storage (xser-only).
    """
    src = nxd_src()
    _stub_torch_xla()
    root = os.path.join(src, "neuronx_distributed")
    _real_pkg("neuronx_distributed", root)
    for sub in ("pipeline", "utils", "parallel_layers", "trainer", "scripts"):
        _real_pkg(f"neuronx_distributed.{sub}", os.path.join(root, sub))
    if "neuronx_distributed.parallel_layers.parallel_state" not in sys.modules:
        _stub("neuronx_distributed.parallel_layers.parallel_state")
    _stub("neuronx_distributed.trainer.checkpoint")
    _stub("neuronx_distributed.trainer.checkpoint_storage")
    mod = importlib.import_module("neuronx_distributed.scripts.checkpoint_converter")
    return mod


# --------------------------------------------------------------------------- NxDT modeling_llama

def _hf_repeat_kv(hidden_states, n_rep):
    """Restates transformers.models.llama.modeling_llama.repeat_kv (HF Llama, eager path):
    (b, kv, s, d) -> (b, kv*n_rep, s, d), each KV head repeated n_rep times *consecutively*
    (expand on a new dim 2, then reshape)."""
    b, kv, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None, :, :].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class _LlamaConfig:
    """Stand-in for transformers.LlamaConfig: plain attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _make_transformers_stubs():
    if "transformers" in sys.modules:
        return
    _stub_pkg("transformers")
    _stub("transformers.activations", ACT2FN={"silu": nn.SiLU()})
    _stub("transformers.modeling_outputs",
          BaseModelOutputWithPast=type("BaseModelOutputWithPast", (), {}),
          CausalLMOutputWithPast=type("CausalLMOutputWithPast", (), {}))
    _stub("transformers.cache_utils", Cache=type("Cache", (), {}))
    _stub_pkg("transformers.models")
    _stub_pkg("transformers.models.llama")
    _stub("transformers.models.llama.configuration_llama", LlamaConfig=_LlamaConfig)

    class LlamaPreTrainedModel(nn.Module):
        # transformers.PreTrainedModel.__init__ keeps the config; post_init() initialises
        # weights, which does not matter here (weights are loaded from the fixtures).
        def __init__(self, config, *a, **k):
            nn.Module.__init__(self)
            self.config = config

        def post_init(self):
            pass

    class LlamaRMSNormHF(nn.Module):
        # HF LlamaRMSNorm.__init__: weight = ones(hidden), variance_epsilon = eps.
        def __init__(self, hidden_size, eps=1e-6):
            nn.Module.__init__(self)
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

    class LlamaRotaryEmbeddingHF(nn.Module):
        # HF LlamaRotaryEmbedding.__init__ with rope_type "default":
        # inv_freq = 1 / theta ** (arange(0, d, 2) / d), attention_scaling = 1.0,
        # registered as a non-persistent buffer (so it is not a parameter).
        def __init__(self, config, device=None):
            nn.Module.__init__(self)
            self.config = config
            self.rope_type = "default"
            d = config.hidden_size // config.num_attention_heads
            inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            self.register_buffer("inv_freq", inv, persistent=False)
            self.attention_scaling = 1.0

    ns = dict(
        LlamaPreTrainedModel=LlamaPreTrainedModel,
        LlamaAttention=type("LlamaAttentionHF", (nn.Module,), {}),
        LlamaDecoderLayer=type("LlamaDecoderLayerHF", (nn.Module,), {}),
        LlamaForCausalLM=type("LlamaForCausalLMHF", (LlamaPreTrainedModel,), {}),
        LlamaForSequenceClassification=type("LlamaForSequenceClassification", (LlamaPreTrainedModel,), {}),
        LlamaMLP=type("LlamaMLPHF", (nn.Module,), {}),
        LlamaModel=type("LlamaModelHF", (LlamaPreTrainedModel,), {}),
        LlamaRMSNorm=LlamaRMSNormHF,
        LlamaRotaryEmbedding=LlamaRotaryEmbeddingHF,
        repeat_kv=_hf_repeat_kv,
    )
    _stub("transformers.models.llama.modeling_llama", **ns)

    def _ident_deco(*a, **k):
        return lambda f: f

    # No auto_docstring attribute on purpose: modeling_llama.py then takes its own
    # ImportError fallback.
    _stub("transformers.utils", auto=False,
          add_start_docstrings=_ident_deco,
          add_start_docstrings_to_model_forward=_ident_deco,
          replace_return_docstrings=_ident_deco,
          logging=types.SimpleNamespace(get_logger=logging.getLogger))

    class _Version(tuple):
        pass

    def _parse(s):
        # enough of packaging.version.parse for `parse(torch.__version__) >= parse("2.1")`
        nums = []
        for part in s.split("+")[0].split("."):
            m = re.match(r"\d+", part)
            if not m:
                break
            nums.append(int(m.group()))
        return _Version(nums)

    _stub_pkg("packaging")
    _stub("packaging.version", parse=_parse)


# Parallel-layer stand-ins.  Each holds exactly the *local* (per-tp-rank) parameter
# under the same attribute name as the real NxD layer, and its forward is the local
# matmul the real layer performs before any collective.


class ColumnParallelLinear(nn.Module):
    """Stand-in for NxD parallel_layers/layers.py ColumnParallelLinear with gather_output=False:
    weight (out/tp, in); forward = x @ weight.T (no collective in the forward when
    gather_output=False).  bias=False everywhere in NxDT's modeling_llama, so no bias param."""

    def __init__(self, input_size, output_size, bias=False, gather_output=False, stride=1, dtype=torch.float32,
                 **kw):
        super().__init__()
        assert not bias and not gather_output
        tp = _TP["size"]
        assert output_size % tp == 0
        self.stride = stride
        self.weight = nn.Parameter(torch.empty(output_size // tp, input_size, dtype=dtype))

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Stand-in for NxD RowParallelLinear(input_is_parallel=True): weight (out, in/tp); forward
    returns the *local partial sum* x_local @ weight.T.  The real layer then all-reduces (sums)
    over tp ranks (reduce_from_tensor_model_parallel_region); forward_check.py does that sum."""

    def __init__(self, input_size, output_size, bias=False, input_is_parallel=True, dtype=torch.float32, **kw):
        super().__init__()
        assert not bias and input_is_parallel
        tp = _TP["size"]
        assert input_size % tp == 0
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp, dtype=dtype))

    def forward(self, x):
        return F.linear(x, self.weight)


class ParallelEmbedding(nn.Module):
    """Stand-in for NxD ParallelEmbedding (vocab-sharded, partition dim 0): weight (vocab/tp, hidden)."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, dtype=torch.float32, **kw):
        super().__init__()
        tp = _TP["size"]
        self.weight = nn.Parameter(torch.empty(num_embeddings // tp, embedding_dim, dtype=dtype or torch.float32))


class GQAQKVColumnParallelLinear(nn.Module):
    """Stand-in for NxD modules/qkv_linear.py GQAQKVColumnParallelLinear (gather_output=False, no bias).

    Shapes restate __init__ / _create_weights_biases (qkv_linear.py L443-L450, L472-L513):
      q_out = output_sizes[0] / tp,  kv_out = output_sizes[1] * kv_size_multiplier / tp,
      fuse_qkv: weight_qkv (q_out + 2*kv_out, in), else weight_q / weight_k / weight_v.
    Forward restates GQAQKVLinearWithAsyncCommunication.forward (qkv_linear.py L164-L174):
      fused: split(x @ weight_qkv.T, [q_out, kv_out, kv_out], dim=-1); else three matmuls.
    """

    def __init__(self, input_size, output_sizes, bias=False, gather_output=False, kv_size_multiplier=1,
                 fuse_qkv=True, dtype=torch.float32, **kw):
        super().__init__()
        assert not bias and not gather_output
        tp = _TP["size"]
        assert tp % kv_size_multiplier == 0
        assert (output_sizes[1] * kv_size_multiplier) % tp == 0
        self.kv_size_multiplier = kv_size_multiplier
        self.fuse_qkv = fuse_qkv
        self.q_output_size_per_partition = output_sizes[0] // tp
        self.kv_output_size_per_partition = output_sizes[1] * kv_size_multiplier // tp
        q, kv = self.q_output_size_per_partition, self.kv_output_size_per_partition
        if fuse_qkv:
            self.weight_qkv = nn.Parameter(torch.empty(q + 2 * kv, input_size, dtype=dtype))
        else:
            self.weight_q = nn.Parameter(torch.empty(q, input_size, dtype=dtype))
            self.weight_k = nn.Parameter(torch.empty(kv, input_size, dtype=dtype))
            self.weight_v = nn.Parameter(torch.empty(kv, input_size, dtype=dtype))

    def forward(self, x):
        q, kv = self.q_output_size_per_partition, self.kv_output_size_per_partition
        if self.fuse_qkv:
            return torch.split(F.linear(x, self.weight_qkv), [q, kv, kv], dim=-1)
        return F.linear(x, self.weight_q), F.linear(x, self.weight_k), F.linear(x, self.weight_v)


class _TorchXlaToCpu:
    """Wraps the `torch` global of modeling_llama only: CoreAttention.forward builds its causal
    mask with torch.ones(..., device="xla") (modeling_llama.py L244); on this CPU box that
    device is mapped to "cpu".  Every other attribute is torch's own."""

    def __getattr__(self, item):
        v = getattr(torch, item)
        if item in ("ones", "zeros", "full", "arange", "empty", "tensor"):
            def wrapped(*a, **k):
                if str(k.get("device")) == "xla":
                    k["device"] = "cpu"
                return v(*a, **k)
            return wrapped
        return v


def set_tp(size, rank=0):
    _TP["size"] = size
    _TP["rank"] = rank


def load_nxdt_modeling_llama():
    """Import NxDT src/neuronx_distributed_training/models/hf_models/modeling_llama.py unmodified.

    Real upstream modules used: modeling_llama.py itself (CoreAttention, LlamaAttention,
    LlamaMLP, LlamaDecoderLayer, LlamaModel, LlamaForCausalLM, LlamaRMSNorm, LlamaRotaryEmbedding),
    NxD overrides/transformer_overrides.py (apply_rotary_pos_emb, rotate_half),
    NxDT utils/utils.py (get_cast_dtype), NxD utils/utils.py (hardware).
    Stand-ins: transformers base classes (above), NxD parallel layers (above),
    parallel_state getters (tp size from set_tp, context-parallel size 1), flash/ring
    attention kernels (raise; use_flash_attention=False selects CoreAttention).
    """
    s_nxd, s_nxdt = nxd_src(), nxdt_src()
    _stub_torch_xla()
    _make_transformers_stubs()
    root = os.path.join(s_nxd, "neuronx_distributed")
    _real_pkg("neuronx_distributed", root)
    for sub in ("pipeline", "utils", "parallel_layers", "trainer", "scripts", "kernels", "modules", "overrides"):
        _real_pkg(f"neuronx_distributed.{sub}", os.path.join(root, sub))
    _stub("neuronx_distributed.parallel_layers.parallel_state",
          get_tensor_model_parallel_size=lambda: _TP["size"],
          get_tensor_model_parallel_rank=lambda: _TP["rank"],
          get_context_model_parallel_size=lambda: 1,
          get_context_model_parallel_rank=lambda: 0,
          get_pipeline_model_parallel_size=lambda: 1,
          get_pipeline_model_parallel_rank=lambda: 0,
          rmsg=lambda m: m)

    def divide(a, b):
        # NxD parallel_layers/utils.py divide(): asserts divisibility, returns a // b.
        assert a % b == 0, f"{a} is not divisible by {b}"
        return a // b

    _stub("neuronx_distributed.parallel_layers.utils", divide=divide)
    _stub("neuronx_distributed.parallel_layers.mappings")
    _stub("neuronx_distributed.parallel_layers.loss_functions")
    _stub("neuronx_distributed.parallel_layers.layers", ColumnParallelLinear=ColumnParallelLinear,
          RowParallelLinear=RowParallelLinear, ParallelEmbedding=ParallelEmbedding)
    _stub("neuronx_distributed.kernels.flash_attn")
    _stub("neuronx_distributed.kernels.ring_attention_kernel")
    _stub("neuronx_distributed.modules.qkv_linear", GQAQKVColumnParallelLinear=GQAQKVColumnParallelLinear)
    tr = os.path.join(s_nxdt, "neuronx_distributed_training")
    _real_pkg("neuronx_distributed_training", tr)
    for sub in ("utils", "models", "models/hf_models", "lightning_modules", "lightning_modules/model",
                "lightning_modules/model/hf_models"):
        _real_pkg("neuronx_distributed_training." + sub.replace("/", "."), os.path.join(tr, sub))
    mod = importlib.import_module("neuronx_distributed_training.models.hf_models.modeling_llama")
    mod.torch = _TorchXlaToCpu()
    return mod


def load_nxdt_param_grouping():
    """Import NxDT src/neuronx_distributed_training/utils/model_utils.py (get_param_groups_by_weight_decay)."""
    tr = os.path.join(nxdt_src(), "neuronx_distributed_training")
    _real_pkg("neuronx_distributed_training", tr)
    _real_pkg("neuronx_distributed_training.utils", os.path.join(tr, "utils"))
    return importlib.import_module("neuronx_distributed_training.utils.model_utils")


def load_nxd_module(dotted):
    """Import one more real NxD module after load_checkpoint_converter()/load_nxdt_modeling_llama()."""
    return importlib.import_module(dotted)


def upstream_function(relpath, name, root="nxd", **globals_):
    """Compile one function ("func" or "Class.method"), unmodified, out of an upstream file.

    Used where importing the whole upstream module would drag in the device stack
    (parallel_state.py, layers.py, qkv_linear.py, base_model.py): the function's source
    lines are taken verbatim (only the common indentation of a method is removed) and
    executed with the global names it uses supplied by the caller.  Line numbers are kept,
    so tracebacks point into the upstream file.  Returns (function, first_line, last_line).
    """
    import ast
    import textwrap
    import typing

    base = nxd_src() if root == "nxd" else nxdt_src()
    path = os.path.join(base, relpath)
    with open(path) as f:
        text = f.read()
    body = ast.parse(text).body
    cls, _, fn = name.rpartition(".")
    if cls:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == fn), None)
    if node is None:
        raise KeyError(f"{name} not found in {path}")
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = text.splitlines(keepends=True)[first - 1: node.end_lineno]
    src = "\n" * (first - 1) + textwrap.dedent("".join(lines))
    ns = {k: getattr(typing, k) for k in ("Any", "Callable", "Dict", "List", "Optional", "Tuple", "Union")}
    ns["torch"] = torch
    ns.update(globals_)
    exec(compile(src, path, "exec"), ns)
    return ns[fn], first, node.end_lineno

"""CPU stand-ins for what the real NxD / NxDT checkpoint code needs and that a
CPU-only Debian machine (torch 1.13, no torch_xla, no Neuron SDK) lacks.

Shared by generate.py and load_check.py.  Dev-time only: nothing in CI imports
this (CI has no upstream source).

Rules kept here:
  * no upstream line is changed; upstream files are imported from the paths
    given in the environment (NXD_SRC, NXDT_SRC, TORCH_XLA_SRC,
    LIGHTNING_UTILITIES_SRC, NEMO_SRC);
  * every stub is listed in STUB_NOTES below together with why it exists and
    whether it can change what lands on disk;
  * where the real code of a missing package is pure Python (parts of
    torch_xla, lightning_utilities, NeMo's LR schedulers) the real file is
    loaded instead of a stub.

Simulated world
  One Python process plays every rank.  The simulated global rank lives in a
  thread-local (SIM.rank).  Saving is done rank by rank in one thread (no data
  collective is involved).  Anything that needs real collectives (the ZeRO-1
  optimizer step: reduce-scatter / all-gather; xser loading: the all-reduce
  based broadcast) runs one thread per rank, and the collective stubs below
  exchange tensors between those threads.
"""

import ast
import importlib.util
import os
import sys
import threading
import types
from collections import defaultdict

import torch

# --------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------


def _env_path(name, required=True):
    v = os.environ.get(name)
    if not v:
        if required:
            raise SystemExit(f"environment variable {name} is not set (see README.md)")
        return None
    if not os.path.isdir(v):
        raise SystemExit(f"{name}={v} is not a directory")
    return os.path.abspath(v)


STUB_NOTES = []  # (name, what it does, why, changes bytes on disk?)


def _note(name, what, why, affects_output="no"):
    STUB_NOTES.append((name, what, why, affects_output))


# --------------------------------------------------------------------------
# simulated ranks
# --------------------------------------------------------------------------


class _Sim:
    def __init__(self):
        self._tls = threading.local()
        self.world_size = 1
        self.threaded = False
        self.groups = None  # real NxD replica groups (ParallelGroups namedtuple)
        self._barrier = None
        self._cv = threading.Condition()
        self._slots = {}
        self._seq = defaultdict(int)
        self.timeout = 120.0

    # rank -------------------------------------------------------------
    @property
    def rank(self):
        return getattr(self._tls, "rank", 0)

    def set_rank(self, r):
        self._tls.rank = r

    # topology ---------------------------------------------------------
    @staticmethod
    def _mine(groups, rank):
        for g in groups:
            if rank in g:
                return list(g)
        raise RuntimeError(f"rank {rank} in no group of {groups}")

    def group_of(self, kind, rank=None):
        rank = self.rank if rank is None else rank
        return self._mine(getattr(self.groups, kind), rank)

    def index_in(self, kind, rank=None):
        rank = self.rank if rank is None else rank
        return self.group_of(kind, rank).index(rank)

    # running ranks ----------------------------------------------------
    def run_sequential(self, fn):
        """Call fn(rank) for rank 0..world-1 in turn, in this thread."""
        out = {}
        for r in range(self.world_size):
            self.set_rank(r)
            out[r] = fn(r)
        self.set_rank(0)
        return out

    def run_threaded(self, fn):
        """Call fn(rank) for every rank at once, one thread per rank, so that
        the collective stubs can exchange data.  Re-raises the first error."""
        out, errs = {}, {}
        self._barrier = threading.Barrier(self.world_size, timeout=self.timeout)
        self._slots.clear()
        self._seq.clear()

        def body(r):
            self.set_rank(r)
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001
                import traceback

                errs[r] = (e, traceback.format_exc())
                try:
                    self._barrier.abort()
                except Exception:
                    pass
                with self._cv:
                    self._cv.notify_all()

        self.threaded = True
        ts = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(self.world_size)]
        try:
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        finally:
            self.threaded = False
            self._barrier = None
        if errs:
            r = min(errs)
            sys.stderr.write(f"rank {r} failed:\n{errs[r][1]}")
            raise errs[r][0]
        return out

    # collectives (threads only) --------------------------------------
    def barrier(self):
        if self.threaded:
            self._barrier.wait()

    def exchange(self, group, value):
        """Every rank of `group` deposits `value`; each gets the list of all
        deposits ordered as in `group`."""
        if not self.threaded:
            if len(group) == 1:
                return [value]
            raise RuntimeError(
                "a data collective over %s was reached while ranks run one after another; "
                "this path needs SIM.run_threaded" % (group,)
            )
        key = tuple(group)
        me = self.rank
        with self._cv:
            s = self._seq[(me, key)]
            self._seq[(me, key)] += 1
            slot = self._slots.setdefault((key, s), {"vals": {}, "read": 0})
            slot["vals"][me] = value
            self._cv.notify_all()
            ok = self._cv.wait_for(lambda: len(slot["vals"]) == len(group), timeout=self.timeout)
            if not ok:
                raise RuntimeError(f"collective over {group} timed out on rank {me}")
            vals = [slot["vals"][r] for r in group]
            slot["read"] += 1
            if slot["read"] == len(group):
                del self._slots[(key, s)]
        return vals


SIM = _Sim()


def _groups_arg(groups):
    """xm collectives take `groups` as a list of rank lists (or None = world)."""
    if groups is None or len(groups) == 0:
        return list(range(SIM.world_size))
    return SIM._mine(groups, SIM.rank)


# --------------------------------------------------------------------------
# module helpers
# --------------------------------------------------------------------------


def _new_module(name, pkg_path=None, **attrs):
    m = types.ModuleType(name)
    m.__file__ = f"<stub {name}>"
    if pkg_path is not None:
        m.__path__ = list(pkg_path)
    for k, v in attrs.items():
        setattr(m, k, v)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, m)
    return m


def _load_source(name, path, optimize=-1):
    """Load an unmodified upstream file as module `name`.  optimize=1 compiles
    it with assert statements removed (the `python -O` rule), nothing else."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    with open(path, "rb") as f:
        src = f.read()
    code = compile(src, path, "exec", optimize=optimize, dont_inherit=True)
    exec(code, mod.__dict__)
    return mod


def _pkg_shell(name, path):
    """A package whose __init__.py is NOT run (heavy imports we do not need);
    its submodules are then imported from `path` as usual."""
    return _new_module(name, pkg_path=[path])


# --------------------------------------------------------------------------
# torch_xla
# --------------------------------------------------------------------------


def _install_torch_xla(xla_src):
    txla = os.path.join(xla_src, "torch_xla")

    def _noop(*a, **k):
        return None

    xlac = types.SimpleNamespace(_xla_sync_multi=_noop)
    _new_module(
        "torch_xla",
        pkg_path=[],
        __version__="2.9.0+cpu-stub",
        _XLAC=xlac,
        sync=_noop,
        device=lambda *a, **k: torch.device("cpu"),
    )
    _note(
        "torch_xla, torch_xla._XLAC._xla_sync_multi, torch_xla.sync",
        "empty package; sync functions do nothing",
        "no XLA runtime; tensors already live on CPU",
    )

    _new_module("torch_xla.core", pkg_path=[])
    _new_module("torch_xla.utils", pkg_path=[])
    _new_module("torch_xla.distributed", pkg_path=[])

    # real, pure-Python helpers used by ToXlaTensorArena
    xu = _load_source("torch_xla.utils.utils", os.path.join(txla, "utils", "utils.py"))

    # ---- torch_xla.runtime
    rt = _new_module(
        "torch_xla.runtime",
        world_size=lambda: SIM.world_size,
        global_device_count=lambda: SIM.world_size,
        addressable_device_count=lambda: SIM.world_size,
        local_device_count=lambda: SIM.world_size,
        local_process_count=lambda: SIM.world_size,
        global_ordinal=lambda: SIM.rank,
        local_ordinal=lambda: SIM.rank,
        process_index=lambda: 0,
        device_type=lambda: "NEURON",
        using_pjrt=lambda: True,
        is_spmd=lambda: False,
    )
    sys.modules["torch_xla"].runtime = rt
    _note(
        "torch_xla.runtime (xr)",
        "world_size/global_device_count/local_process_count = simulated world size; "
        "global_ordinal/local_ordinal = simulated rank (one host)",
        "no PJRT runtime",
    )

    _new_module("torch_xla.core.xla_env_vars", HOST_WORLD_SIZE="XRT_HOST_WORLD_SIZE")

    # ---- torch_xla.core.xla_model
    xm = _new_module("torch_xla.core.xla_model")
    xm.REDUCE_SUM, xm.REDUCE_MUL, xm.REDUCE_AND = "sum", "mul", "and"
    xm.REDUCE_OR, xm.REDUCE_MIN, xm.REDUCE_MAX = "or", "min", "max"
    xm.xla_device = lambda *a, **k: torch.device("cpu")
    xm.mark_step = _noop
    xm.unlazy = _noop
    xm.wait_device_ops = _noop
    xm.add_step_closure = lambda fn, args=(), run_async=False: fn(*args)
    xm.get_ordinal = lambda *a, **k: SIM.rank
    xm.get_local_ordinal = lambda *a, **k: SIM.rank
    xm.xrt_world_size = lambda *a, **k: SIM.world_size
    xm.is_master_ordinal = lambda local=True: SIM.rank == 0
    xm.is_xla_tensor = lambda t: isinstance(t, torch.Tensor)
    xm.rendezvous = lambda tag, payload=b"", replicas=[]: SIM.barrier()

    _RED = {
        "sum": lambda xs: _sum(xs),
        "max": lambda xs: _fold(torch.maximum, xs),
        "min": lambda xs: _fold(torch.minimum, xs),
    }

    def _sum(xs):
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = acc + x
        return acc

    def _fold(f, xs):
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = f(acc, x)
        return acc

    def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
        group = _groups_arg(groups)
        single = isinstance(inputs, torch.Tensor)
        ts = [inputs] if single else list(inputs)
        got = SIM.exchange(group, [t.detach().clone() for t in ts])
        outs = []
        for i, t in enumerate(ts):
            r = _RED[reduce_type]([g[i] for g in got])
            if scale != 1.0:
                r = r * scale
            r = r.to(t.dtype)
            outs.append(r)
        if single:
            return outs[0]
        for t, r in zip(ts, outs):  # list form is in place
            t.data.copy_(r)
        return ts

    def reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None,
                       output=None, pin_layout=True, channel_id=None, use_global_device_ids=None):
        group = _groups_arg(groups)
        assert len(group) == shard_count, (group, shard_count)
        got = SIM.exchange(group, input.detach().clone())
        r = _RED[reduce_type](got)
        if scale != 1.0:
            r = r * scale
        r = r.to(input.dtype)
        return r.chunk(shard_count, dim=scatter_dim)[group.index(SIM.rank)].clone()

    def all_gather(value, dim=0, groups=None, output=None, pin_layout=True,
                   channel_id=None, use_global_device_ids=None):
        group = _groups_arg(groups)
        got = SIM.exchange(group, value.detach().clone())
        return torch.cat(got, dim=dim)

    xm.all_reduce, xm.reduce_scatter, xm.all_gather = all_reduce, reduce_scatter, all_gather

    # The real ToXlaTensorArena class, taken from torch_xla/core/xla_model.py
    # (the whole file cannot be imported without the XLA runtime).
    xm_path = os.path.join(txla, "core", "xla_model.py")
    with open(xm_path) as f:
        tree = ast.parse(f.read(), xm_path)
    cls = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ToXlaTensorArena"]
    assert len(cls) == 1
    ns = {"xu": xu, "torch": torch, "__name__": "torch_xla.core.xla_model"}
    import typing

    for k in ("Any", "Callable", "List", "Dict", "Optional", "Tuple"):
        ns[k] = getattr(typing, k)
    exec(compile(ast.Module(body=cls, type_ignores=[]), xm_path, "exec"), ns)
    RealArena = ns["ToXlaTensorArena"]
    xm._RealToXlaTensorArena = RealArena

    def _tests_for_xla_device(select_fn):
        code = getattr(select_fn, "__code__", None)
        if code is None:
            return False
        # only the closure form (parallel_layers.utils.move_all_tensor_to_cpu's local
        # is_xla_tensor, which reads tensor.device.type); a global xm.is_xla_tensor call
        # is answered by the xm.is_xla_tensor stub itself
        return "is_xla_tensor" in code.co_freevars

    class ToXlaTensorArena(RealArena):
        """Real class; only the tensor selection is adapted: a select_fn
        that asks "is this an XLA tensor?" through a local helper reading
        tensor.device.type is answered as if every torch.Tensor lived on the
        XLA device (as all of them would in a real Neuron run)."""

        def __init__(self, convert_fn, select_fn):
            if _tests_for_xla_device(select_fn):
                orig_sel, orig_conv = select_fn, convert_fn

                def select_fn(v, _orig=orig_sel):  # noqa: E306
                    return isinstance(v, torch.Tensor) or _orig(v)

                def convert_fn(ts, _orig=orig_conv):  # noqa: E306
                    # a device->host copy always yields a new tensor with its
                    # own storage; on CPU `.to("cpu")` returns the input itself
                    out = _orig(ts)
                    if out is ts:  # convert=False: tensors handed back as they are
                        return out
                    return [o.clone() if o is t else o for o, t in zip(out, ts)]

            super().__init__(convert_fn, select_fn)

    xm.ToXlaTensorArena = ToXlaTensorArena
    _note(
        "torch_xla.core.xla_model (xm)",
        "ToXlaTensorArena = the real class from torch_xla/core/xla_model.py (v2.9.0), "
        "with select functions that test 'is XLA tensor' (parallel_layers.utils.move_all_tensor_to_cpu) "
        "answered True for every tensor, and that function's tensor.to('cpu') results cloned when "
        "they come back as the very same object (a real device->host copy always makes a new tensor: "
        "two state-dict entries sharing one CPU storage would otherwise be pickled as one storage); "
        "rendezvous = barrier between rank threads (no-op when ranks run one after another); "
        "all_reduce/reduce_scatter/all_gather = real data exchange between rank threads; "
        "mark_step/unlazy = no-op; xla_device = cpu",
        "the real module needs the XLA C++ runtime",
        "no: traversal order, container rewriting (tuple->list, OrderedDict->dict, "
        "torch.Size->list) come from the real class",
    )

    def _import_only(*a, **k):
        raise RuntimeError("torch_xla import-only stub called")

    _new_module("torch_xla.utils.checkpoint", checkpoint=_import_only)
    _note(
        "torch_xla.utils.checkpoint.checkpoint",
        "raises if called",
        "imported at module level by NxD's activation_checkpoint.py (via trainer.py); activation "
        "checkpointing is not part of this run",
    )

    # real serialization module (TensorReference, _get_tensor_file, ...)
    _load_source("torch_xla.utils.serialization", os.path.join(txla, "utils", "serialization.py"))
    # real ZeRO-1 optimizer, compiled with asserts removed (see note)
    _load_source(
        "torch_xla.distributed.zero_redundancy_optimizer",
        os.path.join(txla, "distributed", "zero_redundancy_optimizer.py"),
        optimize=1,
    )
    _note(
        "torch_xla.distributed.zero_redundancy_optimizer",
        "real file (v2.9.0), compiled with optimize=1 (assert statements dropped, as `python -O`)",
        "its _shard_parameters() asserts `self.device.type == 'xla'`; every other assert in the "
        "file holds in this run",
        "no",
    )


# --------------------------------------------------------------------------
# Neuron SDK bits
# --------------------------------------------------------------------------


def _install_neuron_sdk_stubs():
    _new_module("torch_neuronx", pkg_path=[])
    _new_module("torch_neuronx.utils", get_platform_target=lambda: "trn1")
    _note("torch_neuronx.utils.get_platform_target", "returns 'trn1'", "no Neuron SDK; only picks NxD's replica-group logic (LOGIC1)")
    for n in ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki._pre_prod_kernels"):
        _new_module(n, pkg_path=[])

    class CollectivesConfig:  # never used on the checkpoint path
        pass

    _new_module("neuronxcc.nki._pre_prod_kernels.collectives", CollectivesConfig=CollectivesConfig)
    _note("neuronxcc...collectives.CollectivesConfig", "empty class", "imported by parallel_state at import time only")


# --------------------------------------------------------------------------
# neuronx_distributed
# --------------------------------------------------------------------------


def _install_nxd(nxd_src, tp, pp, dp):
    root = os.path.join(nxd_src, "neuronx_distributed")
    nxd = _pkg_shell("neuronx_distributed", root)
    _pkg_shell("neuronx_distributed.trainer", os.path.join(root, "trainer"))
    _note(
        "neuronx_distributed, neuronx_distributed.trainer packages",
        "package objects whose __init__.py is not executed (submodules load from NXD_SRC)",
        "the __init__ files import tracing/kernels/model-builder code that needs the Neuron SDK",
    )

    import enum

    class QuantizedDtype(enum.Enum):
        INT8 = torch.int8

    _pkg_shell("neuronx_distributed.quantization", os.path.join(root, "quantization"))
    _new_module("neuronx_distributed.quantization.quantization_config", QuantizedDtype=QuantizedDtype)
    _note(
        "neuronx_distributed.quantization.quantization_config.QuantizedDtype",
        "enum with INT8 only",
        "the real enum references torch.uint16/uint32/float8 dtypes that torch 1.13 lacks; "
        "parallel_layers/layers.py imports it, quantized layers are not used here",
    )

    class NxDPPModel(torch.nn.Module):
        """placeholder; checkpoint.py only does isinstance(model, NxDPPModel)"""

    _new_module("neuronx_distributed.pipeline", pkg_path=[], NxDPPModel=NxDPPModel)
    _note(
        "neuronx_distributed.pipeline.NxDPPModel",
        "placeholder class",
        "pipeline/model.py needs torch 2 + fx tracing; save/load get the PP-local state dict "
        "as a plain dict (what NxDPPModel.local_state_dict() returns) instead",
    )

    # torch.distributed as seen by NxD
    torch.distributed.is_initialized = lambda: True
    torch.distributed.is_available = lambda: True
    torch.distributed.get_rank = lambda group=None: SIM.rank
    torch.distributed.get_world_size = lambda group=None: SIM.world_size
    _note(
        "torch.distributed.is_initialized/get_rank/get_world_size",
        "True / simulated rank / simulated world size",
        "no process group in a one-process simulation",
    )

    import neuronx_distributed.parallel_layers.parallel_state as ps

    SIM.world_size = tp * pp * dp
    SIM.set_rank(0)
    # the real rank layout (mesh only; no process group is created)
    SIM.groups = ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, mesh_only=True
    )
    g = SIM.groups

    def rank_in(kind):
        return lambda: SIM.index_in(kind)

    def size_of(kind):
        return lambda: len(SIM.group_of(kind))

    patches = dict(
        model_parallel_is_initialized=lambda: True,
        get_tensor_model_parallel_rank=rank_in("tp_groups"),
        get_tensor_model_parallel_size=size_of("tp_groups"),
        get_pipeline_model_parallel_rank=rank_in("pp_groups"),
        get_pipeline_model_parallel_size=size_of("pp_groups"),
        get_data_parallel_rank=rank_in("dp_groups"),
        get_data_parallel_size=size_of("dp_groups"),
        get_context_model_parallel_rank=rank_in("cp_groups"),
        get_context_model_parallel_size=size_of("cp_groups"),
        get_expert_model_parallel_rank=rank_in("ep_model_groups"),
        get_expert_model_parallel_size=size_of("ep_model_groups"),
        get_expert_data_parallel_rank=rank_in("ep_data_groups"),
        get_expert_data_parallel_size=size_of("ep_data_groups"),
        get_tensor_model_parallel_replica_groups=lambda: [list(x) for x in g.tp_groups],
        get_pipeline_model_parallel_replica_groups=lambda: [list(x) for x in g.pp_groups],
        get_data_parallel_replica_groups=lambda: [list(x) for x in g.dp_groups],
        get_context_model_parallel_replica_groups=lambda: [list(x) for x in g.cp_groups],
        get_expert_model_parallel_replica_groups=lambda: [list(x) for x in g.ep_model_groups],
        get_expert_data_parallel_replica_groups=lambda: [list(x) for x in g.ep_data_groups],
        get_zero1_sharding_groups=lambda: [list(x) for x in g.dp_groups],
        is_global_rank_zero=lambda: SIM.rank == 0,
    )
    for k, v in patches.items():
        assert hasattr(ps, k), k
        _REBIND[getattr(ps, k)] = v
        setattr(ps, k, v)
    rebind()
    _note(
        "neuronx_distributed.parallel_layers.parallel_state getters",
        "rank/size/replica-group getters (tp, pp, dp, cp, ep-model, ep-data) computed from the simulated "
        "rank and the replica groups that the REAL initialize_model_parallel(..., mesh_only=True) returns",
        "no process groups exist; the getters read them. Modules that imported a getter by name "
        "before the swap (e.g. parallel_layers/grads.py) are re-pointed to the stub (rebind())",
    )
    return nxd


_REBIND = {}


def rebind():
    """Modules that did `from .parallel_state import get_x` before the getters
    were replaced still hold the originals; point those names at the stubs."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("neuronx_distributed") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            try:
                new = _REBIND.get(val)
            except TypeError:
                continue
            if new is not None:
                setattr(mod, attr, new)


def import_nxd_checkpoint():
    """Import the real checkpoint module and expose it the way
    neuronx_distributed/__init__.py does (nxd.save_checkpoint, ...)."""
    import neuronx_distributed as nxd
    import neuronx_distributed.trainer.checkpoint as ckpt

    for k in ("CheckpointIOState", "finalize_checkpoint", "has_checkpoint", "load_checkpoint", "save_checkpoint"):
        setattr(nxd, k, getattr(ckpt, k))
    return ckpt


# --------------------------------------------------------------------------
# Lightning / NeMo (NxDT)
# --------------------------------------------------------------------------


class _AnyAttr(types.ModuleType):
    """Module whose every missing attribute is an inert placeholder class.
    Used only for packages NxDT imports at module level but whose objects are
    not used on the checkpoint save/load path exercised here."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        ph = type(name, (object,), {"__init__": lambda self, *a, **k: None,
                                    "__module__": self.__name__,
                                    "__class_getitem__": classmethod(lambda cls, item: cls)})
        setattr(self, name, ph)
        return ph


class _AnyAttrFinder:
    """Meta-path finder that serves _AnyAttr modules for the listed roots."""

    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _AnyAttr(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def install_nxdt(nxdt_src, lu_src, nemo_src):
    sys.path.insert(0, lu_src)  # real lightning_utilities (apply_to_collection, RequirementCache)
    import lightning_utilities  # noqa: F401

    sys.meta_path.insert(0, _AnyAttrFinder(["lightning", "pytorch_lightning", "nemo", "torchmetrics", "apex", "hydra"]))
    _note(
        "lightning, pytorch_lightning, nemo, torchmetrics, apex, hydra",
        "any attribute is an inert placeholder class (import-time only)",
        "not installable here (no PyPI); nlp_overrides.py imports them at module level. On the save/load "
        "path only NLPCheckpointIO is used; its base XLACheckpointIO is such a placeholder, so "
        "NLPCheckpointIO.__init__'s super().__init__() does nothing",
        "no: NLPCheckpointIO.save_checkpoint/load_checkpoint run unchanged",
    )
    _note(
        "lightning_utilities",
        "real package (Lightning-AI/utilities v0.11.9) from LIGHTNING_UTILITIES_SRC",
        "NLPCheckpointIO.save_checkpoint uses apply_to_collection and RequirementCache('omegaconf')",
    )
    root = os.path.join(nxdt_src, "neuronx_distributed_training")
    _pkg_shell("neuronx_distributed_training", root)
    _pkg_shell("neuronx_distributed_training.lightning_modules", os.path.join(root, "lightning_modules"))
    _note(
        "neuronx_distributed_training, .lightning_modules packages",
        "package objects whose __init__.py is not executed",
        "the __init__ files register NeMo optimizers and apply patches (NeMo not available)",
    )
    import neuronx_distributed_training.lightning_modules.nlp_overrides as nlp_overrides

    return nlp_overrides


def load_nemo_lr_scheduler(nemo_src):
    """Real nemo/core/optim/lr_scheduler.py (NeMo v2.1.0) with its config-registry
    imports served by placeholders (the scheduler classes do not use them)."""
    return _load_source("nemo_core_optim_lr_scheduler", os.path.join(nemo_src, "nemo", "core", "optim", "lr_scheduler.py"))


# --------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------


def install(tp, pp, dp, with_nxdt=False):
    os.environ.setdefault("PJRT_DEVICE", "NEURON")  # as on a Neuron host: get_local_world_size() -> xr
    os.environ.setdefault("NXD_LOG_LEVEL", "error")
    nxd_src = _env_path("NXD_SRC")
    xla_src = _env_path("TORCH_XLA_SRC")
    _install_torch_xla(xla_src)
    _install_neuron_sdk_stubs()
    _install_nxd(nxd_src, tp, pp, dp)
    ckpt = import_nxd_checkpoint()
    rebind()
    out = {"ckpt": ckpt}
    if with_nxdt:
        out["nlp_overrides"] = install_nxdt(
            _env_path("NXDT_SRC"), _env_path("LIGHTNING_UTILITIES_SRC"), _env_path("NEMO_SRC")
        )
        rebind()
    return out

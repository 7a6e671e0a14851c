"""Nothing shardkit writes runs code on load, and no input's payload passes through.

Every pickle every command writes is loaded with a restricted unpickler that
resolves only the globals torch 2's torch.load(weights_only=True) allows
(pytorch torch/_weights_only_unpickler.py _get_allowed_globals) plus xser's
TensorReference, and executes only the opcodes that unpickler executes.
(torch 1.13's own weights_only loader, Debian's, rejects any Python float,
even in files torch itself saves, so it cannot serve as the check.)

Then inputs with an os.system call planted (a pickled __reduce__ object) in
user_content.pt, scheduler.pt, an optimizer's param_groups and NNM's
hyper_parameters: each command exits 2 naming the file and the path inside
it, the payload never runs (it would create a marker file), and no `done`
tag is written."""
import _compat_pickle
import collections
import glob
import io
import os
import pickle
import pickletools
import shutil
import subprocess
import sys
import types
import zipfile

import torch
from omegaconf import OmegaConf

from canon import CONVERT, EXPORT, IMPORT, RESHARD, SAMPLE, TOKENIZE, TRAIN, TempDirTest, VERIFY, run
from nnm_fixture import make_nnm
from nxd_fixture import make_full, write_tag

LLAMA = dict(gpt=False, hidden=16, ffn=24, heads=4, kv_heads=4, layers=2, vocab=32, divisible=8, seq=8)
FORMAT = ["--heads", 4, "--kv_heads", 4, "--vocab_size", 32, "--make_vocab_size_divisible_by", 8]
CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
TEXT = "/usr/share/common-licenses/GPL-3"
XSER_REFERENCE = "torch_xla.utils.serialization.TensorReference"


# -- the restricted unpickler ------------------------------------------------
def torch2_allowed_globals():
    """torch 2's _get_allowed_globals, name -> object, as far as torch 1.13 has the objects."""
    rc = {"collections.OrderedDict": collections.OrderedDict, "collections.Counter": collections.Counter,
          "torch.nn.parameter.Parameter": torch.nn.Parameter, "torch.serialization._get_layout": torch.serialization._get_layout,
          "torch.Size": torch.Size, "torch.Tensor": torch.Tensor, "torch.device": torch.device,
          "_codecs.encode": __import__("_codecs").encode, "builtins.bytearray": bytearray, "builtins.set": set,
          "builtins.complex": complex}
    for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.qint8, torch.quint8, torch.qint32):
        rc[str(t)] = t
    for ts in torch._storage_classes:
        rc[f"{ts.__module__}.{ts.__name__}"] = ts
    for qt in (torch.per_tensor_affine, torch.per_tensor_symmetric, torch.per_channel_affine, torch.per_channel_symmetric,
               torch.per_channel_affine_float_qparams):
        rc[str(qt)] = qt
    for f in ("_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_tensor", "_rebuild_tensor_v2",
              "_rebuild_tensor_v3", "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage", "_rebuild_wrapper_subclass",
              "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor"):
        if hasattr(torch._utils, f):
            rc["torch._utils." + f] = getattr(torch._utils, f)
    rc["torch._tensor._rebuild_from_type_v2"] = torch._tensor._rebuild_from_type_v2
    return rc


ALLOWED = torch2_allowed_globals()
# The opcodes torch 2's weights-only Unpickler.load executes; any other is an error there.
OPCODES = {"PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK", "TUPLE",
           "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET",
           "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID", "BINGET", "LONG_BINGET",
           "BINPUT", "LONG_BINPUT", "LONG1"}


class TensorReference:
    """xser's reference (torch_xla.utils.serialization), which NxD's xser loader resolves."""


class WeightsOnlyUnpickler(pickle.Unpickler):
    """Resolves only torch 2's weights-only globals; storages come from the zip's data/ records."""

    def __init__(self, data, archive=None, prefix=""):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.storages = archive, prefix, {}

    def find_class(self, module, name):
        # Python 2 names (__builtin__.set) mapped as torch's _read_global_instruction maps them
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if full == XSER_REFERENCE:
            return TensorReference
        if full not in ALLOWED:
            raise pickle.UnpicklingError(f"global {full} is not one torch.load(weights_only=True) allows")
        return ALLOWED[full]

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid[0] == "storage") or self.archive is None:
            raise pickle.UnpicklingError(f"persistent id {pid!r} is not a storage")
        _, cls, key, _, numel = pid
        if key not in self.storages:
            data = self.archive.read(f"{self.prefix}/data/{key}")
            assert len(data) == numel * torch._utils._element_size(cls.dtype), key
            raw = torch.UntypedStorage.from_buffer(data, dtype=torch.uint8) if data else torch.UntypedStorage(0)
            self.storages[key] = torch.storage.TypedStorage(wrap_storage=raw, dtype=cls.dtype)
        return self.storages[key]


def check_opcodes(data, what):
    for op, _, pos in pickletools.genops(data):
        if op.name not in OPCODES:
            raise AssertionError(f"{what}: byte {pos}: opcode {op.name}, which torch's weights-only loader does not execute")


def load_weights_only(path):
    """A torch zip .pt file (any archive prefix), as torch 2's weights-only loader would read it."""
    with zipfile.ZipFile(path) as z:
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
        assert len(pkl) == 1, f"{path}: {pkl}"
        data = z.read(pkl[0])
        check_opcodes(data, path)
        return WeightsOnlyUnpickler(data, z, pkl[0][:-len("/data.pkl")]).load()


def load_pickle_bytes(data, what):
    check_opcodes(data, what)
    return WeightsOnlyUnpickler(data).load()


# -- the inputs with a payload -------------------------------------------------
class Payload:
    """torch.load of a pickle holding this runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def edit_pt(path, edit):
    v = torch.load(path)  # a file this test wrote: no payload yet
    edit(v)
    torch.save(v, path)


class FakeLightning:
    """pytorch_lightning.utilities.parsing.AttributeDict as Lightning 1.x pickles it (a dict
    subclass), without Lightning: a module of that name holding a class of that name."""

    def __enter__(self):
        names = ["pytorch_lightning", "pytorch_lightning.utilities", "pytorch_lightning.utilities.parsing"]
        self.saved = {n: sys.modules.get(n) for n in names}
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        cls = type("AttributeDict", (dict,), {"__module__": names[-1]})
        sys.modules[names[-1]].AttributeDict = cls
        return cls

    def __exit__(self, *exc):
        for n, m in self.saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


class WeightsOnlyOutputs(TempDirTest):
    """Every file each command writes loads with the restricted unpickler."""

    def assert_loads_weights_only(self, root, want_pickles):
        """Loads every pickle under `root` (zip .pt files, HDF5 pickled attributes); no other
        file is a pickle. Returns {relative path: loaded value}."""
        got = {}
        files = [root] if os.path.isfile(root) else [os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns]
        for f in sorted(files):
            rel = os.path.relpath(f, root) if f != root else os.path.basename(f)
            if zipfile.is_zipfile(f):
                got[rel] = load_weights_only(f)
            elif f.endswith(".h5"):
                import h5py
                with h5py.File(f, "r") as h:
                    for k, v in h.attrs.items():
                        if getattr(v, "dtype", None) is not None and v.dtype.name == "uint8" and bytes(v[:1]) == b"\x80":
                            got[rel + ":" + k] = load_pickle_bytes(bytes(v), f + ": " + k)
            else:
                with open(f, "rb") as fh:
                    self.assertNotEqual(fh.read(1), b"\x80", f"{f}: a pickle outside a torch zip")
        for w in want_pickles:
            self.assertIn(w, got, f"{root}: {w} not written")
        return got

    def nxd_tag(self, style="nxd", zero1=False):
        return write_tag(os.path.join(self.dir, "src_" + style), make_full(LLAMA, tp=2), tp=2, style=style, zero1=zero1)

    def test_ckpt_reshard_plain_and_xser(self):
        src = self.nxd_tag("nxd")
        plain, xser = os.path.join(self.dir, "plain.ckpt"), os.path.join(self.dir, "xser.ckpt")
        run(RESHARD, src, plain, "--tp", 1, "--pp", 1, *FORMAT)
        run(RESHARD, src, xser, "--tp", 1, "--pp", 1, "--save_xser", *FORMAT)
        rank = "dp_rank_00_tp_rank_00_pp_rank_00.pt"
        got = self.assert_loads_weights_only(plain, ["model/" + rank, "optim/" + rank, "scheduler.pt", "user_content.pt"])
        self.assertEqual(got["scheduler.pt"], torch.load(os.path.join(src, "scheduler.pt")))
        self.assertEqual(got["optim/" + rank]["param_groups"][0]["betas"], (0.9, 0.999))
        self.assertTrue(torch.equal(got["model/" + rank]["language_model.encoder.final_layernorm.weight"],
                                    torch.load(os.path.join(plain, "model", rank))["language_model.encoder.final_layernorm.weight"]))
        x = self.assert_loads_weights_only(xser, ["model/" + rank, "model/" + rank + ".info.pt", "model/" + rank + ".tensors/tensor_0.pt",
                                                  "optim/" + rank, "user_content.pt"])
        refs = [v for v in x["model/" + rank].values() if isinstance(v, TensorReference)]
        self.assertEqual(sorted(r.tid for r in refs), list(range(len(refs))))
        self.assertGreater(len(refs), 5)
        self.assertIsInstance(x["model/" + rank + ".tensors/tensor_0.pt"], torch.Tensor)

    def test_upstream_nxdt_tag_resharded(self):
        """NxDT's real user_content.pt (callbacks, loops, lr_schedulers, hyper_parameters)."""
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_tags", "nxdt_pt",
                           "megatron_llama--step=4-consumed_samples=32.0.ckpt")
        out = os.path.join(self.dir, "out.ckpt")
        run(RESHARD, src, out, "--tp", 1, "--pp", 1, "--weights_only")
        got = self.assert_loads_weights_only(out, ["user_content.pt"])
        self.assertEqual(got["user_content.pt"]["hyper_parameters"], torch.load(os.path.join(src, "user_content.pt"))["hyper_parameters"])

    def test_nnm2nxdt_ckpt_makes_hyper_parameters_plain(self):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, LLAMA, tp=2, pp=1)
        first = sorted(glob.glob(os.path.join(nnm, "*", "*.ckpt")))
        with FakeLightning() as AttributeDict:
            # Lightning's AttributeDict (model.hparams), pickled as it is, is read as the dict it is.
            for f in first:
                edit_pt(f, lambda v: v.update(hyper_parameters=AttributeDict(v["hyper_parameters"])))
            nnm_cfg = torch.load(first[0])["hyper_parameters"]["cfg"]
        run(CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--n_layers", 2)
        got = self.assert_loads_weights_only(out, ["user_content.pt", "model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
                                                   "optim/dp_rank_00_tp_rank_01_pp_rank_00.pt"])
        hp = got["user_content.pt"]["hyper_parameters"]
        self.assertIs(type(hp), dict)
        self.assertIs(type(hp["cfg"]), dict)
        self.assertEqual(hp["cfg"], OmegaConf.to_container(nnm_cfg))
        self.assertEqual((hp["cfg"]["num_attention_heads"], hp["cfg"]["tensor_model_parallel_size"]), (4, 2))
        # NxDT's save-side reading of it (NLPCheckpointIO._is_checkpoint_using_zero1_optimizer) works on the dict.
        self.assertIs(hp.get("cfg", {}).get("wrap_with_zero", False), False)

    def test_export_import_train_sample(self):
        src = self.nxd_tag("nxdt")
        h5, hf = os.path.join(self.dir, "x.h5"), os.path.join(self.dir, "hf")
        run(EXPORT, src, h5, *FORMAT)
        run(EXPORT, src, hf, "--format", "hf", "--bin", *FORMAT)
        groups = self.assert_loads_weights_only(h5, ["x.h5:param_groups"])["x.h5:param_groups"]
        self.assertEqual(groups, torch.load(os.path.join(src, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))["param_groups"])
        bin_ = self.assert_loads_weights_only(hf, ["pytorch_model.bin"])["pytorch_model.bin"]
        self.assertEqual(bin_["model.norm.weight"].dtype, torch.bfloat16)
        for name, argv, want in (("from_h5", [h5], ["user_content.pt", "optim/dp_rank_00_tp_rank_01_pp_rank_00.pt"]),
                                 ("from_hf", ["--format", "hf", hf], [])):
            out = os.path.join(self.dir, name + ".ckpt")
            run(IMPORT, *argv, out, "--tp", 2, "--pp", 1)
            self.assert_loads_weights_only(out, ["model/dp_rank_00_tp_rank_01_pp_rank_00.pt"] + want)
        # shardkit-train's tags, and ckpt-sample's.
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))
        subprocess.run([TRAIN, CONF, "exp_manager.explicit_log_dir=run", "exp_manager.async_checkpointing=False", "trainer.max_steps=2",
                        "exp_manager.checkpoint_callback_params.every_n_train_steps=2"], cwd=self.dir, check=True, capture_output=True)
        tags = glob.glob(os.path.join(self.dir, "run", "checkpoints", "*.ckpt"))
        self.assertEqual(len(tags), 1)
        uc = self.assert_loads_weights_only(tags[0], ["user_content.pt", "scheduler.pt", "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"])
        self.assertEqual(uc["user_content.pt"]["global_step"], 2)
        run(SAMPLE, os.path.join(self.dir, "sample"))
        for tag in glob.glob(os.path.join(self.dir, "sample", "*.ckpt")):
            self.assert_loads_weights_only(tag, ["user_content.pt", "scheduler.pt", "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"])

    def test_the_checker_refuses_what_torch_2_refuses(self):
        """The restricted unpickler itself: a payload, a set it allows, a frozenset it does not."""
        marker = os.path.join(self.dir, "PWNED")
        path = os.path.join(self.dir, "x.pt")
        torch.save({"x": Payload(marker)}, path)
        with self.assertRaisesRegex(pickle.UnpicklingError, "posix.system is not one"):
            load_weights_only(path)
        torch.save({"s": {1, 2}, "b": b"ab", "t": torch.arange(3)}, path)
        self.assertEqual(load_weights_only(path)["s"], {1, 2})
        torch.save({"f": frozenset([1])}, path)
        with self.assertRaisesRegex(pickle.UnpicklingError, "builtins.frozenset"):
            load_weights_only(path)
        self.assertFalse(os.path.exists(marker))


class PayloadsNeverPassThrough(TempDirTest):
    """An os.system call planted in what the commands carry over is refused, naming file and path."""

    def setUp(self):
        super().setUp()
        self.marker = os.path.join(self.dir, "PWNED")

    def expect_refused(self, argv, names, out, code=2):
        p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120)
        msg = p.stderr + p.stdout
        self.assertEqual(p.returncode, code, msg)
        for n in names:
            self.assertIn(n, msg)
        self.assertFalse(os.path.exists(self.marker), "the payload ran")
        self.assertFalse(os.path.exists(out), f"{out} was left")
        self.assertEqual(glob.glob(os.path.join(self.dir, "**", "done"), recursive=True), self.done_before)
        return msg

    def poisoned_tag(self, rel, edit):
        src = write_tag(os.path.join(self.dir, "src"), make_full(LLAMA, tp=2), tp=2, style="nxd")
        edit_pt(os.path.join(src, rel), edit)
        self.done_before = glob.glob(os.path.join(self.dir, "**", "done"), recursive=True)
        return src

    def check_tag_routes(self, rel, edit, where):
        src = self.poisoned_tag(rel, edit)
        path = os.path.join(src, rel)
        out = os.path.join(self.dir, "out.ckpt")
        named = [path + " at " + where, "posix.system", "torch.load(weights_only=True)"]
        self.expect_refused([RESHARD, src, out, "--tp", 1, "--pp", 1, *FORMAT], named, out)
        self.expect_refused([RESHARD, src, out, "--tp", 1, "--pp", 1, "--save_xser", *FORMAT], named, out)
        self.expect_refused([EXPORT, src, out + ".h5", *FORMAT], named, out)
        self.assertFalse(os.path.exists(out + ".h5"))
        self.expect_refused([VERIFY, src], [path, where, "posix.system"], out, code=1)

    def test_user_content(self):
        self.check_tag_routes("user_content.pt", lambda v: v["cli_args"].update(hook=Payload(self.marker)), "/cli_args/hook")

    def test_scheduler(self):
        self.check_tag_routes("scheduler.pt", lambda v: v.update(lr_lambdas=[Payload(self.marker)]), "/lr_lambdas/[0]")

    def test_optimizer_param_groups(self):
        self.check_tag_routes("optim/dp_rank_00_tp_rank_01_pp_rank_00.pt",
                              lambda v: v["param_groups"][0].update(hook=Payload(self.marker)), "/param_groups/[0]/hook")

    def test_nnm_hyper_parameters(self):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, LLAMA, tp=2, pp=1)
        rank = sorted(glob.glob(os.path.join(nnm, "*", "*.ckpt")))[1]

        def cases():
            # Beside the config, and inside it as a node's value (omegaconf's allow_objects).
            yield lambda v: v["hyper_parameters"].update(hook=Payload(self.marker)), "/hyper_parameters/hook"
            yield (lambda v: v["hyper_parameters"].update(cfg=OmegaConf.create(dict(OmegaConf.to_container(v["hyper_parameters"]["cfg"]),
                                                                                    hook=Payload(self.marker)),
                                                                               flags={"allow_objects": True})),
                   "/hyper_parameters/cfg/hook")
        good = open(rank, "rb").read()
        self.done_before = []
        for edit, where in cases():
            with open(rank, "wb") as f:
                f.write(good)
            edit_pt(rank, edit)
            for extra in ([], ["--tp", 1]):
                self.expect_refused([CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--n_layers", 2, *extra],
                                    [rank + " at " + where, "posix.system"], out)
                self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    import unittest
    unittest.main()

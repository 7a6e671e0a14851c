"""Canonical JSON of Python/torch objects, mirroring ckpt::ValueToJson.

Both sides number storages in order of first appearance while walking the tree
in the same order, so sharing between tensors is compared too.
"""
import collections
import copyreg
import json
import os
import struct
import subprocess
import tempfile
import unittest

import torch

BIN = os.environ.get("SHARDKIT_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
PROGRAMS = os.path.join(BIN, "bin")  # every program the build makes, products and test programs
PT_CANONICAL = os.path.join(PROGRAMS, "pt_canonical")
INSPECT = os.path.join(PROGRAMS, "ckpt-inspect")
VERIFY = os.path.join(PROGRAMS, "ckpt-verify")
RESHARD = os.path.join(PROGRAMS, "ckpt-reshard")
EXPORT = os.path.join(PROGRAMS, "ckpt-export")
IMPORT = os.path.join(PROGRAMS, "ckpt-import")
SAMPLE = os.path.join(PROGRAMS, "ckpt-sample")
STRESS = os.path.join(PROGRAMS, "ckpt_store_stress")
CONFIG = os.path.join(PROGRAMS, "nnm2nxdt-config")
TRAIN_DUMP = os.path.join(PROGRAMS, "train_reference_dump")
TOKENIZE = os.path.join(PROGRAMS, "shardkit-tokenize")
TRAIN = os.path.join(PROGRAMS, "shardkit-train")
CONVERT = os.path.join(PROGRAMS, "nnm2nxdt-ckpt")

_DTYPE_NAMES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128",
}
DTYPES = list(_DTYPE_NAMES)


def _int(v):
    if -(1 << 63) <= v < (1 << 63):
        return {"t": "int", "v": v}
    n = (v.bit_length() + 8) // 8  # room for the sign bit
    b = bytearray(v.to_bytes(n, "little", signed=True))
    while len(b) > 1 and ((b[-1] == 0 and not b[-2] & 0x80) or (b[-1] == 0xFF and b[-2] & 0x80)):
        b.pop()
    return {"t": "int", "le": bytes(b).hex()}


def storage_bytes(t):
    return torch.empty(0, dtype=torch.uint8).set_(t.storage()._storage).numpy().tobytes()


class Canon:
    def __init__(self, protocol=2):
        self.storage_ids = {}
        self.protocol = protocol

    def storage_index(self, t):
        key = t.storage()._storage._cdata
        return self.storage_ids.setdefault(key, len(self.storage_ids))

    def pairs(self, items):
        return [[self.do(k), self.do(v)] for k, v in items]

    def do(self, x):
        if x is None:
            return {"t": "none"}
        if isinstance(x, bool):
            return {"t": "bool", "v": x}
        if isinstance(x, int):
            return _int(x)
        if isinstance(x, float):
            return {"t": "float", "bits": struct.pack(">d", x).hex()}
        if isinstance(x, str):
            return {"t": "str", "v": x}
        if isinstance(x, bytes):
            return {"t": "bytes", "hex": x.hex()}
        if isinstance(x, torch.Tensor):
            es = x.element_size()
            sb = storage_bytes(x)
            off = x.storage_offset()
            c = x.contiguous()
            if c.data_ptr() == x.data_ptr() and x.is_contiguous():
                data = sb[off * es:(off + x.numel()) * es]
            else:
                cb = storage_bytes(c)
                data = cb[c.storage_offset() * es:(c.storage_offset() + c.numel()) * es]
            return {"t": "tensor", "dtype": _DTYPE_NAMES[x.dtype], "shape": list(x.shape), "stride": list(x.stride()),
                    "offset": off, "storage": self.storage_index(x), "storage_bytes": len(sb),
                    "param": isinstance(x, torch.nn.Parameter), "requires_grad": x.requires_grad,
                    "data": data.hex(), "storage_hex": sb.hex()}
        if isinstance(x, torch.Size):
            return {"t": "size", "items": [self.do(v) for v in x]}
        if type(x) is tuple:
            return {"t": "tuple", "items": [self.do(v) for v in x]}
        if type(x) is list:
            return {"t": "list", "items": [self.do(v) for v in x]}
        if type(x) in (set, frozenset):
            return {"t": "set" if isinstance(x, set) else "frozenset", "items": [self.do(v) for v in x]}
        if isinstance(x, torch.dtype):
            return {"t": "global", "module": "torch", "name": str(x).split(".")[1]}
        if type(x) is collections.OrderedDict:
            j = {"t": "odict", "items": self.pairs(x.items())}
            if vars(x):
                j["attrs"] = self.do(dict(vars(x)))
            return j
        if type(x) is dict:
            return {"t": "dict", "items": self.pairs(x.items())}
        if isinstance(x, type):
            return {"t": "global", "module": x.__module__, "name": x.__qualname__}
        return self.obj(x)

    def obj(self, x):
        r = x.__reduce_ex__(self.protocol)
        fn, args = r[0], r[1]
        state = r[2] if len(r) > 2 else None
        items = list(r[3]) if len(r) > 3 and r[3] is not None else []
        ditems = list(r[4]) if len(r) > 4 and r[4] is not None else []
        if fn is copyreg.__newobj__:
            cls, how, args = args[0], "newobj", args[1:]
        else:
            cls, how = fn, "reduce"
        j = {"t": "object", "module": cls.__module__, "name": cls.__qualname__, "how": how,
             "args": self.do(tuple(args))}
        j["state"] = None if state is None else self.do(state)
        j["list_items"] = [self.do(v) for v in items]
        j["dict_items"] = self.pairs(ditems)
        return j


def canonical(obj, protocol=2):
    """`protocol` picks how plain class instances reduce (0/1 use copyreg._reconstructor)."""
    return Canon(protocol).do(obj)


def normalized(j):
    """Order-insensitive for sets (their iteration order depends on hashing)."""
    if isinstance(j, dict):
        out = {k: normalized(v) for k, v in j.items()}
        if j.get("t") in ("set", "frozenset"):
            out["items"] = sorted(out["items"], key=lambda v: json.dumps(v, sort_keys=True))
        return out
    if isinstance(j, list):
        return [normalized(v) for v in j]
    return j


def run(*args, check=True):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}): {p.stderr}")
    return p


def cpp_dump(path):
    return json.loads(run(PT_CANONICAL, "dump", path).stdout)


def cpp_build(obj_json, out, weights_only=False, check=True):
    src = out + ".json"
    with open(src, "w") as f:
        json.dump(obj_json, f)
    return run(PT_CANONICAL, "build", src, out, *(["-w"] if weights_only else []), check=check)


def cpp_copy(src, out, weights_only=False, check=True):
    return run(PT_CANONICAL, "copy", src, out, *(["-w"] if weights_only else []), check=check)


class TempDirTest(unittest.TestCase):
    """A test case with a fresh temporary directory in self.dir."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

"""Real torch against shardkit's C++ .pt reader and writer, both directions."""
import collections
import os
import unittest
import zipfile

import torch

from canon import (DTYPES, PT_CANONICAL, TempDirTest, canonical, cpp_build, cpp_copy, cpp_dump, normalized, run)
from interop_classes import Foreign, ForeignList


def every_dtype_tensors():
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in DTYPES:
        base = torch.randn(3, 4, generator=g, dtype=torch.float64) * 50
        if dt.is_complex:
            t = torch.complex(base, -base).to(dt)
        elif dt == torch.bool:
            t = base > 0
        else:
            t = base.to(dt)
        out[str(dt)] = t
    return out


def rich_object():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=g)
    sd = collections.OrderedDict()
    sd["layer.weight"] = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    sd["layer.frozen"] = torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False)
    sd._metadata = collections.OrderedDict({"": {"version": 1}})
    return {
        "dtypes": every_dtype_tensors(),
        "views": [base, base[1:4], base.t(), base[:, 2], base[::2, ::3]],  # one storage, many views
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "state_dict": sd,
        "nested": {"list": [1, [2, (3, "x")], {"k": None}], "tuple": (1.5, -2, True, False)},
        "unicode": "héllo wörld ✓ 日本",
        "ints": [0, 255, 256, 65535, 65536, -1, 2**31 - 1, -2**31, 2**40, -2**63, 2**63 - 1],
        "bigints": [2**64, -2**64 - 1, 12345678901234567890123456789012345678901234567890],
        "floats": [0.1, -0.0, float("inf"), 1e-310, 3e38],
        "none": None,
        "bytes": [b"", b"\x00\xff\x80abc"],
        "size": torch.Size([2, 3, 4]),
        "sets": [{1, 2, 3}, frozenset(["a", "b"])],
        "dtype_values": [torch.float32, torch.bfloat16, torch.int64],
        "foreign": Foreign("cfg", {"lr": 3e-4, "layers": [1, 2]}),
        "foreign_list": ForeignList([1, "two", 3.0]),
        "shared_list": None,  # set below
    }


def writable_object():
    """rich_object() less what shardkit refuses to write: objects of other classes and
    frozensets, which torch.load(weights_only=True) does not build (ckpt/pt/pickle_writer.h)."""
    obj = rich_object()
    del obj["foreign"], obj["foreign_list"]
    obj["sets"] = [{1, 2, 3}]
    return obj


class TorchWritesWeRead(TempDirTest):
    def check_file(self, obj, path, **save_kwargs):
        torch.save(obj, path, **save_kwargs)
        want = canonical(obj, save_kwargs.get("pickle_protocol", 2))
        self.assertEqual(normalized(cpp_dump(path)), normalized(want))

    def test_rich_object_every_value_and_byte(self):
        obj = rich_object()
        shared = [1, 2]
        obj["shared_list"] = [shared, shared]
        self.check_file(obj, os.path.join(self.dir, "rich.pt"))

    def test_pickle_protocols_2_to_5(self):
        obj = rich_object()
        for p in (2, 3, 4, 5):
            with self.subTest(protocol=p):
                self.check_file(obj, os.path.join(self.dir, f"p{p}.pt"), pickle_protocol=p)

    def test_text_protocols_0_and_1(self):
        # Protocols 0/1 cannot carry torch's tuple persistent ids, so no tensors here.
        obj = {"a": [1, 2.5, "x", None, True], "big": 2**70, "neg": -7, "s": "ünï", "b": b"\x00\x01",
               "t": (1, (2,)), "o": collections.OrderedDict(z=1), "f": Foreign("n", [1])}
        for p in (0, 1):
            with self.subTest(protocol=p):
                self.check_file(obj, os.path.join(self.dir, f"p{p}.pt"), pickle_protocol=p)

    def test_legacy_format(self):
        obj = {"w": torch.arange(12.).reshape(3, 4), "v": None, "n": 5, "l": [torch.ones(2, dtype=torch.int8)]}
        obj["view"] = obj["w"][1]
        path = os.path.join(self.dir, "legacy.pt")
        torch.save(obj, path, _use_new_zipfile_serialization=False)
        with open(path, "rb") as f:
            self.assertNotEqual(f.read(2), b"PK")
        self.assertEqual(cpp_dump(path), canonical(obj))

    def test_module_state_dict(self):
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
        self.check_file(model.state_dict(), os.path.join(self.dir, "sd.pt"))

    def test_truncated_and_corrupt_files_error_with_the_file_name(self):
        path = os.path.join(self.dir, "good.pt")
        torch.save({"w": torch.randn(64, 64), "x": list(range(100))}, path)
        data = open(path, "rb").read()
        for cut in (0, 10, 100, len(data) // 2, len(data) - 30, len(data) - 1):
            bad = os.path.join(self.dir, f"cut{cut}.pt")
            with open(bad, "wb") as f:
                f.write(data[:cut])
            p = run(PT_CANONICAL, "dump", bad, check=False)
            self.assertEqual(p.returncode, 1, f"cut at {cut}")
            self.assertIn(bad, p.stderr)
            self.assertNotIn("Sanitizer", p.stderr)


class WeWriteTorchReads(TempDirTest):
    def test_build_from_canonical_loads_equal_in_torch(self):
        obj = writable_object()
        want = canonical(obj)
        out = os.path.join(self.dir, "ours.pt")
        cpp_build(want, out)
        got = torch.load(out)
        self.assertEqual(normalized(canonical(got)), normalized(want))
        # Views still share one storage after torch.load.
        views = got["views"]
        self.assertEqual(views[1].storage().data_ptr(), views[0].storage().data_ptr())
        views[0][1, 0] = 42.0
        self.assertEqual(views[1][0, 0].item(), 42.0)

    def test_zipfile_checks_crcs_and_alignment(self):
        out = os.path.join(self.dir, "ours.pt")
        cpp_build(canonical(writable_object()), out)
        with zipfile.ZipFile(out) as z:
            self.assertIsNone(z.testzip())
            names = z.namelist()
            self.assertEqual(names[0], "ours/data.pkl")
            self.assertIn("ours/version", names)
            with open(out, "rb") as f:
                raw = f.read()
            for info in z.infolist():
                self.assertEqual(info.compress_type, zipfile.ZIP_STORED)
                name_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little")
                extra_len = int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
                start = info.header_offset + 30 + name_len + extra_len
                if info.filename.startswith("ours/data/"):
                    self.assertEqual(start % 64, 0, info.filename)
                self.assertEqual(raw[start:start + info.file_size], z.read(info.filename))

    def test_weights_only_model_shard(self):
        g = torch.Generator().manual_seed(2)
        shard = {
            "language_model.embedding.word_embeddings.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
            "language_model.encoder.layers.0.self_attention.query_key_value.weight": torch.randn(24, 8, generator=g),
            "language_model.encoder.layers.0.input_layernorm.weight": torch.nn.Parameter(torch.ones(8)),
            "meta": collections.OrderedDict(step=5, name="x", shape=torch.Size([3]), nested=[(1, 2), {"a": None}]),
            "flags": [True, False],
            "counts": torch.arange(5, dtype=torch.int64),
        }
        out = os.path.join(self.dir, "dp_rank_00_tp_rank_00_pp_rank_00.pt")
        cpp_build(canonical(shard), out, weights_only=True)
        got = torch.load(out, weights_only=True)
        self.assertEqual(canonical(got), canonical(shard))

    def test_weights_only_rejects_floats_with_a_clear_error(self):
        out = os.path.join(self.dir, "bad.pt")
        p = cpp_build(canonical({"lr": 0.1}), out, weights_only=True, check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("cannot pickle /lr: floats are rejected by torch 1.13's weights_only loader", p.stderr)
        self.assertFalse(os.path.exists(out))
        self.assertEqual([f for f in os.listdir(self.dir) if "tmp" in f], [])


    def test_objects_of_other_classes_are_not_written(self):
        for key, path in (("foreign", "/foreign"), ("foreign_list", "/foreign_list"), ("sets", "/sets/[1]")):
            out = os.path.join(self.dir, key + ".pt")
            p = cpp_build(canonical({key: rich_object()[key]}), out, check=False)
            self.assertEqual(p.returncode, 1)
            self.assertIn("cannot pickle " + path + ": ", p.stderr)
            self.assertFalse(os.path.exists(out))
        src, dst = os.path.join(self.dir, "src.pt"), os.path.join(self.dir, "dst.pt")
        torch.save(rich_object(), src)
        p = run(PT_CANONICAL, "copy", src, dst, check=False)
        self.assertIn("cannot pickle /sets/[1]: a frozenset", p.stderr)  # the first of the three in the file
        self.assertFalse(os.path.exists(dst))


class RoundTrips(TempDirTest):
    def test_read_write_then_torch_load_is_equal(self):
        obj = writable_object()
        src, dst = os.path.join(self.dir, "src.pt"), os.path.join(self.dir, "dst.pt")
        torch.save(obj, src)
        cpp_copy(src, dst)
        got = torch.load(dst)
        self.assertEqual(normalized(canonical(got)), normalized(canonical(obj)))

    def test_read_write_read_is_equal(self):
        src, dst = os.path.join(self.dir, "src.pt"), os.path.join(self.dir, "dst.pt")
        torch.save(writable_object(), src)
        cpp_copy(src, dst)
        self.assertEqual(cpp_dump(dst), cpp_dump(src))

    def test_legacy_file_rewritten_as_zip(self):
        src, dst = os.path.join(self.dir, "legacy.pt"), os.path.join(self.dir, "new.pt")
        obj = {"w": torch.randn(5, 3), "i": 3}
        torch.save(obj, src, _use_new_zipfile_serialization=False)
        cpp_copy(src, dst)
        self.assertTrue(zipfile.is_zipfile(dst))
        self.assertEqual(canonical(torch.load(dst)), canonical(obj))

    def test_torch_state_dict_copied_weights_only(self):
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
        src, dst = os.path.join(self.dir, "sd.pt"), os.path.join(self.dir, "sd_wo.pt")
        torch.save(model.state_dict(), src)
        cpp_copy(src, dst, weights_only=True)
        got = torch.load(dst, weights_only=True)
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(got[k], v), k)


if __name__ == "__main__":
    unittest.main()

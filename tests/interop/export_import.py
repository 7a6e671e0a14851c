"""ckpt-export and ckpt-import against torch and h5py.

Sources are NxD tags torch writes from one full model (nxd_fixture.py), first
re-laid by ckpt-reshard so they carry a manifest. h5py (no torch, no shardkit)
reads the export, and every dataset must be the full tensor torch holds:
unsharded, vocab rows up to the real vocabulary, the source's padding rows
in /vocab_padding; attributes hold the steps, groups and fingerprints
(zlib's CRC-32 of the logical bytes). ckpt-import must write exactly what
ckpt-reshard writes for the same target, byte for byte.
"""
import json
import os
import subprocess
import unittest
import zlib

import h5py
import numpy as np
import torch

from canon import BIN, EXPORT, IMPORT, TempDirTest
from nxd_fixture import is_vocab, make_full, padded_vocab
from reshard import GPT, GQA, LLAMA, L, files, format_args, read_json, reshard, run_measured



def run(tool, *args, timeout=120):
    return subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def as_numpy(x):
    """A tensor as h5py holds it: 16-bit floats as their uint16 bit patterns."""
    x = x.contiguous()
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


FIELDS = (("params", None), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("master", "master"))


class ExportImport(TempDirTest):
    def setUp(self):
        super().setUp()
        for tool in (EXPORT, IMPORT):
            # A missing binary is a failure, never a skip: a wrong SHARDKIT_BIN must not pass.
            self.assertTrue(os.path.exists(tool), f"{tool} is not built")

    def tag(self, c, layout, **kw):
        """torch writes `layout`; ckpt-reshard re-lays it as itself (a manifest, our bytes)."""
        full = make_full(c, tp=layout.tp, **kw)
        src = layout.write(os.path.join(self.dir, "torch"), full)
        tag = os.path.join(self.dir, "tags", "src.ckpt")
        r = reshard(src, tag, *layout.args(), *format_args(c))
        self.assertEqual(r.returncode, 0, r.stderr)
        return full, tag

    def export(self, tag, out, *args):
        r = run(EXPORT, tag, out, *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r

    def assert_export_holds(self, h5, full, c, layout, master, weights_only=False, float32=False):
        with h5py.File(h5, "r") as f:
            self.assertEqual(f.attrs["format"], "shardkit-full-state")
            self.assertEqual(f.attrs["step"], full["step"])
            src = json.loads(f.attrs["source_layout"])
            self.assertEqual((src["tp"], src["pp"], src["dp"], src["zero1"]), tuple(layout[:4]))
            model = json.loads(f.attrs["model"])
            self.assertEqual(model["num_attention_heads"], c["heads"])
            rows = padded_vocab(c, layout.tp)
            for k, field in FIELDS:
                if full[k] is None or (field is not None and weights_only) or (k == "master" and not master):
                    if field and "optim" in f:  # not exported: no dataset of it
                        self.assertFalse(any(field in f[f"optim/{n}"] for n in full["params"]), k)
                    continue
                for n, x in full[k].items():
                    path = f"model/{n}" if field is None else f"optim/{n}/{field}"
                    d = f[path]
                    logical = x[:c["vocab"]] if is_vocab(n) else x
                    want = logical.float() if float32 else logical
                    self.assertEqual(d.attrs["dtype"], "float32" if float32 and x.dtype != torch.float32 else str(x.dtype)[6:], path)
                    np.testing.assert_array_equal(d[()], as_numpy(want), err_msg=path)
                    self.assertEqual(d.attrs["crc32"], f"{zlib.crc32(logical.contiguous().view(torch.uint8).numpy().tobytes()):08x}", path)
                    self.assertEqual(d.attrs["numel"], logical.numel(), path)
                    if is_vocab(n) and rows > c["vocab"]:
                        pad = f["vocab_padding/" + path]
                        np.testing.assert_array_equal(pad[()], as_numpy(x[c["vocab"]:rows].float() if float32 else x[c["vocab"]:rows]))
                    # A reader can slice a chunked dataset without reading all of it.
                    self.assertIsNotNone(d.chunks, path)
            if not weights_only:
                groups = json.loads(f.attrs["param_groups_readable"])
                members = [n for g in groups for n in g["params"]]
                self.assertEqual(sorted(members), sorted(full["params"]))
                for n in full["params"]:
                    self.assertEqual(f[f"optim/{n}"].attrs["group"], next(i for i, g in enumerate(groups) if n in g["params"]))
                    self.assertIn("step", f[f"optim/{n}"].attrs)
            else:
                self.assertNotIn("optim", f)

    def assert_same_files(self, a, b):
        fa, fb = files(a, bookkeeping=False), files(b, bookkeeping=False)
        self.assertEqual(sorted(fa), sorted(fb))
        for rel in fa:
            if fa[rel] is not None and rel != "manifest.json":
                self.assertEqual(fa[rel], fb[rel], f"{rel}: {a} and {b} differ")
        ma, mb = read_json(os.path.join(a, "manifest.json")), read_json(os.path.join(b, "manifest.json"))
        for k in ("files", "tensors", "grid", "model", "step"):
            self.assertEqual(ma[k], mb[k], k)

    def round_trip(self, c, a, b, **kw):
        """Export at a; import at a is the tag itself, import at b is ckpt-reshard a -> b."""
        full, tag = self.tag(c, a, **kw)
        h5 = os.path.join(self.dir, "state.h5")
        self.export(tag, h5)
        master = a.zero1 and full["master"] is not None
        self.assert_export_holds(h5, full, c, a, master)
        same = os.path.join(self.dir, "imported", "same.ckpt")
        r = run(IMPORT, h5, same, *a.args())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_files(same, tag)
        other, want = os.path.join(self.dir, "imported", "other.ckpt"), os.path.join(self.dir, "resharded", "other.ckpt")
        self.assertEqual(run(IMPORT, h5, other, *b.args()).returncode, 0)
        self.assertEqual(reshard(tag, want, *b.args()).returncode, 0)
        self.assert_same_files(other, want)
        return full, tag, h5

    # 1. What h5py reads, and round trips.

    def test_gpt_bf16_zero1_masters_tp2_pp2_dp2_to_tp4_pp3(self):
        self.round_trip(GPT, L(2, 2, 2, True), L(4, 3, 1, True))

    def test_llama_fp32_plain_tp1_to_tp2_pp2(self):
        self.round_trip(LLAMA, L(1, 1), L(2, 2), dtype=torch.float32)

    def test_gqa_padded_vocab_zero1_tp4_to_tp1(self):
        self.round_trip(GQA, L(4, 1, 2, True), L(1, 1, 1, True))

    def test_float32_and_gzip_import_to_the_same_bytes(self):
        full, tag = self.tag(LLAMA, L(2, 1, 2, True))
        wide = os.path.join(self.dir, "wide.h5")
        self.export(tag, wide, "--dtype", "float32", "--compression", "gzip")
        self.assert_export_holds(wide, full, LLAMA, L(2, 1, 2, True), True, float32=True)
        with h5py.File(wide, "r") as f:
            self.assertEqual(f["model/language_model.encoder.final_layernorm.weight"].compression, "gzip")
        back = os.path.join(self.dir, "back.ckpt")
        self.assertEqual(run(IMPORT, wide, back, *L(2, 1, 2, True).args()).returncode, 0)
        self.assert_same_files(back, tag)

    def test_weights_only(self):
        full, tag = self.tag(GPT, L(1, 2))
        h5 = os.path.join(self.dir, "w.h5")
        self.export(tag, h5, "--weights_only")
        self.assert_export_holds(h5, full, GPT, L(1, 2), False, weights_only=True)
        dst = os.path.join(self.dir, "w.ckpt")
        self.assertEqual(run(IMPORT, h5, dst, "--tp", 2, "--pp", 1).returncode, 0)
        self.assertEqual(sorted(os.listdir(dst + "/model")), ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_01_pp_rank_00.pt"])
        self.assertFalse(os.path.exists(dst + "/optim"))
        self.assertEqual(run(IMPORT, h5, os.path.join(self.dir, "w2.ckpt"), "--tp", 2, "--pp", 1).returncode, 0)

    def test_nxd_tag_without_manifest_exports_with_format_flags(self):
        full = make_full(GQA, tp=2)
        src = L(2, 1).write(os.path.join(self.dir, "torch"), full)
        h5 = os.path.join(self.dir, "nxd.h5")
        r = run(EXPORT, src, h5, *format_args(GQA))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_export_holds(h5, full, GQA, L(2, 1), master=False)  # a plain optimizer file holds no masters

    def test_streaming_keeps_memory_within_the_budget(self):
        """A 420 MiB tag exports in 64 MiB and imports in 96 MiB (HDF5's chunk
        caches count); the largest tensor is 8 MiB."""
        c = dict(LLAMA, hidden=512, ffn=1536, heads=8, kv_heads=8, layers=8, vocab=4000)
        full, tag = self.tag(c, L(2, 1, 2, True))
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tag) for f in fs)
        self.assertGreater(size, 400 << 20)
        h5 = os.path.join(self.dir, "big.h5")
        r = run_measured(EXPORT, tag, h5, "--memory_budget", "64M")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertLess(r.peak, 64 << 20, f"export peak {r.peak >> 20} MiB")
        dst = os.path.join(self.dir, "big.ckpt")
        r = run_measured(IMPORT, h5, dst, "--tp", 1, "--pp", 2, "--memory_budget", "96M")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertLess(r.peak, 96 << 20, f"import peak {r.peak >> 20} MiB")
        want = os.path.join(self.dir, "want.ckpt")
        self.assertEqual(reshard(tag, want, "--tp", 1, "--pp", 2).returncode, 0)
        self.assert_same_files(dst, want)

    # 2. Bad input: exit 2, the problem named, nothing under the final name.

    def refused(self, tool, args, pattern, out):
        before = None
        if os.path.exists(out):
            with open(out, "rb") as f:
                before = f.read()
        r = run(tool, *args)
        self.assertEqual(r.returncode, 2, f"stdout {r.stdout!r} stderr {r.stderr!r}")
        self.assertRegex(r.stderr, pattern)
        if before is None:
            self.assertFalse(os.path.exists(out), out)
        else:
            with open(out, "rb") as f:
                self.assertEqual(f.read(), before, "an existing output changed")
        leftovers = [n for n in os.listdir(os.path.dirname(out)) if "partial" in n]
        self.assertEqual(leftovers, [], "a partial output was left")
        return r

    def test_import_refuses_bad_files(self):
        _, tag = self.tag(LLAMA, L(2, 1, 1, True))
        h5 = os.path.join(self.dir, "good.h5")
        self.export(tag, h5)
        dst = os.path.join(self.dir, "out", "dst.ckpt")
        os.makedirs(os.path.dirname(dst))
        target = ["--tp", 1, "--pp", 1]
        # Truncated.
        cut = os.path.join(self.dir, "cut.h5")
        with open(h5, "rb") as f, open(cut, "wb") as g:
            g.write(f.read()[: os.path.getsize(h5) // 2])
        self.refused(IMPORT, [cut, dst, *target], r"cut\.h5", dst)
        # Foreign HDF5.
        foreign = os.path.join(self.dir, "foreign.h5")
        with h5py.File(foreign, "w") as f:
            f["x"] = np.zeros(3)
        self.refused(IMPORT, [foreign, dst, *target], r"foreign\.h5: is not a shardkit full-state export", dst)
        # A dataset missing, one of another shape, one whose data no longer match its fingerprint.
        name = "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight"
        for what, edit, pattern in (
                ("missing", lambda f: f.__delitem__(f"optim/{name}/exp_avg"), rf"/optim/{name}/exp_avg: missing"),
                ("shape", lambda f: (f.__delitem__(f"model/{name}"), f.create_dataset(f"model/{name}", data=np.zeros((3, 3), np.uint16))),
                 rf"/model/{name}: .*shape does not fit"),
                ("data", lambda f: f[f"optim/{name}/exp_avg_sq"].__setitem__((0, 0), 1.0), rf"{name} exp_avg_sq reads with fingerprint")):
            bad = os.path.join(self.dir, f"{what}.h5")
            with open(h5, "rb") as f, open(bad, "wb") as g:
                g.write(f.read())
            with h5py.File(bad, "r+") as f:
                edit(f)
                if what == "shape":
                    f[f"model/{name}"].attrs["dtype"] = "bfloat16"
            self.refused(IMPORT, [bad, dst, *target], pattern, dst)
            for dirpath, _, names in os.walk(os.path.dirname(dst)):
                self.assertNotIn("done", names, dirpath)

    def test_export_refuses_and_keeps_what_exists(self):
        _, tag = self.tag(LLAMA, L(1, 1))
        out = os.path.join(self.dir, "x.h5")
        with open(out, "wb") as f:
            f.write(b"the user's file")
        self.refused(EXPORT, [tag, out], r"x\.h5: exists; pass --overwrite", out)
        self.refused(EXPORT, [tag, out, "--overwrite"], r"--overwrite replaces only what ckpt-export --format h5 wrote", out)
        with open(out, "rb") as f:
            self.assertEqual(f.read(), b"the user's file")
        self.refused(EXPORT, [tag, os.path.join(tag, "inside.h5")], r"(?i)inside|input", os.path.join(tag, "inside.h5"))
        self.export(tag, os.path.join(self.dir, "y.h5"))
        self.export(tag, os.path.join(self.dir, "y.h5"), "--overwrite")  # an export may be replaced
        self.refused(EXPORT, [os.path.join(self.dir, "nothing"), os.path.join(self.dir, "z.h5")], r"nothing: no such folder",
                     os.path.join(self.dir, "z.h5"))


if __name__ == "__main__":
    unittest.main()

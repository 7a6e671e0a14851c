"""Virtual pipeline stages (issue #37): tags laid out as NxD's NxDPPModel lays
them out with virtual_pipeline_size V (pipeline/model.py: the model cut in
pp * V stages by create_partitions, stage s on pp rank s % pp, each rank's
local_state_dict holding its chunks under the global layer names).

Two sources. NxD's own tags (tests/data/upstream/nxd_vpp: NxDPPModel with
pp 2 x virtual_pipeline_size 2, tp 2, dp 2, ZeRO-1 with master weights, plain
and xser, run on CPU) are read, resharded to pp 2 without virtual stages and
to pp 1 with every tensor and moment equal (ckpt-verify --against, and torch
against the fixture's files and full_state.pt), and back to V = 2 with every
rank file holding NxD's keys, ids and tensors; ckpt-export reads them and
ckpt-import --virtual_pipeline_size writes the bytes ckpt-reshard writes. And an NxD tag written with
torch from one full model (nxd_fixture.py, tp 2, dp 2, ZeRO-1 with master
weights), whose virtual-stage layout shardkit writes with
`ckpt-reshard --virtual_pipeline_size 2`; then:
  - each pp rank's files hold exactly the layers of stages p and p + pp, with
    global names, in module order, and the optimizer ids follow that order
    (NxDPPModel.local_named_parameters: chunks in stage order);
  - merged back with torch (nxd_fixture.read_full) every tensor and moment
    equals the model; ckpt-verify says "2 virtual stages";
  - it reshards to pp 2 without virtual stages and to pp 1 with every tensor
    and moment equal (ckpt-verify --against, and torch), and back to V = 2
    byte for byte, in plain .pt and in xser;
  - what cannot be read or written is refused with exit 2, naming the
    virtual pipeline, and leaves no output.
"""
import glob
import json
import os
import shutil
import subprocess
import unittest

import torch

from canon import CONVERT, EXPORT, IMPORT, RESHARD, TempDirTest, VERIFY
from megatron_partition import nxdt_order, rank_file
from nnm_fixture import make_nnm
from nxd_fixture import at_vocab, logical_names, make_full, read_full, write_tag
from upstream_tags import TensorReference, load

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_vpp")
NXD_PT, NXD_XSER = os.path.join(FIXTURE, "nxd_pt", "step_2"), os.path.join(FIXTURE, "nxd_xser", "step_2")
NXD_HINTS = ["--heads", 4]  # NxD writes no model format; vpp_model.py's has 4 heads

LLAMA = dict(gpt=False, hidden=32, ffn=64, heads=4, kv_heads=4, layers=4, vocab=96, divisible=8, seq=16)
GPT = dict(gpt=True, hidden=32, ffn=64, heads=4, kv_heads=4, layers=5, vocab=90, divisible=8, seq=16)
TIED = "language_model.output_layer.weight"


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120)


def format_args(c):
    return ["--heads", c["heads"], "--kv_heads", c["kv_heads"], "--vocab_size", c["vocab"],
            "--make_vocab_size_divisible_by", c["divisible"]]


def virtual_bounds(layers, stages):
    """NxD's create_partitions(stages, layers): an even split, the remainder on the last stages."""
    base, rem = divmod(layers, stages)
    b = [0]
    for s in range(stages):
        b.append(b[-1] + base + (1 if s >= stages - rem else 0))
    return b


def rank_layers(bounds, pp, p):
    """The layers pp rank p holds: stages p, p + pp, ... (partition.py stage_to_pipeline_parallel_rank)."""
    return [l for s in range(p, len(bounds) - 1, pp) for l in range(bounds[s], bounds[s + 1])]


def rank_names(c, bounds, pp, p):
    """What NxDPPModel.local_state_dict() holds on pp rank p: each chunk's parameters
    in stage order, which is module order (the embedding is stage 0's, the final
    norm and output layer the last stage's, GPT's tied output copy last)."""
    mine = set(rank_layers(bounds, pp, p))
    out = []
    for n, l in logical_names(c):
        first, last = "embedding" in n, l < 0 and "embedding" not in n
        if (l >= 0 and l in mine) or (first and p == 0) or (last and p == pp - 1):
            out.append(n)
    if c["gpt"] and p == pp - 1:
        out.append(TIED)
    return out


def rank_files(tag):
    """{relative path: bytes} of every model/ and optim/ file, xser parts included."""
    out = {}
    for path in glob.glob(os.path.join(tag, "model", "**"), recursive=True) + glob.glob(os.path.join(tag, "optim", "**"), recursive=True):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[os.path.relpath(path, tag)] = f.read()
    return out


def load_rank_file(path):
    """A rank file as torch sees it, xser references resolved (X.pt.tensors/tensor_<tid>.pt)."""
    tree = load(path)

    def resolve(x):
        if isinstance(x, TensorReference):
            return load(os.path.join(path + ".tensors", f"tensor_{x.tid}.pt"))
        if isinstance(x, dict):
            return type(x)((k, resolve(v)) for k, v in x.items())
        if isinstance(x, list):
            return [resolve(v) for v in x]
        return x
    return resolve(tree) if os.path.isdir(path + ".tensors") else tree


def name_split_ids(names):
    """NxD's llama example's groups (training_utils.py get_param_groups_by_weight_decay:
    "bias" or "norm" in the name does not decay), ids numbered group by group in file order."""
    apart = [n for n in names if "bias" in n or "norm" in n]
    return [n for n in names if n not in apart] + apart


def by_name(tag, t, dp):
    """{name: (param, [per-dp (exp_avg, exp_avg_sq, master)])} over every pp rank of tp rank t."""
    out = {}
    for path in sorted(glob.glob(os.path.join(tag, "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_??.pt"))):
        model = load_rank_file(path)
        names = name_split_ids(list(model))
        shards = [load_rank_file(os.path.join(tag, "optim", os.path.basename(path).replace("dp_rank_00", f"dp_rank_{d:02d}")))
                  for d in range(dp)]
        for i, n in enumerate(names):
            out[n] = (model[n], [(s["base_state"][i]["exp_avg"], s["base_state"][i]["exp_avg_sq"], s["sharded_master_weights"][i])
                                 for s in shards])
    return out


def stages_of(tag):
    with open(os.path.join(tag, "manifest.json")) as f:
        return json.load(f)["layout"]["stages"]


class VirtualPipelineTags(TempDirTest):
    def setUp(self):
        super().setUp()
        for b in (RESHARD, VERIFY, CONVERT, EXPORT, IMPORT):
            self.assertTrue(os.path.exists(b), f"{b} is not built")  # a missing binary fails, never skips

    def reshard(self, src, name, *args, ok=True):
        dst = os.path.join(self.dir, name)
        r = run(RESHARD, src, dst, *args)
        if ok:
            self.assertEqual(r.returncode, 0, r.stderr)
        return dst, r

    def source(self, c):
        full = make_full(c, tp=2)
        parent = os.path.join(self.dir, "nxd")
        os.makedirs(parent, exist_ok=True)
        return full, write_tag(parent, full, tp=2, pp=1, dp=2, zero1=True)

    def assert_holds(self, tag, full, c, tp):
        back, want = read_full(tag, c), at_vocab(full, tp)
        self.assertEqual(sorted(back["params"]), sorted(want["params"]))  # merged in file order: chunk by chunk
        for k in ("params", "exp_avg", "exp_avg_sq", "master"):
            for n, x in want[k].items():
                self.assertTrue(torch.equal(back[k][n], x) and back[k][n].dtype == x.dtype, f"{tag}: {k} {n}")

    def assert_virtual_layout(self, tag, c, pp, v):
        bounds = virtual_bounds(c["layers"], pp * v)
        self.assertEqual(stages_of(tag), [[[bounds[s], bounds[s + 1]] for s in range(p, pp * v, pp)] for p in range(pp)])
        for p in range(pp):
            want = rank_names(c, bounds, pp, p)
            for t in range(2):
                model = load_rank_file(os.path.join(tag, "model", rank_file(t, p)))
                self.assertEqual(list(model), want, f"pp rank {p}")
                # Optimizer ids: NxDT's groups over the rank's parameters in that order.
                order = nxdt_order([n for n in want if n != TIED or pp > 1], False)
                osd = load_rank_file(os.path.join(tag, "optim", rank_file(t, p, 0)))
                self.assertEqual([i for g in osd["param_groups"] for i in g["params"]], list(range(len(order))))
                for i, (n, _) in enumerate(order):
                    self.assertEqual(list(osd["shape_info"][i]), list(model[n].shape), f"pp rank {p} id {i} ({n})")

    def roundtrip(self, c, xser):
        full, src = self.source(c)
        container = ["--save_xser"] if xser else ["--no_save_xser"]
        grid = ["--tp", 2, "--dp", 2, "--zero1"]
        vtag, r = self.reshard(src, "v2", *grid, "--pp", 2, "--virtual_pipeline_size", 2, *container, *format_args(c))
        self.assertIn("(2 virtual stages per pp rank)", r.stderr)
        self.assert_virtual_layout(vtag, c, 2, 2)
        if not xser:
            self.assert_holds(vtag, full, c, 2)
        v = run(VERIFY, vtag)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertIn("(tp=2 pp=2 dp=2 zero1, 2 virtual stages)", v.stdout)
        # Without virtual stages, and at pp 1: every tensor and moment equal.
        plain, _ = self.reshard(vtag, "pp2", *grid, "--pp", 2, "--virtual_pipeline_size", 1)
        self.assertEqual(stages_of(plain), [[[0, c["layers"] // 2]], [[c["layers"] // 2, c["layers"]]]])
        one, _ = self.reshard(vtag, "pp1", "--tp", 1, "--pp", 1, "--dp", 1, "--zero1")
        for tag in (plain, one):
            a = run(VERIFY, tag, "--against", vtag)
            self.assertEqual(a.returncode, 0, a.stdout + a.stderr)
        if not xser:
            self.assert_holds(plain, full, c, 2)
            self.assert_holds(one, full, c, 1)
        # Back to V = 2 from pp 1: the same bytes in every rank file.
        back, _ = self.reshard(one, "back", *grid, "--pp", 2, "--virtual_pipeline_size", 2)
        got, want = rank_files(back), rank_files(vtag)
        self.assertEqual(sorted(got), sorted(want))
        for rel in want:
            self.assertEqual(got[rel], want[rel], f"{rel} differs from the source's")
        # The layout kept (same pp, no cuts): V is the source's.
        kept, _ = self.reshard(vtag, "kept", "--tp", 1, "--pp", 2)
        self.assertEqual(stages_of(kept), stages_of(vtag))

    def assert_same_tensors(self, what, got, want):
        self.assertEqual((got.dtype, got.shape), (want.dtype, want.shape), what)
        self.assertTrue(torch.equal(got, want), what)

    def nxd_fixture(self, tag, container):
        v = run(VERIFY, tag)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertIn("(tp=2 pp=2 dp=2 zero1, 2 virtual stages)", v.stdout)
        grid = ["--tp", 2, "--dp", 2, "--zero1"]
        plain, _ = self.reshard(tag, "pp2", *grid, "--pp", 2, *NXD_HINTS, "--virtual_pipeline_size", 1, container)
        self.assertEqual(stages_of(plain), [[[0, 4]], [[4, 8]]])
        one, _ = self.reshard(tag, "pp1", "--tp", 1, "--pp", 1, "--dp", 1, "--zero1", *NXD_HINTS, "--no_save_xser")
        for out in (plain, one):
            a = run(VERIFY, out, "--against", tag, *NXD_HINTS)
            self.assertEqual(a.returncode, 0, a.stdout + a.stderr)
        # By torch: pp 2 without virtual stages holds NxD's tensors and moments, name by name, on each tp rank.
        for t in range(2):
            got, want = by_name(plain, t, 2), by_name(tag, t, 2)
            self.assertEqual(sorted(got), sorted(want))
            for n, (x, shards) in want.items():
                self.assert_same_tensors(f"tp {t} {n}", got[n][0], x)
                for d, fields in enumerate(shards):
                    for j, k in enumerate(("exp_avg", "exp_avg_sq", "master")):
                        self.assert_same_tensors(f"tp {t} dp {d} {n} {k}", got[n][1][d][j], fields[j])
        # pp 1, tp 1: the tensors NxD gathers by plain concatenation equal the full state's.
        full, merged = torch.load(os.path.join(FIXTURE, "full_state.pt")), by_name(one, 0, 1)
        checked = 0
        for n, (x, [(m1, m2, master)]) in merged.items():
            if "qkv" in n or "gate_up" in n:
                continue  # their tp shards are blocks of rows, not one concatenation (README)
            self.assert_same_tensors(n, x, full[f"model/{n}"])
            self.assert_same_tensors(n + " exp_avg", m1, full[f"optim/exp_avg/{n}"])
            self.assert_same_tensors(n + " exp_avg_sq", m2, full[f"optim/exp_avg_sq/{n}"])
            self.assert_same_tensors(n + " master", master, full[f"optim/master/{n}"])
            checked += 1
        self.assertEqual(checked, 1 + 8 * 4 + 2)  # embedding, per layer o/down/two norms, final norm, lm_head
        # Back to V = 2 from pp 1: NxD's files, key for key, id for id, tensor for tensor.
        back, _ = self.reshard(one, "back", *grid, "--pp", 2, "--virtual_pipeline_size", 2, container)
        for kind in ("model", "optim"):
            for path in sorted(glob.glob(os.path.join(tag, kind, "*.pt"))):
                got, want = load_rank_file(os.path.join(back, kind, os.path.basename(path))), load_rank_file(path)
                self.assert_same_tree(os.path.basename(path), got, want)
        # ckpt-export reads it, and ckpt-import --virtual_pipeline_size (the same planner) writes what ckpt-reshard wrote.
        h5, imported = os.path.join(self.dir, "state.h5"), os.path.join(self.dir, "imported")
        for args in ([EXPORT, tag, h5, *NXD_HINTS], [IMPORT, h5, imported, *grid, "--pp", 2, "--virtual_pipeline_size", 2, container]):
            r = run(*args)
            self.assertEqual(r.returncode, 0, r.stderr)
        got, want = rank_files(imported), rank_files(back)
        self.assertEqual(sorted(got), sorted(want))
        for rel in want:
            self.assertEqual(got[rel], want[rel], f"{rel}: ckpt-import wrote other bytes than ckpt-reshard")

    def assert_same_tree(self, what, got, want):
        if isinstance(want, torch.Tensor):
            self.assert_same_tensors(what, got, want)
        elif isinstance(want, dict):
            self.assertEqual(list(got), list(want), what)
            for k in want:
                self.assert_same_tree(f"{what}[{k!r}]", got[k], want[k])
        elif isinstance(want, (list, tuple)):
            self.assertEqual(len(got), len(want), what)
            for i, (g, w) in enumerate(zip(got, want)):
                self.assert_same_tree(f"{what}[{i}]", g, w)
        else:
            self.assertEqual(got, want, what)

    def test_nxd_fixture_plain_pt(self):
        self.nxd_fixture(NXD_PT, "--no_save_xser")

    def test_nxd_fixture_xser(self):
        self.nxd_fixture(NXD_XSER, "--save_xser")

    def test_llama_plain_pt(self):
        self.roundtrip(LLAMA, xser=False)

    def test_gpt_tied_embedding_xser(self):
        self.roundtrip(GPT, xser=True)

    def test_gpt_tied_embedding_plain_pt(self):
        self.roundtrip(GPT, xser=False)

    def test_refusals_name_the_virtual_pipeline(self):
        full, src = self.source(LLAMA)
        # A V leaving a stage without a layer: 4 layers do not make pp 2 x 3 stages.
        dst, r = self.reshard(src, "bad", "--tp", 1, "--pp", 2, "--virtual_pipeline_size", 3, *format_args(LLAMA), ok=False)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("virtual_pipeline_size 3 at pp 2 cuts the 4 layers in 6 virtual pipeline stages", r.stderr)
        self.assertFalse(os.path.exists(dst))
        vtag, _ = self.reshard(src, "v2", "--tp", 1, "--pp", 2, "--virtual_pipeline_size", 2, *format_args(LLAMA))
        # A manifest whose stage map contradicts the layer names.
        lying = os.path.join(self.dir, "lying")
        shutil.copytree(vtag, lying)
        with open(os.path.join(lying, "manifest.json")) as f:
            m = json.load(f)
        m["layout"]["stages"] = [[[0, 2]], [[2, 4]]]
        with open(os.path.join(lying, "manifest.json"), "w") as f:
            json.dump(m, f)
        dst, r = self.reshard(lying, "from_lying", "--tp", 1, "--pp", 1, ok=False)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("manifest.json: 'layout' 'stages' records layers 0..1 for pp rank 0", r.stderr)
        self.assertIn("holds layers 0..0, 2..2", r.stderr)
        self.assertFalse(os.path.exists(dst))
        # Layers that are neither consecutive stages nor virtual ones (layer 3 moved to pp rank 0), model/ alone.
        moved = os.path.join(self.dir, "moved")
        os.makedirs(os.path.join(moved, "model"))
        m0, m1 = (torch.load(os.path.join(vtag, "model", rank_file(0, p))) for p in (0, 1))
        for k in [k for k in m1 if ".layers.3." in k]:
            m0[k] = m1.pop(k)
        torch.save(m0, os.path.join(moved, "model", rank_file(0, 0)))
        torch.save(m1, os.path.join(moved, "model", rank_file(0, 1)))
        dst, r = self.reshard(moved, "from_moved", "--tp", 1, "--pp", 1, *format_args(LLAMA), ok=False)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("its pp ranks hold layers pp rank 0: 0..0, 2..3; pp rank 1: 1..1, which are neither consecutive stages "
                      "nor NxD's virtual pipeline stages", r.stderr)
        self.assertFalse(os.path.exists(dst))

    def test_nnm_chunks_as_nnm_saves_them_are_refused_naming_the_virtual_pipeline(self):
        """NNM's on_save_checkpoint (megatron_gpt_model.py, f4743ce) saves chunk i as
        checkpoint['model{i}'] = state_dict_for_save_checkpoint(), nested dicts."""
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        c = dict(hidden=16, ffn=24, heads=4, kv_heads=4, layers=4, vocab=32, seq=8, gpt=False)
        make_nnm(nnm, c, tp=1, pp=2, vpp=2)
        for path in glob.glob(os.path.join(nnm, "*", "*.ckpt")):
            ck = torch.load(path)
            for v in range(2):
                ck[f"model{v}"] = {"language_model": {"encoder": {k.removeprefix("language_model.encoder."): x
                                                                  for k, x in ck[f"model{v}"].items()}}}
            ck["state_dict"] = {}  # the LightningModule's own, empty: its model is a list of chunks
            torch.save(ck, path)
        r = run(CONVERT, "--tp", 1, "--pp", 2, "--n_layers", 4, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("'model0' is a virtual pipeline model chunk (NNM's virtual_pipeline_model_parallel_size) saved as "
                      "nested dicts ('language_model': {...}", r.stderr)
        self.assertNotIn("holds no decoder layer", r.stderr)
        self.assertFalse(os.path.exists(out))

    def test_nnm_flat_chunks_convert_to_a_tag_every_command_reads(self):
        """Chunks as flat state dicts (what nnm2nxdt-ckpt already converted) give NxD's
        virtual-stage layout, which ckpt-verify and ckpt-reshard now read."""
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        c = dict(hidden=16, ffn=24, heads=4, kv_heads=4, layers=4, vocab=32, seq=8, gpt=False)
        make_nnm(nnm, c, tp=1, pp=2, vpp=2)
        r = run(CONVERT, "--tp", 1, "--pp", 2, "--n_layers", 4, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(stages_of(out), [[[0, 1], [2, 3]], [[1, 2], [3, 4]]])
        v = run(VERIFY, out)
        self.assertIn("2 virtual stages", v.stdout)
        one, _ = self.reshard(out, "pp1", "--tp", 1, "--pp", 1)
        a = run(VERIFY, one, "--against", out)
        self.assertEqual(a.returncode, 0, a.stdout + a.stderr)


if __name__ == "__main__":
    unittest.main()

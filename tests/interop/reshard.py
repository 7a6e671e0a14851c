"""ckpt-reshard against torch: NxD tags written by torch from one full model
(nxd_fixture.py) are resharded, and every file of the output, read back with
torch.load, is compared with what torch writes directly at the target layout
from the same model; the output is also merged back to the full model on its
own (nxd_fixture.read_full) and compared with it. Round trips are byte-stable,
bad input is refused without a complete-looking output, a SIGKILLed run
leaves no `done` and the source untouched, --dry_run writes nothing.

What a target layout must hold follows from the source model alone (see
nxd_fixture's docstring for the NxD sources): tensor-parallel slices by
Megatron's partition (KV groups replicated when kv_heads < tp), the vocab
padded for the target tp (rows past the source's padding zero, rows past the
target's dropped), the pipeline split evenly with the remainder last or at
--pipeline_cuts, AdamW ids in NxDT's order, ZeRO-1 shards of the target dp,
scheduler.pt and user_content.pt as they were."""
import collections
import hashlib
import json
import os
import re
import signal
import subprocess
import time
import unittest
import zlib

import torch

from canon import BIN, RESHARD, TempDirTest, VERIFY
from megatron_partition import nxdt_order, rank_file
from nxd_fixture import at_vocab, is_vocab, make_full, read_full, stage_bounds, write_tag


LLAMA = dict(gpt=False, hidden=32, ffn=64, heads=4, kv_heads=4, layers=4, vocab=96, divisible=8, seq=16)
GQA = dict(LLAMA, hidden=64, heads=8, kv_heads=2, layers=3, vocab=100)  # KV groups replicated at tp 4 and 8
PADDED = dict(LLAMA, vocab=100)  # padded to 104 at tp 1, 112 at tp 2, 128 at tp 4
GPT = dict(gpt=True, hidden=32, ffn=64, heads=4, kv_heads=4, layers=5, vocab=90, divisible=8, seq=16)
BIG = dict(gpt=False, hidden=256, ffn=512, heads=8, kv_heads=8, layers=8, vocab=1000, divisible=8, seq=16)


class L(collections.namedtuple("L", "tp pp dp zero1 cuts", defaults=(1, 1, 1, False, None))):
    """A layout: degrees, ZeRO-1, explicit pipeline cuts."""

    def args(self):
        a = ["--tp", self.tp, "--pp", self.pp, "--dp", self.dp, "--zero1" if self.zero1 else "--no-zero1"]
        if self.cuts:
            a += ["--pipeline_cuts", ",".join(map(str, self.cuts))]
        return a

    def write(self, parent, full, **kw):
        return write_tag(parent, full, self.tp, self.pp, self.dp, self.zero1, self.cuts, **kw)


def format_args(c):
    return ["--heads", c["heads"], "--kv_heads", c["kv_heads"], "--vocab_size", c["vocab"],
            "--make_vocab_size_divisible_by", c["divisible"]]


def reshard(*args, timeout=120):
    return subprocess.run([RESHARD, *map(str, args)], capture_output=True, text=True, timeout=timeout)


# Runs a command in a fork of a small Python and prints its own peak RSS: a
# process started straight from this one (fork or vfork, then exec) inherits
# this process's resident size as its ru_maxrss, torch and tensors included.
_MEASURE = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write("\\npeak-rss-kib %d\\n" % usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(*args):
    """subprocess.run with .peak: the command's peak resident memory in bytes."""
    p = subprocess.run(["/usr/bin/python3", "-S", "-c", _MEASURE, *map(str, args)], capture_output=True, text=True)
    m = re.search(r"\npeak-rss-kib (\d+)\n$", p.stderr)
    p.peak = int(m.group(1)) * 1024
    p.stderr = p.stderr[:m.start()]
    return p


def files(root, bookkeeping=True):
    """Relative path -> bytes of every file under root (folders as None);
    without `bookkeeping`, leaving out the store's .shardkit/ records of the
    save (they name the save that wrote them)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if not bookkeeping and dirpath == root and ".shardkit" in dirnames:
            dirnames.remove(".shardkit")
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def read_json(path):
    with open(path) as f:
        return json.load(f)


def manifest_tensors(tag):
    return read_json(os.path.join(tag, "manifest.json"))["tensors"]


def tree_hash(root):
    return {k: None if v is None else hashlib.sha256(v).hexdigest() for k, v in files(root).items()}


def first_difference(got, want):
    diff = (got != want)
    if got.dtype.is_floating_point:
        diff &= ~(torch.isnan(got) & torch.isnan(want))
    idx = diff.nonzero()
    if len(idx) == 0:
        return None
    i = tuple(idx[0].tolist())
    return f"first differing index {i}: got {got[i].item()!r}, want {want[i].item()!r} ({len(idx)} elements differ)"


class Reshard(TempDirTest):
    def setUp(self):
        super().setUp()
        # A missing binary is a failure, never a skip: a wrong SHARDKIT_BIN must not pass.
        self.assertTrue(os.path.exists(RESHARD), f"{RESHARD} is not built")
        self.out = os.path.join(self.dir, "out")
        os.makedirs(self.out)

    # Comparisons.

    def assert_same(self, what, got, want):
        """Equal as torch.load returns them: types, key order, tensors with dtype and shape."""
        self.assertIs(type(got), type(want), f"{what}: type {type(got).__name__}, want {type(want).__name__}")
        if isinstance(want, torch.Tensor):
            self.assertEqual(got.dtype, want.dtype, what)
            self.assertEqual(got.shape, want.shape, what)
            self.assertTrue(torch.equal(got, want), f"{what}: {first_difference(got, want)}")
        elif isinstance(want, dict):
            self.assertEqual(list(got), list(want), f"{what}: keys")
            for k in want:
                self.assert_same(f"{what}[{k!r}]", got[k], want[k])
        elif isinstance(want, (list, tuple)) and not isinstance(want, torch.Size):
            self.assertEqual(len(got), len(want), f"{what}: length")
            for i, (g, w) in enumerate(zip(got, want)):
                self.assert_same(f"{what}[{i}]", g, w)
        else:
            self.assertEqual(got, want, what)

    def assert_same_tag(self, got, want):
        """Every file of `want` (torch's own writing) is in `got` with equal content;
        `got` has nothing else but manifest.json (and the store's .shardkit/)."""
        g, w = files(got, bookkeeping=False), files(want)
        self.assertEqual(sorted(set(g) - {"manifest.json"}), sorted(w), f"{got}: files")
        for rel, data in w.items():
            if data is None:
                continue
            if rel.endswith(".pt"):
                self.assert_same(rel, torch.load(os.path.join(got, rel)), torch.load(os.path.join(want, rel)))
            else:
                self.assertEqual(g[rel], data, rel)

    def assert_manifest(self, tag, layout):
        with open(os.path.join(tag, "manifest.json")) as f:
            grid = json.load(f)["grid"]
        self.assertEqual({k: grid.get(k) for k in ("tp", "pp", "dp", "zero1")},
                         {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero1": layout.zero1})

    def assert_holds(self, tag, full, c, layout, master):
        """Merged back on its own, the tag is `full` at the layout's vocab padding."""
        back = read_full(tag, c)
        want = at_vocab(full, layout.tp)
        self.assertEqual(back["grid"], (layout.tp, layout.pp, layout.dp, layout.zero1))
        self.assertEqual(back["bounds"], stage_bounds(c["layers"], layout.pp, layout.cuts))
        self.assertEqual(back["steps"], {float(full["step"])})
        self.assertEqual(list(back["params"]), list(want["params"]))
        for k in ("params", "exp_avg", "exp_avg_sq") + (("master",) if master else ()):
            for n, x in want[k].items():
                self.assert_same(f"merged {k} {n}", back[k][n], x)
        if not master:
            self.assertIsNone(back["master"])

    def assert_fingerprints(self, tag, full, c, master):
        """The manifest's layout-free fingerprints are zlib's CRC-32 of each full
        tensor's bytes (vocab rows up to the real vocabulary), computed here
        from the model, and ckpt-verify --fingerprints finds them true."""
        got, want = manifest_tensors(tag), {}
        for k, field in (("params", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("master", "master")):
            if full[k] is None or (k == "master" and not master):
                continue
            for n, x in full[k].items():
                if is_vocab(n):
                    x = x[:c["vocab"]]
                data = x.contiguous().view(torch.uint8).numpy().tobytes()
                want.setdefault(n, {})[field] = {"dtype": str(x.dtype).removeprefix("torch."), "numel": x.numel(),
                                                 "crc32": f"{zlib.crc32(data):08x}"}
        self.assertEqual(sorted(got), sorted(want))
        for n in want:
            self.assertEqual(got[n], want[n], n)
        v = subprocess.run([VERIFY, tag, "--fingerprints"], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    # Running.

    def source(self, c, layout, full=None, name="src", style="nxdt", naming="nxdt", **kw):
        full = full or make_full(c, tp=layout.tp, **kw)
        parent = os.path.join(self.dir, name)
        os.makedirs(parent, exist_ok=True)
        return full, layout.write(parent, full, style=style, naming=naming)

    def check(self, c, a, b, style="nxdt", **kw):
        """Writes the model at layout a with torch, reshards it to b and checks
        the output against torch's writing at b and against the model."""
        full, src = self.source(c, a, style=style, **kw)
        before = tree_hash(src)
        dst = os.path.join(self.out, os.path.basename(src))
        r = reshard(src, dst, *b.args(), *format_args(c))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(tree_hash(src), before, "the source changed")
        master = a.zero1 and b.zero1 and full["master"] is not None
        want = b.write(os.path.join(self.dir, "want"), full, master=master, style=style)
        self.assert_same_tag(dst, want)
        self.assert_manifest(dst, b)
        self.assert_holds(dst, full, c, b, master)
        self.assert_fingerprints(dst, full, c, master)
        return full, dst

    # 1. Against torch.

    def test_llama_mha_tp1_pp1_to_tp2_pp2(self):
        self.check(LLAMA, L(1, 1), L(2, 2))

    def test_llama_mha_tp2_pp2_to_tp4_pp1(self):
        self.check(LLAMA, L(2, 2), L(4, 1))

    def test_llama_mha_tp4_to_tp1_pp3_uneven(self):
        self.check(LLAMA, L(4, 1), L(1, 3))  # 4 layers: 1, 1, 2

    def test_llama_gqa_kv_replicated_tp2_to_tp4_pp2(self):
        self.check(GQA, L(2, 1), L(4, 2))  # 2 KV groups on 4 ranks: each on 2

    def test_llama_gqa_kv_replicated_tp4_to_tp8(self):
        self.check(GQA, L(4, 1), L(8, 1))

    def test_llama_gqa_kv_replicated_tp8_pp3_to_tp1(self):
        self.check(GQA, L(8, 3), L(1, 1))

    def test_vocab_padding_grows_tp1_to_tp4(self):
        self.check(PADDED, L(1, 1), L(4, 2))  # 104 rows -> 128: 24 zero rows

    def test_vocab_padding_shrinks_tp4_to_tp2(self):
        self.check(PADDED, L(4, 1), L(2, 1))  # 128 rows -> 112: 16 rows dropped

    def test_gpt_tied_embedding_pp1_to_pp2(self):
        self.check(GPT, L(1, 1), L(2, 2))  # 5 layers: 2, 3; the last stage gains word_embeddings.weight

    def test_gpt_pp2_to_pp3_uneven(self):
        self.check(GPT, L(2, 2), L(1, 3))  # 1, 2, 2

    def test_gpt_pp3_to_pp1_drops_the_tied_copy(self):
        self.check(GPT, L(2, 3), L(4, 1))

    def test_gpt_megatron_lm_naming_is_read_and_written_as_nxdt_names_it(self):
        """Megatron-LM's (NNM's, shardkit's before) tied copy, word_embeddings.weight on the last stage of a
        pipeline and nothing at pp = 1, re-laid as NxDT writes it: language_model.output_layer.weight on the
        last stage, pp = 1 included, with its own optimizer slot."""
        for a, b in ((L(2, 2), L(1, 1)), (L(1, 1), L(2, 2)), (L(1, 1, 2, True), L(1, 1, 2, True))):
            with self.subTest(a=a, b=b):
                full, src = self.source(GPT, a, name=f"legacy_{a.tp}{a.pp}{a.dp}", naming="megatron-lm")
                names = list(torch.load(os.path.join(src, "model", f"dp_rank_00_tp_rank_00_pp_rank_0{a.pp - 1}.pt")))
                self.assertNotIn("language_model.output_layer.weight", names)
                dst = os.path.join(self.out, f"legacy_{a.tp}{a.pp}{a.dp}")
                r = reshard(src, dst, *b.args(), *format_args(GPT))
                self.assertEqual(r.returncode, 0, r.stderr)
                want = b.write(os.path.join(self.dir, f"want_{a.tp}{a.pp}{a.dp}"), full, master=a.zero1 and b.zero1)
                self.assert_same_tag(dst, want)
                last = torch.load(os.path.join(dst, "model", f"dp_rank_00_tp_rank_00_pp_rank_0{b.pp - 1}.pt"))
                self.assertEqual(list(last)[-1], "language_model.output_layer.weight")

    def test_gpt_output_layer_unlike_the_embedding_is_kept_as_an_untied_one(self):
        """Without a manifest, an output layer equal to the embedding is NxDT's tied copy; one that
        differs is an untied model's, and is carried, not replaced by the embedding."""
        full, src = self.source(GPT, L(1, 1, 1, True), master=None)
        path = os.path.join(src, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt")
        model = torch.load(path)
        out = model["language_model.output_layer.weight"] = model["language_model.output_layer.weight"].clone()
        out[3, 1] += 1
        torch.save(model, path)
        dst = os.path.join(self.out, "dst")
        r = reshard(src, dst, *L(1, 1, 1, True).args(), *format_args(GPT), "--weights_only")
        self.assertEqual(r.returncode, 0, r.stderr)
        got = torch.load(os.path.join(dst, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        self.assertTrue(torch.equal(got["language_model.output_layer.weight"], out))
        self.assertFalse(torch.equal(got["language_model.output_layer.weight"], got["language_model.embedding.word_embeddings.weight"]))
        with open(os.path.join(dst, "manifest.json")) as f:
            self.assertFalse(json.load(f)["model"]["share_embeddings_and_output_weights"])

    def test_gpt_tied_copy_that_differs_from_the_embedding_is_refused(self):
        """A tag whose manifest records tied embeddings holds the output layer as a copy; one that
        differs would be lost when the copy is read from the embedding, so it is refused."""
        _, src = self.source(GPT, L(1, 1))
        ours = os.path.join(self.out, "ours")
        r = reshard(src, ours, *L(1, 1).args(), *format_args(GPT))
        self.assertEqual(r.returncode, 0, r.stderr)
        rel = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
        model = torch.load(os.path.join(ours, rel))
        model["language_model.output_layer.weight"] = model["language_model.output_layer.weight"].clone()
        model["language_model.output_layer.weight"][3, 1] += 1
        torch.save(model, os.path.join(ours, rel))
        with open(os.path.join(ours, "manifest.json")) as f:
            manifest = json.load(f)
        with open(os.path.join(ours, rel), "rb") as f:
            data = f.read()
        manifest["files"][rel] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        with open(os.path.join(ours, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        self.refused(ours, os.path.join(self.out, "dst"), [*L(2, 1).args()],
                     r"'language_model.output_layer.weight' is GPT's tied output layer .* but it differs from")

    def test_gpt_optimizer_numbered_as_torch_numbers_a_parameter_listed_twice(self):
        """NxDT's GPT at pp = 1 lists the tied weight twice in group 0. torch gives both positions the
        later one's id, so a plain state dict keys the weight's state once, by that id; a ZeRO-1 one
        keys shards by position, and NxD's gradient hook leaves the copy's shard without state and its
        master weight stale (tests/data/upstream/nxdt_megatron). Read as the same state."""
        for layout, to in ((L(1, 1), L(2, 1)), (L(1, 1, 2, True), L(2, 1, 2, True))):
            with self.subTest(layout=layout):
                name = f"torch_ids_{layout.dp}"
                full, src = self.source(GPT, layout, name=name)
                reference = os.path.join(self.out, name + "_ref")
                r = reshard(src, reference, *to.args(), *format_args(GPT))
                self.assertEqual(r.returncode, 0, r.stderr)
                model = torch.load(os.path.join(src, "model", rank_file(0, 0)))
                order = [n for n, _ in nxdt_order(list(model), False)]
                emb, copy = 0, order.index("language_model.output_layer.weight")
                for d in range(layout.dp):
                    path = os.path.join(src, "optim", rank_file(0, 0, d))
                    osd = torch.load(path)
                    ids = osd["param_groups"][0]["params"]
                    self.assertEqual((ids[emb], ids[-1]), (emb, copy))  # ours: one id a position
                    ids[emb] = copy
                    if layout.zero1:
                        del osd["base_state"][copy]
                        osd["sharded_master_weights"][copy] = torch.zeros_like(osd["sharded_master_weights"][copy])  # stale
                    else:
                        del osd["state"][emb]
                    torch.save(osd, path)
                dst = os.path.join(self.out, name)
                r = reshard(src, dst, *to.args(), *format_args(GPT))
                self.assertEqual(r.returncode, 0, r.stderr)
                for rel, data in files(reference, bookkeeping=False).items():
                    if data is not None and rel.endswith(".pt"):
                        self.assert_same(rel, torch.load(os.path.join(dst, rel)), torch.load(os.path.join(reference, rel)))
                # A shared id between two different parameters is refused.
                osd = torch.load(os.path.join(src, "optim", rank_file(0, 0)))
                osd["param_groups"][0]["params"][1] = copy
                torch.save(osd, os.path.join(src, "optim", rank_file(0, 0)))
                self.refused(src, os.path.join(self.out, name + "_bad"), [*to.args(), *format_args(GPT)],
                             r"torch shares an id only between two names of one tied parameter")

    def test_gpt_tied_copy_whose_moments_differ_is_refused(self):
        for layout in (L(1, 1), L(1, 1, 2, True)):
            with self.subTest(layout=layout):
                _, src = self.source(GPT, layout, name=f"moments_{layout.dp}")
                model = torch.load(os.path.join(src, "model", rank_file(0, 0)))
                copy = [n for n, _ in nxdt_order(list(model), False)].index("language_model.output_layer.weight")
                path = os.path.join(src, "optim", rank_file(0, 0, layout.dp - 1))
                osd = torch.load(path)
                st = osd["base_state" if layout.zero1 else "state"][copy]
                st["exp_avg_sq"] = st["exp_avg_sq"] + 1
                torch.save(osd, path)
                self.refused(src, os.path.join(self.out, f"moments_{layout.dp}"), [*L(2, 1, layout.dp, layout.zero1).args(), *format_args(GPT)],
                             r"GPT's tied output layer has an exp_avg_sq that differs from the embedding's")

    def test_gpt_explicit_pipeline_cuts(self):
        self.check(GPT, L(1, 1), L(2, 3, cuts=[1, 4]))  # stages [0], [1, 2, 3], [4]

    def test_gpt_from_explicit_cuts(self):
        self.check(GPT, L(2, 3, cuts=[3, 4]), L(1, 2))

    def test_bf16_zero1_master_dp2_to_zero1_dp1(self):
        self.check(LLAMA, L(2, 2, 2, True), L(1, 1, 1, True))

    def test_bf16_zero1_master_dp1_to_dp2(self):
        self.check(LLAMA, L(1, 1, 1, True), L(2, 2, 2, True))

    def test_bf16_zero1_without_master_dp2_to_plain_dp1(self):
        self.check(LLAMA, L(2, 2, 2, True), L(1, 1, 1, False), master=False)

    def test_refuses_zero1_master_weights_to_plain(self):
        """A plain optimizer file has nowhere for the fp32 master weights: dropping
        them would lose the precision bf16 weights do not carry."""
        _, src = self.source(LLAMA, L(2, 2, 2, True))
        self.refused(src, os.path.join(self.out, "dst"), [*L(1, 1, 1, False).args(), *format_args(LLAMA)], r"master")

    def test_plain_dp1_to_zero1_dp2(self):
        self.check(LLAMA, L(1, 1, 1, False), L(2, 2, 2, True))

    def test_gpt_zero1_master_dp2_tp_pp_change(self):
        self.check(GPT, L(2, 2, 2, True), L(4, 3, 2, True))

    def test_zero1_dp2_to_dp3_pads_shards(self):
        self.check(PADDED, L(2, 1, 2, True), L(1, 2, 3, True))  # rows not a multiple of 3: zero padding

    def test_zero1_dp1(self):
        self.check(GQA, L(1, 1, 1, True), L(4, 1, 2, True))

    def test_fp32_plain(self):
        self.check(LLAMA, L(2, 1), L(1, 2), dtype=torch.float32)

    def test_fp32_zero1_with_master(self):
        self.check(GPT, L(1, 2, 2, True), L(2, 1, 1, True), dtype=torch.float32, master=True)

    def test_one_optimizer_group(self):
        self.check(LLAMA, L(1, 1), L(2, 2), one_group=True)

    def test_nxd_tag_name(self):
        self.check(GQA, L(2, 1, 2, True), L(4, 1, 2, True), style="nxd")

    def test_dp_and_zero1_default_to_the_source(self):
        full, src = self.source(GPT, L(2, 2, 2, True))
        dst = os.path.join(self.out, "dst")
        r = reshard(src, dst, "--tp", 1, "--pp", 1, *format_args(GPT))
        self.assertEqual(r.returncode, 0, r.stderr)
        b = L(1, 1, 2, True)
        self.assert_same_tag(dst, b.write(os.path.join(self.dir, "want"), full, tag="dst"))
        self.assert_manifest(dst, b)

    def test_checkpoint_dir_creates_a_trainer_named_tag(self):
        # NxDT's tag: the name carries step and consumed samples (its user content has no samples).
        full, src = self.source(LLAMA, L(2, 1))
        r = reshard(src, "--checkpoint_dir", self.out, "--tp", 1, "--pp", 2, *format_args(LLAMA))
        self.assertEqual(r.returncode, 0, r.stderr)
        tags = os.listdir(self.out)
        self.assertEqual(tags, ["megatron_llama--step=7-consumed_samples=56.0.ckpt"])
        self.assert_same_tag(os.path.join(self.out, tags[0]), L(1, 2).write(os.path.join(self.dir, "want"), full))
        # NxD's own trainer names tags step_N and records no consumed samples anywhere: 0, and said so.
        _, src = self.source(LLAMA, L(2, 1), name="nxd", style="nxd")
        out = os.path.join(self.dir, "nxd_out")
        r = reshard(src, "--checkpoint_dir", out, "--tp", 1, "--pp", 2, *format_args(LLAMA))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.listdir(out), ["megatron--step=7-consumed_samples=0.0.ckpt"])
        self.assertIn("records no consumed samples", r.stderr)

    # 2. Round trips.

    def round_trip(self, c, a, b):
        """A (torch) -> B -> A' -> B' -> A'': A'' is A' and B' is B, byte for byte.
        Tags after the first carry a manifest, so no format flags."""
        full, src = self.source(c, a)
        tags = [src]
        for i, layout in enumerate([b, a, b, a]):
            dst = os.path.join(self.out, f"hop{i}")
            r = reshard(tags[-1], dst, *layout.args(), *(format_args(c) if i == 0 else []))
            self.assertEqual(r.returncode, 0, f"hop {i}: {r.stderr}")
            tags.append(dst)
        master = a.zero1 and b.zero1 and full["master"] is not None
        self.assert_same_tag(tags[1], b.write(os.path.join(self.dir, "want"), full, master=master, tag="hop0"))
        # The fingerprints are layout-free: every hop records the same ones.
        prints = [manifest_tensors(t) for t in tags[1:]]
        for i, p in enumerate(prints[1:], 1):
            self.assertEqual(p, prints[0], f"hop {i}")
        for x, y in ((tags[1], tags[3]), (tags[2], tags[4])):
            fx, fy = files(x, bookkeeping=False), files(y, bookkeeping=False)
            self.assertEqual(sorted(fx), sorted(fy))
            for rel in fx:
                if fx[rel] is not None:
                    self.assertEqual(fx[rel], fy[rel], f"{rel}: {os.path.basename(x)} and {os.path.basename(y)} differ")

    def test_round_trip_gpt_zero1(self):
        self.round_trip(GPT, L(2, 2, 2, True), L(4, 3, 1, True))

    def test_round_trip_gqa_plain_to_zero1(self):
        self.round_trip(GQA, L(1, 1, 1, False), L(4, 2, 2, True))

    def test_a_wrong_recorded_fingerprint_is_named(self):
        """ckpt-verify --fingerprints recomputes them from the data; --against
        computes them too, checks the recorded ones against them and names the
        manifest that records a wrong one (the data are the same)."""
        _, a = self.check(GQA, L(1, 1), L(2, 1))
        b = os.path.join(self.out, "b")
        self.assertEqual(reshard(a, b, "--tp", 4, "--pp", 2).returncode, 0)
        with open(os.path.join(b, "manifest.json")) as f:
            m = json.load(f)
        name = "language_model.encoder.layers.1.self_attention.key_value.weight"
        crc = m["tensors"][name]["exp_avg"]["crc32"]
        m["tensors"][name]["exp_avg"]["crc32"] = f"{int(crc, 16) ^ 1:08x}"
        with open(os.path.join(b, "manifest.json"), "w") as f:
            json.dump(m, f)
        v = subprocess.run([VERIFY, b, "--fingerprints"], capture_output=True, text=True)
        self.assertEqual(v.returncode, 1, v.stdout + v.stderr)
        self.assertIn(f"the fingerprint of {name} exp_avg is {int(crc, 16) ^ 1:08x}", v.stdout)
        self.assertEqual(v.stdout.count("fingerprint of"), 1, v.stdout)
        v = subprocess.run([VERIFY, a, "--against", b, "--json"], capture_output=True, text=True)
        self.assertEqual(v.returncode, 1, v.stdout + v.stderr)
        d = json.loads(v.stdout)["differences"]
        self.assertEqual(d, [{"tensor": name, "difference": f"exp_avg: {b}'s manifest records another fingerprint than its data have "
                                                              "(files changed or swapped after the manifest was written)"}])

    def test_mpirun_ranks_split_the_files_and_write_what_one_process_writes(self):
        """Under mpirun -np 3 the ranks write their share of the files and rank 0
        commits: the same bytes and fingerprints as one process, the world size recorded."""
        full, src = self.source(GPT, L(2, 2, 2, True))
        one = os.path.join(self.out, "one")
        self.assertEqual(reshard(src, one, "--tp", 4, "--pp", 3, *format_args(GPT)).returncode, 0)
        three = os.path.join(self.out, "three")
        p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "3", RESHARD, src, three,
                            "--tp", "4", "--pp", "3", *map(str, format_args(GPT))],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        fo, ft = files(one, bookkeeping=False), files(three, bookkeeping=False)
        self.assertEqual(sorted(fo), sorted(ft))
        for rel in fo:
            if rel != "manifest.json" and fo[rel] is not None:
                self.assertEqual(fo[rel], ft[rel], rel)
        m1, m3 = (read_json(os.path.join(d, "manifest.json")) for d in (one, three))
        self.assertEqual(m1["files"], m3["files"])
        self.assertEqual(m1["tensors"], m3["tensors"])
        self.assertEqual((m1["world_size"], m3["world_size"]), (1, 3))
        ranks = sorted(os.listdir(os.path.join(three, ".shardkit")))
        self.assertEqual([r for r in ranks if r.startswith("rank_")], [f"rank_{i:05d}.json" for i in range(3)])
        for r in range(3):  # every rank wrote files and the pieces of the fingerprints they hold
            rec = read_json(os.path.join(three, ".shardkit", f"rank_{r:05d}.json"))
            self.assertTrue(rec["files"], r)
            self.assertTrue(rec["extra"], r)
        self.assert_fingerprints(three, full, GPT, True)

    # 3. Refused input: exit 2, the problem named, no `done`, the source untouched.

    def refused(self, src, dst, args, pattern):
        before = tree_hash(src)
        dst_before = tree_hash(dst) if os.path.isdir(dst) else None
        r = reshard(src, dst, *args)
        self.assertEqual(r.returncode, 2, f"stdout {r.stdout!r} stderr {r.stderr!r}")
        self.assertRegex(r.stderr, pattern)
        self.assertEqual(tree_hash(src), before, "the source changed")
        if dst_before is not None:
            self.assertEqual(tree_hash(dst), dst_before, "an existing output changed")
        else:
            for dirpath, _, filenames in os.walk(dst):
                self.assertNotIn("done", filenames, dirpath)
        return r

    def test_refuses_tp_not_dividing_heads(self):
        _, src = self.source(LLAMA, L(1, 1))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 3, "--pp", 1, *format_args(LLAMA)], r"(?i)heads")

    def test_refuses_kv_heads_neither_multiple_nor_divisor_of_tp(self):
        c = dict(LLAMA, hidden=48, heads=6, kv_heads=3)
        _, src = self.source(c, L(1, 1))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 2, "--pp", 1, *format_args(c)], r"(?i)kv")

    def test_refuses_kv_heads_below_tp_not_dividing_it(self):
        c = dict(LLAMA, hidden=48, heads=12, kv_heads=3, ffn=48)  # tp 4: heads and ffn divide, 3 KV groups do not
        _, src = self.source(c, L(1, 1))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 4, "--pp", 1, *format_args(c)], r"(?i)kv")

    def test_refuses_pp_above_layers(self):
        c = dict(LLAMA, layers=2)
        _, src = self.source(c, L(1, 1))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 1, "--pp", 3, *format_args(c)], r"(?i)layers")

    def test_refuses_tp_not_dividing_ffn(self):
        c = dict(LLAMA, ffn=66)
        _, src = self.source(c, L(2, 1))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 4, "--pp", 1, *format_args(c)], r"(?i)ffn")

    def test_refuses_a_missing_model_rank_file(self):
        _, src = self.source(LLAMA, L(2, 2))
        os.remove(os.path.join(src, "model", rank_file(1, 1)))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 1, "--pp", 1, *format_args(LLAMA)], rank_file(1, 1))

    def test_refuses_a_missing_optim_rank_file(self):
        _, src = self.source(LLAMA, L(2, 1, 3, True))
        os.remove(os.path.join(src, "optim", rank_file(1, 0, 1)))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 1, "--pp", 1, *format_args(LLAMA)], rank_file(1, 0, 1))

    def test_refuses_a_memory_budget_below_the_minimum(self):
        _, src = self.source(LLAMA, L(1, 1))
        self.refused(src, os.path.join(self.out, "dst"), ["--tp", 2, "--pp", 1, "--memory_budget", "1K", *format_args(LLAMA)],
                     r"(?i)memory|budget")

    def test_refuses_an_existing_output_without_overwrite(self):
        full, src = self.source(LLAMA, L(1, 1))
        dst = os.path.join(self.out, "dst")
        r = reshard(src, dst, *L(2, 1).args(), *format_args(LLAMA))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.refused(src, dst, [*L(1, 2).args(), *format_args(LLAMA)], r"(?i)exist|overwrite")
        # A user's folder is not replaced either.
        mine = os.path.join(self.out, "mine")
        os.makedirs(mine)
        with open(os.path.join(mine, "notes.txt"), "w") as f:
            f.write("mine")
        self.refused(src, mine, [*L(2, 1).args(), *format_args(LLAMA)], r"(?i)exist|overwrite")
        # With --overwrite the old tag is replaced by the new layout.
        r = reshard(src, dst, *L(1, 2).args(), "--overwrite", *format_args(LLAMA))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_tag(dst, L(1, 2).write(os.path.join(self.dir, "want"), full))

    def test_refuses_an_output_inside_the_source(self):
        _, src = self.source(LLAMA, L(1, 1))
        self.refused(src, os.path.join(src, "model", "dst"), ["--tp", 2, "--pp", 1, *format_args(LLAMA)], r"(?i)inside|input")
        self.refused(src, src, ["--tp", 2, "--pp", 1, "--overwrite", *format_args(LLAMA)], r"(?i)\bis\b.*input|input")

    # 4. SIGKILL.

    def test_sigkill_leaves_no_done_and_the_source_untouched(self):
        full, src = self.source(BIG, L(1, 1, 2, True))
        before = tree_hash(src)
        args = [*L(4, 1, 2, True).args(), *format_args(BIG)]
        t0 = time.time()
        r = reshard(src, os.path.join(self.out, "timing"), *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        took = time.time() - t0
        landed = []
        for i, delay in enumerate([0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, took * 0.5, took * 0.8]):
            parent = os.path.join(self.dir, f"kill{i}")
            os.makedirs(parent)
            dst = os.path.join(parent, "dst")
            p = subprocess.Popen([RESHARD, src, dst, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            running = p.poll() is None
            p.send_signal(signal.SIGKILL)
            p.wait()
            left = os.listdir(parent)
            done = os.path.exists(os.path.join(dst, "done"))
            if running and left and not done:
                landed.append((delay, parent))
            if done:  # it finished: the tag must be complete
                v = subprocess.run([VERIFY, dst], capture_output=True, text=True)
                self.assertEqual(v.returncode, 0, f"delay {delay}: a tag with done fails verification: {v.stdout}{v.stderr}")
            for dirpath, _, filenames in os.walk(parent):
                if "done" in filenames:
                    self.assertEqual(dirpath, dst, f"delay {delay}: a done outside the output")
            self.assertEqual(tree_hash(src), before, f"delay {delay}: the source changed")
            if landed and i >= 3:
                break
        self.assertTrue(landed, f"no kill landed mid-write (a run takes {took:.2f} s)")
        # The run again where a killed one left its partial output: it completes, and only the tag is left.
        parent = landed[-1][1]
        dst = os.path.join(parent, "dst")
        r = reshard(src, dst, *args, *(["--overwrite"] if os.path.exists(dst) else []))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.listdir(parent), ["dst"])
        self.assert_same_tag(dst, L(4, 1, 2, True).write(os.path.join(self.dir, "want"), full, tag="dst"))

    def test_memory_budget_is_kept_and_changes_no_byte(self):
        """The smallest budget the tool accepts (what its refusal of 1K says to
        give, plus 4 MiB) bounds its peak resident memory, and the output is
        the same bytes as with the default budget and thread count."""
        self.check_minimum_budget(BIG, threads=1)

    def test_minimum_budget_with_four_threads_over_a_16_mib_tensor(self):
        """Four writing threads at the smallest budget (plus 4 MiB): each takes a chunk of under 1 MiB,
        so the 16 MiB embedding (8192 x 512 float32) spans more than 16 chunks, written by several threads."""
        wide = dict(gpt=False, hidden=512, ffn=512, heads=8, kv_heads=8, layers=1, vocab=8192, divisible=8, seq=16)
        j = self.check_minimum_budget(wide, threads=4)
        self.assertLessEqual(j["stream_chunk"], 1 << 20)
        self.assertGreater(8192 * 512 * 4 // j["stream_chunk"], 16)

    def check_minimum_budget(self, c, threads):
        _, src = self.source(c, L(1, 1, 2, True))
        args = [*L(4, 1, 2, True).args(), *format_args(c)]
        r = reshard(src, os.path.join(self.out, "default"), *args, "--threads", 1)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = reshard(src, os.path.join(self.out, "tiny"), *args, "--memory_budget", "1K", "--threads", threads)
        self.assertEqual(r.returncode, 2, r.stderr)
        m = re.search(r"give at least ([\d.]+) (KiB|MiB|GiB)", r.stderr)
        self.assertTrue(m, r.stderr)
        budget = int(float(m.group(1)) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]) + (4 << 20)
        dst = os.path.join(self.out, "budget")
        p = run_measured(RESHARD, src, dst, *args, "--memory_budget", f"{budget >> 10}K", "--threads", threads, "--json")
        self.assertEqual(p.returncode, 0, p.stderr)
        tool_says = next((l for l in p.stderr.splitlines() if "peak memory" in l), "")
        self.assertLessEqual(p.peak, budget, f"peak RSS {p.peak / (1 << 20):.1f} MiB over a budget of "
                             f"{budget / (1 << 20):.1f} MiB; the tool says: {tool_says}")
        a, b = files(os.path.join(self.out, "default"), bookkeeping=False), files(dst, bookkeeping=False)
        self.assertEqual(sorted(a), sorted(b))
        for rel in a:
            self.assertEqual(a[rel], b[rel], rel)
        return json.loads(p.stdout)

    # 5. --dry_run and --json.

    def test_dry_run_writes_nothing(self):
        _, src = self.source(GPT, L(2, 2, 2, True))
        before = tree_hash(self.dir)
        for extra in ([], ["--json"]):
            r = reshard(src, os.path.join(self.out, "dst"), *L(1, 3, 2, True).args(), "--dry_run", *extra, *format_args(GPT))
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(tree_hash(self.dir), before, f"--dry_run {extra} wrote")
            # The plan names every file it would write: 3 stages x (a model file and 2 ZeRO-1 optimizer
            # files), and NxDT's user content (NxDT writes no scheduler.pt).
            would = sorted(line.split()[2] for line in r.stderr.splitlines() if line.startswith("would write "))
            self.assertEqual(would, sorted([f"model/{rank_file(0, p)}" for p in range(3)] +
                                           [f"optim/{rank_file(0, p, d)}" for p in range(3) for d in range(2)] + ["user_content.pt"]))
            if extra:
                j = json.loads(r.stdout)
                self.assertEqual(j["dry_run"], True)
                self.assertEqual(j["from"], {"tp": 2, "pp": 2, "dp": 2, "zero1": True, "pipeline_cuts": [2]})  # 5 layers: 2 + 3 (NxD: remainder last)
                self.assertEqual(j["to"], {"tp": 1, "pp": 3, "dp": 2, "zero1": True, "pipeline_cuts": [1, 3]})  # 1 + 2 + 2
                self.assertEqual(j["files"], len(would))
                self.assertEqual((j["model"]["num_layers"], j["model"]["num_attention_heads"], j["model"]["vocab_size"]),
                                 (GPT["layers"], GPT["heads"], GPT["vocab"]))

    def test_json_prints_one_object(self):
        full, src = self.source(LLAMA, L(2, 1))
        dst = os.path.join(self.out, "dst")
        r = reshard(src, dst, *L(1, 2).args(), "--json", *format_args(LLAMA))
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual((j["source"], j["target"], j["dry_run"]), (src, dst, False))
        self.assertEqual(j["from"], {"tp": 2, "pp": 1, "dp": 1, "zero1": False, "pipeline_cuts": []})
        self.assertEqual(j["to"], {"tp": 1, "pp": 2, "dp": 1, "zero1": False, "pipeline_cuts": [2]})
        written = [os.path.join(d, f) for d, _, fs in os.walk(dst) if ".shardkit" not in d for f in fs
                   if f not in ("manifest.json", "done", "checkpoint")]
        self.assertEqual(j["files"], len(written))
        self.assertEqual(j["bytes_written"], sum(os.path.getsize(f) for f in written))
        self.assertEqual(j["bytes_read"], sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs
                                               if d != src))  # the rank files
        self.assertLessEqual(j["peak_rss"], j["memory_budget"])
        self.assert_same_tag(dst, L(1, 2).write(os.path.join(self.dir, "want"), full, tag="dst"))


if __name__ == "__main__":
    unittest.main()

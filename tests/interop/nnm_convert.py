"""nnm2nxdt-ckpt against torch: NNM checkpoints made by torch (nnm_fixture.py)
are converted, and every tensor and value of the NxDT output, read back with
torch.load, is compared with an independent Python statement of the mapping:
global layer names from the layer split the fixture chose, optimizer state
tied to parameters by the identity of the tensors torch's AdamW stepped."""
import copy
import glob
import json
import shutil
import os
import random
import signal
import subprocess
import sys
import time
import unittest

import torch
from omegaconf import OmegaConf

from canon import BIN, CONFIG, CONVERT, RESHARD, TOKENIZE, TRAIN, TempDirTest, VERIFY, run
from megatron_partition import merge_tag, nemo_no_decay, nxdt_order, rank_file
from nnm_fixture import lr_scheduler_state, make_hf_converted, make_nnm
import train_reference

LLAMA = dict(hidden=16, ffn=24, heads=4, kv_heads=4, layers=5, vocab=32, seq=8, gpt=False)


def install_torch_xla_stub(where):
    """torch_xla.utils.serialization.TensorReference, enough for torch.load."""
    pkg = os.path.join(where, "torch_xla", "utils")
    os.makedirs(pkg, exist_ok=True)
    for f in (os.path.join(where, "torch_xla", "__init__.py"), os.path.join(pkg, "__init__.py")):
        open(f, "w").close()
    with open(os.path.join(pkg, "serialization.py"), "w") as f:
        f.write("class TensorReference:\n    pass\n")
    if where not in sys.path:
        sys.path.insert(0, where)


def load(path, xser):
    if not xser:
        return torch.load(path)
    refs = torch.load(path)
    info = torch.load(path + ".info.pt")

    def resolve(x):
        if type(x).__name__ == "TensorReference":
            t = torch.load(os.path.join(path + ".tensors", f"tensor_{x.tid}.pt"))
            assert info[x.tid]["dtype"] == t.dtype and tuple(info[x.tid]["shape"]) == tuple(t.shape), (path, x.tid)
            return t
        if isinstance(x, dict):
            return type(x)((k, resolve(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(resolve(v) for v in x)
        return x

    return resolve(refs)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def keeps_decay(entry):
    """NxDT's do_layer_norm_weight_decay that decays exactly what NNM decayed
    on this rank (False first, as nnm2nxdt-ckpt tries it), or None when
    neither setting does."""
    names = [n for n, _ in entry["model"] if not n.endswith("inv_freq") and n in entry["optim_names"]]
    decayed = {n for n, g in zip(entry["optim_names"], entry["optim_groups"]) if g == 0}
    if decayed == {n for n in names if not nemo_no_decay(n)}:
        return False
    if decayed == set(names):
        return True
    return None


class NnmToNxdt(TempDirTest):
    def setUp(self):
        super().setUp()
        install_torch_xla_stub(os.path.join(self.dir, "stub"))

    def convert(self, *args, check=True):
        return run(CONVERT, *args, check=check)

    def assert_same(self, what, got, want):
        if isinstance(want, torch.Tensor):
            self.assertIsInstance(got, torch.Tensor, what)
            self.assertEqual(got.dtype, want.dtype, what)
            self.assertEqual(got.shape, want.shape, what)
            self.assertTrue(torch.equal(got, want), what)
        elif isinstance(want, dict):
            self.assertEqual(list(got), list(want), what)
            for k in want:
                self.assert_same(f"{what}[{k!r}]", got[k], want[k])
        elif isinstance(want, (list, tuple)):
            self.assertEqual(len(got), len(want), what)
            for i, (g, w) in enumerate(zip(got, want)):
                self.assert_same(f"{what}[{i}]", g, w)
        else:
            self.assertEqual(got, want, what)

    def expected_optimizer(self, entry, one_group):
        """The NxDT state dict of one rank, from the NNM one, by parameter:
        ids renumbered into NxDT's grouping, param_groups taking NNM's
        hyperparameters (a decaying group NNM's first decaying one, a group
        without decay NNM's first with weight_decay 0, or its first group
        with weight_decay 0 when NNM had none)."""
        names = [n for n, _ in entry["model"] if not n.endswith("inv_freq")]
        if one_group:  # module.parameters(): GPT's tied copy (the one name NNM's ids lack) once
            names = [n for n in names if n in entry["optim_names"]]
        order = nxdt_order(names, one_group)
        ids = {n: i for i, (n, _) in enumerate(order)}
        to_nxdt = [ids[n] for n in entry["optim_names"]]
        osd = entry["optimizer"]
        state = {to_nxdt[i]: s for i, s in sorted(osd["state"].items(), key=lambda kv: to_nxdt[kv[0]])}
        # GPT's tied output copy NxDT lists beside the embedding (pp = 1): the embedding's state again.
        for n, i in ids.items():
            if n not in entry["optim_names"]:
                state[i] = state[ids["language_model.embedding.word_embeddings.weight"]]
        state = dict(sorted(state.items()))
        src = osd["param_groups"]
        groups = []
        for g in range(2):
            members = [i for i, (_, gi) in enumerate(order) if gi == g]
            if not members:
                continue
            decays = one_group or any(not nemo_no_decay(order[i][0]) for i in members)
            fits = [s for s in src if (s["weight_decay"] != 0) == decays]
            groups.append(dict(fits[0] if fits else dict(src[0], **({} if decays else {"weight_decay": 0.0})), params=members))
        return to_nxdt, {"state": state, "param_groups": groups}

    def check_tag(self, tag, expected, step=7, consumed=56.0, xser=False, zero1_dp=0, groups="keep"):
        self.assertTrue(os.path.exists(os.path.join(tag, "done")))
        run(VERIFY, tag)
        one_group = False if groups == "nxdt" else keeps_decay(expected[(0, 0)])
        for (t, p), e in expected.items():
            model = load(os.path.join(tag, "model", rank_file(t, p)), xser)
            self.assert_same(f"model {t},{p}", model, dict(e["model"]))
            if not xser:
                torch.load(os.path.join(tag, "model", rank_file(t, p)), weights_only=True)
            to_nxdt, want = self.expected_optimizer(e, one_group)
            if zero1_dp:
                for d in range(zero1_dp):
                    z = load(os.path.join(tag, "optim", rank_file(t, p, d)), xser)
                    src = e["zero1"][d]
                    self.assertEqual(sorted(z), sorted(src))
                    # GPT's tied copy at pp = 1 (the one id NNM's lack): the embedding's entry again.
                    copies = {i: to_nxdt[entry_id] for i in want["state"] if i not in to_nxdt
                              for entry_id, n in enumerate(e["optim_names"]) if n == "language_model.embedding.word_embeddings.weight"}

                    def renumbered(d):
                        out = {to_nxdt[i]: s for i, s in d.items()}
                        out.update({c: out[emb] for c, emb in copies.items()})
                        return dict(sorted(out.items()))
                    self.assert_same("base_state", z["base_state"], renumbered(src["base_state"]))
                    self.assert_same("shape_info", z["shape_info"], renumbered(src["shape_info"]))
                    self.assert_same("param_groups", z["param_groups"], want["param_groups"])
            else:
                self.assert_same(f"optim {t},{p}", load(os.path.join(tag, "optim", rank_file(t, p)), xser), want)
        uc = torch.load(os.path.join(tag, "user_content.pt"))
        self.assertEqual((uc["global_step"], uc["consumed_samples"], uc["epoch"]), (step, consumed, 0))
        self.assertEqual(torch.load(os.path.join(tag, "scheduler.pt")), lr_scheduler_state(step, 1e-3, 2, 0, 100, 1e-4))
        manifest = read_json(os.path.join(tag, "manifest.json"))
        self.assertEqual(manifest["step"], step)

    def roundtrip(self, c, tp, pp, *flags, xser_in=False, xser_out=False, zero1_dp=0, vpp=1, grouping="class", groups="keep"):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        expected, _ = make_nnm(nnm, c, tp=tp, pp=pp, vpp=vpp, zero1_dp=zero1_dp, xser=xser_in, grouping=grouping)
        p = self.convert("--tp", tp, "--pp", pp, "--n_layers", c["layers"], "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out,
                         *(["--save_xser"] if xser_out else []), "--optimizer_groups", groups, *flags)
        self.check_tag(out, expected, xser=xser_out, zero1_dp=zero1_dp, groups=groups)
        return out, p.stderr

    def test_tp2_pp2_with_an_uneven_layer_split(self):
        # 5 layers over 2 stages (2 + 3): NNM writes that only with
        # flexible_pipeline_parallel_stages, which the fixture records.
        _, err = self.roundtrip(LLAMA, 2, 2)
        # NNM's Llama (FastRMSNorm outside apex.normalization's classes): norms decay, group 1 empty;
        # NxDT's (NeMo's rule over NxD's RMSNorm, no biases): one group, the same decay.
        self.assertIn("optimizer grouping found: nnm-rmsnorm", err)
        self.assertIn("optimizer grouping written: nxdt-biases-apart", err)
        self.assertIn("model.do_layer_norm_weight_decay: False", err)
        self.assertNotIn("decaying", err)

    def test_llama_grouped_as_nxdt_on_request_is_what_keep_writes(self):
        out, err = self.roundtrip(dict(LLAMA, layers=2), 2, 2, groups="nxdt")
        self.assertIn("optimizer grouping written: nxdt-biases-apart", err)
        self.assertNotIn("decaying", err)  # NNM's Llama and NxDT's decay the same parameters
        groups = torch.load(os.path.join(out, "optim", rank_file(0, 1)))["param_groups"]
        self.assertEqual([g["weight_decay"] for g in groups], [0.1])
        self.assertEqual(read_json(os.path.join(out, "manifest.json"))["optimizer_grouping"], "nxdt")

    def test_name_based_grouping_of_other_nemo_versions(self):
        nnm = os.path.join(self.dir, "nnm")
        make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=1, grouping="name")
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", os.path.join(self.dir, "kept.ckpt"), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)  # norms kept apart: NxDT's megatron models decay them
        self.assertIn("input_layernorm.weight would start decaying", p.stderr)
        _, err = self.roundtrip(dict(LLAMA, layers=2), 2, 1, grouping="name", groups="nxdt")
        self.assertIn("optimizer grouping found: nnm-layernorm", err)  # same ties as name-based for NNM's names
        self.assertIn("optimizer grouping written: nxdt-biases-apart", err)
        self.assertRegex(err, r"\d+ parameters that did not decay in NNM start decaying")

    def test_one_group_with_do_layer_norm_weight_decay(self):
        _, err = self.roundtrip(dict(LLAMA, layers=2), 1, 2, grouping="one")
        self.assertIn("optimizer grouping found: one-group", err)
        self.assertIn("optimizer grouping written: nxdt-biases-apart", err)  # no biases: one group either way

    def test_pp1_mp_rank_folders_with_gqa(self):
        self.roundtrip(dict(LLAMA, kv_heads=2, layers=3), 2, 1)

    def test_the_converted_tag_describes_its_model_to_the_tools(self):
        """NNM's model config (hyper_parameters.cfg, an omegaconf DictConfig) is carried into
        user_content.pt, where NxDT keeps its own, as the plain dict NxDT's save makes of it
        (OmegaConf.to_container): ckpt-reshard needs no --heads/--kv_heads."""
        c = dict(LLAMA, kv_heads=2, layers=2)
        full, _ = make_nnm(None, c, write=False)  # one process's run, cut as NNM saves it: replicas equal
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, c, tp=2, pp=2, from_full=full[(0, 0)])
        first = self.convert("--tp", 2, "--pp", 2, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out)
        cfg = torch.load(os.path.join(out, "user_content.pt"))["hyper_parameters"]["cfg"]
        nnm_cfg = torch.load(glob.glob(os.path.join(nnm, "*", "*.ckpt"))[0])["hyper_parameters"]["cfg"]
        self.assertIs(type(cfg), dict)
        self.assertEqual(cfg, OmegaConf.to_container(nnm_cfg))
        self.assertEqual((cfg["num_attention_heads"], cfg["num_kv_heads"]), (4, 2))
        self.assertNotIn("will need --heads", first.stderr)
        resharded = os.path.join(self.dir, "tp1.ckpt")
        p = run(RESHARD, out, resharded, "--tp", 1, "--pp", 1)
        # The manifest records the format taken from that config: the tools need no hints.
        model = read_json(os.path.join(out, "manifest.json"))["model"]
        self.assertEqual((model["num_attention_heads"], model["num_kv_heads"], model["num_layers"]), (4, 2, 2))
        # Rope: no tensor holds the sequence length; the config does, and NxDT builds its rotary table from it.
        self.assertEqual((model["max_position_embeddings"], model["make_vocab_size_divisible_by"]), (c["seq"], 8))
        self.assertNotIn("model format (no manifest records it)", p.stdout + p.stderr)
        run(VERIFY, resharded, "--against", out)
        # A hint that contradicts the recorded format is refused, naming both.
        p = run(RESHARD, out, os.path.join(self.dir, "bad.ckpt"), "--tp", 1, "--pp", 1, "--heads", 2, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--heads 2 contradicts " + os.path.join(out, "manifest.json") + ", which records 4", p.stderr)
        # Without it (weights only: no user_content.pt), the converter says so before writing.
        p = self.convert("--tp", 2, "--pp", 2, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path",
                         os.path.join(self.dir, "weights.ckpt"), "--weights_only")
        self.assertIn("note: the output will not record the model's heads (--weights_only writes no user_content.pt): "
                      "ckpt-reshard and ckpt-export of it will need --heads", p.stderr)
        self.assertLess(p.stderr.index("will need --heads"), p.stderr.index("wrote "))

    def test_a_larger_tp_pads_the_vocabulary_by_the_recorded_rule(self):
        # GPT's vocabulary at NNM's tp 2, make_vocab_size_divisible_by 8 (hyper_parameters.cfg): 48 rows.
        # NxDT at tp 4 builds ceil(V / 32) * 32 = 64 rows for any V that gives 48 at tp 2, so the converter pads
        # by the recorded rule (it kept the 48 rows, 12 per rank, before: NxD's load then fails on the shape).
        c = dict(LLAMA, gpt=True, vocab=48, layers=2)
        full, _ = make_nnm(None, c, write=False)
        nnm = os.path.join(self.dir, "nnm")
        make_nnm(nnm, c, tp=2, pp=1, from_full=full[(0, 0)])
        emb = "language_model.embedding.word_embeddings.weight"
        source = dict(full[(0, 0)]["model"])[emb]  # the one-process run's, which the tp 2 files cut
        self.assertEqual(source.shape[0], 48)
        out = os.path.join(self.dir, "tp4.ckpt")
        p = self.convert("--tp", 4, "--pp", 1, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--optimizer_groups", "nxdt")
        self.assertIn("vocabulary padded to a multiple of 8 x tp (make_vocab_size_divisible_by in the job config in user_content.pt)", p.stderr)
        self.assertNotIn("rope_theta", p.stderr)  # learned positions: no rotary base to assume
        parts = [torch.load(os.path.join(out, "model", rank_file(t, 0)))[emb] for t in range(4)]
        self.assertEqual([tuple(x.shape) for x in parts], [(16, c["hidden"])] * 4)
        whole = torch.cat(parts)
        self.assertTrue(torch.equal(whole[:48], source))
        self.assertEqual(torch.count_nonzero(whole[48:]).item(), 0)
        model = read_json(os.path.join(out, "manifest.json"))["model"]
        self.assertEqual((model["vocab_size"], model["make_vocab_size_divisible_by"]), (48, 8))
        # The true size given alone takes the recorded rule: 40 tokens are 40 rows at tp 1 (48 at tp 2).
        out1 = os.path.join(self.dir, "tp1.ckpt")
        self.convert("--tp", 1, "--pp", 1, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out1, "--optimizer_groups", "nxdt",
                     "--vocab_size", 40)
        one = torch.load(os.path.join(out1, "model", rank_file(0, 0)))[emb]
        self.assertTrue(torch.equal(one, source[:40]))
        # After a conversion the manifest records the 48 rows as the vocabulary; --vocab_size refines it for a later
        # reshard when it gives the same rows at the tag's tp, and is refused when it does not.
        at_two = os.path.join(self.dir, "tp2.ckpt")
        self.convert("--tp", 2, "--pp", 1, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", at_two, "--optimizer_groups", "nxdt")
        resharded = os.path.join(self.dir, "tp2_to_1.ckpt")
        p = run(RESHARD, at_two, resharded, "--tp", 1, "--pp", 1, "--vocab_size", 40)
        self.assertIn("vocab_size 40, make_vocab_size_divisible_by 8 given: the same 48 rows", p.stdout + p.stderr)
        self.assertTrue(torch.equal(torch.load(os.path.join(resharded, "model", rank_file(0, 0)))[emb], source[:40]))
        p = run(RESHARD, at_two, os.path.join(self.dir, "bad20.ckpt"), "--tp", 1, "--pp", 1, "--vocab_size", 20, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--vocab_size 20 padded to a multiple of 8 x tp 2 contradicts", p.stderr)
        self.assertIn("which records vocab_size 48, make_vocab_size_divisible_by 8 (48 rows)", p.stderr)
        # A rule the recorded config contradicts is refused, naming both, and nothing is written.
        bad = os.path.join(self.dir, "bad.ckpt")
        p = self.convert("--tp", 4, "--pp", 1, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", bad, "--optimizer_groups", "nxdt",
                         "--make_vocab_size_divisible_by", 16, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--make_vocab_size_divisible_by 16 contradicts", p.stderr)
        self.assertIn("(hyper_parameters.cfg.make_vocab_size_divisible_by) is 8", p.stderr)
        self.assertFalse(os.path.exists(bad))

    def test_single_file_xser_in_and_out(self):
        self.roundtrip(dict(LLAMA, layers=2), 1, 1, xser_in=True, xser_out=True)

    def test_zero1_dp2_shards_keep_their_padding(self):
        # 18 / tp 2 = 9 embedding rows: padded to 10 and split over dp 2.
        self.roundtrip(dict(LLAMA, hidden=12, heads=4, kv_heads=4, vocab=18, layers=4), 2, 2, zero1_dp=2)

    def test_zero1_xser_input(self):
        self.roundtrip(dict(LLAMA, layers=2), 1, 2, xser_in=True, zero1_dp=2)

    def test_gpt_style_with_biases_tied_embeddings_and_virtual_pipeline(self):
        _, err = self.roundtrip(dict(LLAMA, gpt=True, layers=8), 1, 2, vpp=2, groups="nxdt")
        # GPT's MixedFusedLayerNorm is an apex.normalization class: norms and biases in group 1;
        # NxDT's megatron GPT keeps only the biases apart.
        self.assertIn("optimizer grouping found: nnm-layernorm", err)
        self.assertIn("optimizer grouping written: nxdt-biases-apart", err)
        self.assertRegex(err, r"\d+ parameters that did not decay in NNM start decaying, e.g. \S+layernorm.weight")

    def test_gpt_one_stage_gains_nxdts_tied_output_layer(self):
        """NNM's GPT at pp = 1 holds the embedding only; NxDT's state_dict holds it under the output layer's
        name too, and NeMo's groups list it twice (tests/data/upstream/nxdt_megatron): the conversion writes
        both, the copy's optimizer state the embedding's. Checked against the fixture's expectation."""
        for zero1_dp in (0, 2):
            with self.subTest(zero1_dp=zero1_dp):
                out, _ = self.roundtrip(dict(LLAMA, gpt=True, layers=2), 2, 1, groups="nxdt", zero1_dp=zero1_dp)
                model = torch.load(os.path.join(out, "model", rank_file(1, 0)))
                self.assertEqual(list(model)[-1], "language_model.output_layer.weight")
                self.assertTrue(torch.equal(model["language_model.output_layer.weight"],
                                            model["language_model.embedding.word_embeddings.weight"]))
                shutil.rmtree(self.dir + "/nnm"), shutil.rmtree(out)

    def test_checkpoint_dir_names_the_tag_and_picks_the_newest_file(self):
        nnm, ckdir = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "ckpts")
        make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=1, step=3, last=False)
        expected, _ = make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=1, step=7, seed=1)
        p = self.convert("--nnm_ckpt_path", nnm, "--checkpoint_dir", ckdir)
        self.assertIn("megatron_llama--step=7-consumed_samples=56.0-last.ckpt", p.stderr)
        tag = os.path.join(ckdir, "megatron_llama--step=7-consumed_samples=56.0-last.ckpt")
        self.check_tag(tag, expected)
        self.assertEqual(sorted(os.listdir(ckdir)), [os.path.basename(tag)])  # no staging debris

    def test_end_to_end_llama_tp2_pp2_resumes_with_nnms_weight_decay(self):
        self.end_to_end(gpt=False)

    def test_end_to_end_llama_tp2_pp2_zero1_dp2(self):
        self.end_to_end(gpt=False, zero1_dp=2)

    def test_end_to_end_gpt_style_layernorm_weights_start_decaying(self):
        self.end_to_end(gpt=True, groups="nxdt")

    def end_to_end(self, gpt, zero1_dp=0, groups="keep"):
        """A megatron Llama (or GPT) trained 3 steps in torch with NNM's real
        grouping, saved as NNM would save it at tp2 pp2 (plain or ZeRO-1),
        migrated with nnm2nxdt-config and nnm2nxdt-ckpt. The training core
        runs one process, so the tp2 pp2 tag is merged into one rank by an
        independent Python statement of Megatron's partition rules
        (megatron_partition.py), and shardkit-train resumes from that. Its first
        step's loss and learning rate, and every weight after it (norms
        included: they show whether decay was kept), equal torch continuing
        the same run. Learning rate 3e-3 and weight decay 1.0 make one step's
        decay 3e-3 of a weight, 30x the weight tolerance."""
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, "/usr/share/common-licenses/GPL-3", os.path.join(self.dir, "data", "text_document"))
        c = dict(hidden=64, ffn=172, heads=4, kv_heads=4, layers=2, vocab=264, seq=64, gpt=gpt)
        cfg = dict(c, rotary_dim=0, layernorm=True, gelu=True, tied=True) if gpt else dict(c, rotary_dim=16)
        base_lr, warmup, min_lr, max_steps, S, gbs, wd, tol = 3e-3, 2, 3e-4, 60, 3, 8, 1.0, 1e-4

        def samples(start, count):
            out = run(TOKENIZE, "--samples", os.path.join(self.dir, "data", "text_document"), 64, 1234, start, count).stdout
            return torch.tensor([[int(x) for x in line.split()] for line in out.strip().split("\n")])

        def train_step(chunk, params, batch):
            named = {k: v for k, v in chunk.state_dict(keep_vars=True).items() if not k.endswith("inv_freq")}
            logits = train_reference.forward(named, cfg, batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c["vocab"]), batch[:, 1:].reshape(-1))
            for q in params:
                q.grad = None
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            return loss.item()

        lr_at = lambda s: train_reference.nemo_cosine(s, base_lr, warmup, 0, max_steps, min_lr)
        sched = lr_scheduler_state(S, base_lr, warmup, 0, max_steps, min_lr)
        full, _ = make_nnm(None, c, steps=S, step=S, gbs=gbs, lr=base_lr, weight_decay=wd, lr_at=lr_at, sched=sched, write=False,
                           grads=lambda chunks, params, s: train_step(chunks[0], params, samples(s * gbs, gbs)))
        full = full[(0, 0)]
        nnm = os.path.join(self.dir, "nnm")
        _, file_name = make_nnm(nnm, c, tp=2, pp=2, zero1_dp=zero1_dp, step=S, gbs=gbs, lr=base_lr, weight_decay=wd,
                                sched=sched, from_full=full)

        # nnm2nxdt-config keeps do_layer_norm_weight_decay (NxDT's megatron models decay norm weights either
        # way) and warns of a LayerNorm model, whose norm weights NNM did not decay.
        nnm_yaml = os.path.join(self.dir, "nnm.yaml")
        with open(nnm_yaml, "w") as f:
            f.write(f"model:\n  normalization: {'layernorm' if gpt else 'rmsnorm'}\n  do_layer_norm_weight_decay: False\n"
                    f"  optim:\n    name: adamw\n    lr: {base_lr}\n    weight_decay: {wd}\n")
        p = run(CONFIG, nnm_yaml, "-o", os.path.join(self.dir, "nxdt.yaml"), "--allow-incomplete")  # a model section only
        with open(os.path.join(self.dir, "nxdt.yaml")) as f:
            self.assertIn("do_layer_norm_weight_decay: False", f.read())
        self.assertEqual("NNM did not decay LayerNorm weights" in p.stdout + p.stderr, gpt)
        decay_norms = False

        conv = os.path.join(self.dir, "conv")
        p = self.convert("--tp", 2, "--pp", 2, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--checkpoint_dir", conv,
                         "--optimizer_groups", groups)
        self.assertIn(f"model.do_layer_norm_weight_decay: {decay_norms}", p.stderr)
        tag_name = os.listdir(conv)[0]
        run_dir = os.path.join(self.dir, "run")
        merge_tag(os.path.join(conv, tag_name), os.path.join(run_dir, "checkpoints", tag_name), c, 2, 2,
                  dp=max(zero1_dp, 1), zero1=zero1_dp > 0, do_layer_norm_weight_decay=decay_norms)

        conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf",
                            "tiny_gpt.yaml" if gpt else "tiny_llama.yaml")
        # tiny_gpt trains in mixed precision with dropout; this NNM run was fp32 without.
        gpt_overrides = ["precision.type=fp32", "model.ffn_hidden_size=172", "model.hidden_dropout=0.0",
                         "model.attention_dropout=0.0", "model.ffn_dropout=0.0"] if gpt else []
        p = subprocess.run([TRAIN, conf, f"exp_manager.explicit_log_dir={run_dir}", f"trainer.max_steps={S + 1}",
                            f"model.optim.lr={base_lr}", f"model.optim.weight_decay={wd}", f"model.optim.sched.warmup_steps={warmup}",
                            f"model.optim.sched.min_lr={min_lr}", f"+model.optim.sched.max_steps={max_steps}",
                            f"+model.do_layer_norm_weight_decay={decay_norms}", "exp_manager.async_checkpointing=False",
                            *gpt_overrides], cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"at step {S}, {S * gbs} samples consumed", p.stderr)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(l) for l in f]
        self.assertEqual([m["step"] for m in metrics], [S + 1])

        # torch continues the same run for one step: as NNM would, and as NxDT's grouping would (NeMo's
        # rule: every weight decays, only biases do not).
        lr = train_reference.nemo_cosine(S, base_lr, warmup, 0, max_steps, min_lr)
        references = {}
        for variant in ("keep", "nxdt"):
            m, o = copy.deepcopy((full["chunks"][0], full["opt"]))  # parameters, not their gradients
            loss = train_step(m, [q for g in o.param_groups for q in g["params"]], samples(S * gbs, gbs))
            if variant == "nxdt" and len(o.param_groups) > 1:  # NNM's group 1 keeps only its biases
                named = {id(q): n for n, q in m.named_parameters()}
                moved = [q for q in o.param_groups[1]["params"] if not nemo_no_decay(named[id(q)])]
                o.param_groups[1]["params"] = [q for q in o.param_groups[1]["params"] if nemo_no_decay(named[id(q)])]
                o.param_groups[0]["params"] += moved
            for g in o.param_groups:
                g["lr"] = lr
            o.step()
            references[variant] = m.state_dict()
        self.assertAlmostEqual(metrics[0]["lr"], lr, delta=1e-12 * lr)
        self.assertLessEqual(abs(metrics[0]["loss"] - loss), 1e-4 * abs(loss), (metrics[0]["loss"], loss))
        tag = glob.glob(os.path.join(run_dir, "checkpoints", f"*step={S + 1}-*"))[0]
        ours = torch.load(os.path.join(tag, "model", rank_file(0, 0)))
        want = references[groups]
        for k, v in want.items():
            if k.endswith("inv_freq"):
                continue
            err, scale = (ours[k] - v).abs().max().item(), v.abs().max().item()
            self.assertLessEqual(err, tol * scale, f"{k}: {err} vs {scale}")
        # The tolerance sees a wrong grouping: where the two differ (GPT's LayerNorm weights, which NNM did
        # not decay), they differ by far more than it. A Llama's two groupings are the same.
        if gpt:
            other = references["keep"]
            gaps = [((other[k] - v).abs().max() / v.abs().max()).item() for k, v in want.items() if k.endswith("norm.weight")]
            self.assertGreater(min(gaps), 10 * tol, gaps)

    def test_weights_only_input_converts_with_nxdts_arguments(self):
        """NNM's HF converter writes no optimizer state: NxDT's arguments as
        they are convert it, say so, and the output resumes in shardkit-train
        with a fresh optimizer at the input's step."""
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        c = dict(LLAMA, layers=4)
        expected = make_hf_converted(nnm, c, tp=2, pp=2)
        p = self.convert("--tp", 2, "--pp", 2, "--n_layers", 4, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out)
        self.assertIn("holds no optimizer state", p.stderr)
        run(VERIFY, out)
        for (t, pp), model in expected.items():
            self.assert_same(f"model {t},{pp}", torch.load(os.path.join(out, "model", rank_file(t, pp))), dict(model))
        self.assertFalse(os.path.exists(os.path.join(out, "optim")))
        uc = torch.load(os.path.join(out, "user_content.pt"))
        self.assertEqual((uc["global_step"], uc["consumed_samples"]), (0, 0.0))
        # --require_optimizer refuses it, exit 2, and writes nothing.
        refused = os.path.join(self.dir, "refused.ckpt")
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", refused, "--require_optimizer", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("tp_rank_00_pp_rank_000", p.stderr)
        self.assertIn("no optimizer state", p.stderr)
        self.assertFalse(os.path.exists(refused))

    def test_readme_conversion_with_model_config_alone(self):
        """The README's first hour: NNM's HF -> NNM converter records no hyper_parameters, so the
        user gives the HF config.json and nothing else. The padding rule is the one that gives the
        rows read (NNM's default, 128, when it fits), said so; a config.json with model_type and no
        architectures is read as transformers' AutoConfig reads it; the one-pass degree change
        takes the same route, and both outputs hold the same state."""
        nnm = os.path.join(self.dir, "nnm")
        c = dict(LLAMA, layers=4, vocab=256)

        def hf_converted(c):
            make_hf_converted(nnm, c, tp=2, pp=2)
            # The converter copies one HF model's norms to every tp rank: replicas are equal.
            for pp in range(2):
                files = [os.path.join(nnm, f"tp_rank_{t:02d}_pp_rank_{pp:03d}", "model_optim_rng.ckpt") for t in range(2)]
                first = torch.load(files[0])["state_dict"]
                ck = torch.load(files[1])
                ck["state_dict"] = {k: first[k] if v.dim() == 1 else v for k, v in ck["state_dict"].items()}
                torch.save(ck, files[1])

        hf_converted(c)
        hf = os.path.join(self.dir, "hf")
        os.makedirs(hf)
        with open(os.path.join(hf, "config.json"), "w") as f:  # no architectures: model_type alone
            json.dump({"model_type": "llama", "hidden_size": c["hidden"], "intermediate_size": c["ffn"],
                       "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"],
                       "num_hidden_layers": c["layers"], "vocab_size": 250}, f)
        same, one_pass = os.path.join(self.dir, "same.ckpt"), os.path.join(self.dir, "tp1.ckpt")
        p = self.convert("--tp", 2, "--pp", 2, "--n_layers", 4, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", same,
                         "--weights_only", "--model_config", os.path.join(hf, "config.json"))
        self.assertIn("make_vocab_size_divisible_by 128 inferred", p.stderr)
        self.assertIn("NNM's default", p.stderr)
        with open(os.path.join(same, "manifest.json")) as f:
            manifest = json.load(f)
        self.assertEqual((manifest["model"]["vocab_size"], manifest["model"]["make_vocab_size_divisible_by"]), (250, 128))
        p = self.convert("--tp", 1, "--pp", 1, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", one_pass,
                         "--weights_only", "--model_config", os.path.join(hf, "config.json"))
        self.assertIn("make_vocab_size_divisible_by 128 inferred", p.stderr)
        run(VERIFY, one_pass, "--against", same)
        # 128 does not fit 32 rows at tp 2: the smallest rule that does (2: 30 tokens padded to 32), said so.
        shutil.rmtree(nnm)
        hf_converted(dict(c, vocab=32))
        with open(os.path.join(hf, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(dict(cfg, vocab_size=30), f)
        small = os.path.join(self.dir, "small.ckpt")
        p = self.convert("--tp", 2, "--pp", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", small,
                         "--weights_only", "--model_config", os.path.join(hf, "config.json"))
        self.assertIn("make_vocab_size_divisible_by 2 inferred", p.stderr)
        self.assertNotIn("NNM's default", p.stderr)
        # No rule gives 32 rows from 40 tokens: exit 2, naming both, nothing written.
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(dict(cfg, vocab_size=40), f)
        refused = os.path.join(self.dir, "refused.ckpt")
        p = self.convert("--tp", 2, "--pp", 2, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", refused,
                         "--weights_only", "--model_config", os.path.join(hf, "config.json"), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("32 rows", p.stderr)
        self.assertIn("vocab_size 40", p.stderr)
        self.assertFalse(os.path.exists(refused))

    def test_old_unmerged_swiglu_converts_to_what_the_merged_files_convert_to(self):
        """Old NNM Llama files keep dense_h_to_4h (gate) and dense_h_to_4h_2 (up) apart; NNM's
        chkpt_merge_mlp_weights.py stacks them per tp rank. Splitting merged files back into that
        old form must convert to the very same tag (weights), and the optimizer, which the old form
        keeps apart, is refused rather than written wrong."""
        merged, old = os.path.join(self.dir, "merged"), os.path.join(self.dir, "old")
        c = dict(LLAMA, layers=4)
        make_hf_converted(merged, c, tp=2, pp=2)
        shutil.copytree(merged, old)
        split = 0
        for path in glob.glob(os.path.join(old, "*", "*.ckpt")):
            ck = torch.load(path)
            sd = {}
            for k, v in ck["state_dict"].items():
                if k.endswith("mlp.dense_h_to_4h.weight"):
                    gate, up = v.chunk(2)  # each tp rank holds [gate_r; up_r]
                    sd[k], sd[k.replace("dense_h_to_4h", "dense_h_to_4h_2")] = gate.clone(), up.clone()
                    split += 1
                else:
                    sd[k] = v
            ck["state_dict"] = sd
            torch.save(ck, path)
        self.assertEqual(split, 4 * 2)  # 4 layers, 2 tp ranks
        a, b = os.path.join(self.dir, "a.ckpt"), os.path.join(self.dir, "b.ckpt")
        self.convert("--tp", 2, "--pp", 2, "--nnm_ckpt_path", merged, "--nxdt_ckpt_path", a)
        p = self.convert("--tp", 2, "--pp", 2, "--nnm_ckpt_path", old, "--nxdt_ckpt_path", b)
        self.assertIn("merged NNM's unmerged SwiGLU", p.stderr)
        for t in (0, 1):
            for pp in (0, 1):
                rel = os.path.join("model", rank_file(t, pp))
                with open(os.path.join(a, rel), "rb") as f1, open(os.path.join(b, rel), "rb") as f2:
                    self.assertEqual(f1.read(), f2.read(), rel)
        # With optimizer state in the old form: exit 2, naming it, nothing written.
        nnm, refused = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "refused.ckpt")
        make_nnm(nnm, c, tp=1, pp=1)
        for path in glob.glob(os.path.join(nnm, "**", "*.ckpt"), recursive=True):
            ck = torch.load(path)
            sd = {}
            for k, v in ck["state_dict"].items():
                if k.endswith("mlp.dense_h_to_4h.weight"):
                    sd[k], sd[k.replace("dense_h_to_4h", "dense_h_to_4h_2")] = (x.clone() for x in v.chunk(2))
                else:
                    sd[k] = v
            ck["state_dict"] = sd
            torch.save(ck, path)
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", refused, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("unmerged SwiGLU", p.stderr)
        self.assertIn("--weights_only", p.stderr)
        self.assertFalse(os.path.exists(refused))

    def test_weights_only_input_resumes_in_the_training_core(self):
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, "/usr/share/common-licenses/GPL-3", os.path.join(self.dir, "data", "text_document"))
        c = dict(hidden=64, ffn=172, heads=4, kv_heads=4, layers=2, vocab=264, seq=64, gpt=False)
        nnm, run_dir = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "run")
        model = dict(make_hf_converted(nnm, c)[(0, 0)])
        self.convert("--nnm_ckpt_path", nnm, "--checkpoint_dir", os.path.join(run_dir, "checkpoints"))
        conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
        p = subprocess.run([TRAIN, conf, f"exp_manager.explicit_log_dir={run_dir}", "trainer.max_steps=1",
                            "exp_manager.async_checkpointing=False"], cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("holds no optimizer state; the optimizer starts fresh", p.stderr)
        self.assertIn("at step 0, 0 samples consumed", p.stderr)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            loss = json.loads(f.readline())["loss"]
        out = run(TOKENIZE, "--samples", os.path.join(self.dir, "data", "text_document"), 64, 1234, 0, 8).stdout
        batch = torch.tensor([[int(x) for x in line.split()] for line in out.strip().split("\n")])
        logits = train_reference.forward(model, dict(c, rotary_dim=16), batch[:, :-1])
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, c["vocab"]), batch[:, 1:].reshape(-1)).item()
        self.assertLessEqual(abs(loss - want), 1e-5 * want, (loss, want))

    def test_zero1_dict_is_not_what_nnm_writes(self):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, dict(LLAMA, layers=2), tp=1, pp=2, zero1_dp=2)
        victim = glob.glob(os.path.join(nnm, "tp_rank_00_pp_rank_001", "optim", "dp_rank_001", "*.ckpt"))[0]
        torch.save(torch.load(victim)[0], victim)  # the bare ZeRO-1 dict
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(victim, p.stderr)
        self.assertIn("optimizer_states' list", p.stderr)
        self.assertFalse(os.path.exists(out))

    def hand_made(self, moments):
        """A one-file NNM checkpoint over a hand-made module whose norm
        (a 1-D weight) is not named *norm and whose matrix is: NNM's class
        rule and the name rule give the same group sizes (2, 1) but different
        ties. Its optimizer state is NNM's class rule's (ids: w, x_norm, ln_a)."""
        nnm = os.path.join(self.dir, "hand")
        os.makedirs(nnm)
        w, ln, xn = torch.randn(4, 4), torch.ones(4), torch.randn(4, 4)
        state = {} if not moments else {
            i: {"step": torch.tensor(1.0), "exp_avg": torch.full_like(x, i + 1.0), "exp_avg_sq": torch.full_like(x, 1.0)}
            for i, x in enumerate((w, xn, ln))}
        groups = [{"lr": 1e-3, "weight_decay": 0.1, "params": [0, 1]}, {"lr": 1e-3, "weight_decay": 0.0, "params": [2]}]
        torch.save({"epoch": 0, "global_step": 1, "state_dict": {"model.w.weight": w, "model.ln_a.weight": ln, "model.x_norm.weight": xn},
                    "optimizer_states": [{"state": state, "param_groups": groups}]}, os.path.join(nnm, "model_optim_rng.ckpt"))
        return nnm

    def test_two_groupings_that_fit_with_different_ties_are_refused(self):
        nnm, out = self.hand_made(moments=False), os.path.join(self.dir, "out.ckpt")
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("groupings nnm-layernorm and name-based both fit", p.stderr)
        self.assertIn("id 1 is x_norm.weight under nnm-layernorm, ln_a.weight under name-based", p.stderr)
        self.assertNotIn("FORMATS", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_moment_shapes_decide_between_groupings_of_equal_sizes(self):
        nnm, out = self.hand_made(moments=True), os.path.join(self.dir, "out.ckpt")
        # NNM decayed x_norm and not ln_a: neither trainer setting keeps that.
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("neither keeps what NNM decayed", p.stderr)
        self.assertIn("--optimizer_groups nxdt", p.stderr)
        self.assertFalse(os.path.exists(out))
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--optimizer_groups", "nxdt")
        self.assertIn("optimizer grouping found: nnm-layernorm", p.stderr)
        osd = torch.load(os.path.join(out, "optim", rank_file(0, 0)))
        # NxDT's (NeMo's rule, no biases): one group in module order w, ln_a, x_norm; moments follow their parameter.
        self.assertEqual([g["params"] for g in osd["param_groups"]], [[0, 1, 2]])
        self.assertEqual([osd["state"][i]["exp_avg"].flatten()[0].item() for i in range(3)], [1.0, 3.0, 2.0])

    def test_none_fits_names_every_candidate_and_the_sizes(self):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, dict(LLAMA, layers=2))
        victim = glob.glob(os.path.join(nnm, "*.ckpt"))[0]
        ck = torch.load(victim)
        g = ck["optimizer_states"][0]["param_groups"]
        g[1]["params"], g[0]["params"] = g[0]["params"][-2:], g[0]["params"][:-2]  # sizes NNM never writes
        torch.save(ck, victim)
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        for candidate in ("nnm-rmsnorm", "nnm-layernorm", "one-group", "name-based"):
            self.assertIn(candidate, p.stderr)
        self.assertNotIn("FORMATS", p.stderr)

    def big_checkpoint(self):
        nnm = os.path.join(self.dir, "nnm")
        c = dict(hidden=256, ffn=688, heads=4, kv_heads=4, layers=4, vocab=8192, seq=8, gpt=False)
        expected, _ = make_nnm(nnm, c, tp=2, pp=2, steps=1)
        return nnm, expected

    def test_sigkill_never_leaves_done_on_a_partial_output(self):
        nnm, expected = self.big_checkpoint()
        out = os.path.join(self.dir, "out.ckpt")
        args = [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--overwrite"]
        t0 = time.time()
        run(*args)
        full = time.time() - t0
        self.check_tag(out, expected)
        rng = random.Random(7)
        for trial in range(16):
            p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0, full))
            p.send_signal(signal.SIGKILL)
            p.wait()
            # Whatever has `done` is whole: the target (old or new) and any staging folder.
            for tag in glob.glob(os.path.join(self.dir, "*.ckpt")) + glob.glob(os.path.join(self.dir, ".*")):
                if os.path.exists(os.path.join(tag, "done")):
                    run(VERIFY, tag)
            self.assertFalse(os.path.exists(out) and not os.path.exists(os.path.join(out, "done")), f"trial {trial}")
            # The earlier complete output is never lost: it is in place or set aside to be restored.
            self.assertTrue(os.path.exists(os.path.join(out, "done")) or
                            os.path.exists(os.path.join(self.dir, ".out.ckpt.nnm2nxdt-old", "done")), f"trial {trial}")
        run(*args)
        self.check_tag(out, expected)
        self.assertEqual(sorted(os.listdir(self.dir)), sorted(["nnm", "out.ckpt", "stub"]))

    def test_bad_inputs_get_clear_errors_and_no_complete_looking_output(self):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=2)
        victim = glob.glob(os.path.join(nnm, "tp_rank_01_pp_rank_001", "*.ckpt"))[0]
        good = read_bytes(victim)

        def fails(*extra, code=2):  # bad input: exit 2
            p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, *extra, check=False)
            self.assertEqual(p.returncode, code, p.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "done")))
            return p.stderr

        # Other degrees re-cut in one pass, reading replicas as NxD keeps them: equal. This fixture trained
        # each rank apart, so its norms differ across tp ranks; that is refused, naming the tensor.
        self.assertIn("'language_model.encoder.layers.0.input_layernorm.weight' (param): tp ranks 0 and 1 hold different copies",
                      fails("--tp", 4, "--pp", 2))
        trusted = os.path.join(self.dir, "trusted.ckpt")  # unless tp rank 0's copies are trusted, as asked
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", trusted, "--tp", 4, "--pp", 2, "--trust_first_replica")
        run(VERIFY, trusted)
        shutil.rmtree(trusted)
        self.assertIn("--n_layers is 3 but the checkpoint holds 2 layers", fails("--n_layers", 3))
        self.assertIn("not a boolean", fails("--enable_parallel_processing", "maybe"))
        with open(victim, "wb") as f:  # truncated
            f.write(good[: len(good) // 2])
        self.assertIn(victim, fails())
        with open(victim, "wb") as f:  # one flipped byte inside a tensor record
            bad = bytearray(good)
            bad[len(good) // 2] ^= 0xFF
            f.write(bad)
        err = fails()
        self.assertIn(victim, err)
        self.assertIn("CRC-32", err)
        with open(victim, "wb") as f:
            f.write(good)
        os.rename(os.path.join(nnm, "tp_rank_01_pp_rank_000"), os.path.join(self.dir, "moved"))
        self.assertIn("tp_rank_01_pp_rank_000", fails())
        os.rename(os.path.join(self.dir, "moved"), os.path.join(nnm, "tp_rank_01_pp_rank_000"))
        # --dry_run plans and writes nothing.
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--dry_run")
        self.assertIn("rename (pp 1) model.language_model.encoder.layers.0.mlp.dense_h_to_4h.weight -> "
                      "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight", p.stderr)
        self.assertIn("optimizer grouping found: nnm-rmsnorm", p.stderr)
        self.assertIn("optimizer grouping written: nxdt-biases-apart", p.stderr)
        self.assertFalse(os.path.exists(out))
        # A non-empty target is kept unless --overwrite.
        os.makedirs(out)
        with open(os.path.join(out, "mine.txt"), "w") as f:
            f.write("keep")
        self.assertIn("--overwrite", fails("--enable_parallel_processing", "False"))
        self.assertEqual(os.listdir(out), ["mine.txt"])
        # --overwrite replaces only a checkpoint tag; a folder of the user's files is refused, its contents named.
        err = fails("--overwrite")
        self.assertIn("not a checkpoint tag", err)
        self.assertIn("mine.txt", err)
        self.assertEqual(os.listdir(out), ["mine.txt"])
        os.remove(os.path.join(out, "mine.txt"))
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--enable_parallel_processing", "no")
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--overwrite", "--enable_parallel_processing", "no")
        run(VERIFY, out)
        # "out.ckpt/" names out.ckpt: replaced in place, its staging folder beside it, nothing left inside.
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out + "/", "--overwrite")
        run(VERIFY, out)
        self.assertFalse([n for n in os.listdir(out) if "nnm2nxdt" in n])
        self.assertFalse([n for n in os.listdir(self.dir) if "nnm2nxdt" in n])
        # An output that is the input, or lies inside it, is refused before anything is touched.
        for target in (nnm, os.path.join(nnm, "tp_rank_00_pp_rank_000", "out.ckpt"), self.dir):
            p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", target, "--overwrite", check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("the input --nnm_ckpt_path", p.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(nnm, "tp_rank_00_pp_rank_000"))), [os.path.basename(victim)])

    def one_pass_and_two(self, nnm, degrees, convert=(), reshard=()):
        """nnm2nxdt-ckpt to other `degrees` in one pass, and convert (at NNM's degrees) then ckpt-reshard:
        every file alike, byte for byte. `convert`: the converter's flags; `reshard`: flags of the final write."""
        one, conv, two = (os.path.join(self.dir, n) for n in ("one.ckpt", "conv.ckpt", "two.ckpt"))
        for d in (one, conv, two):
            shutil.rmtree(d, ignore_errors=True)
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", one, *degrees, *convert, *reshard)
        self.assertIn("in one pass", p.stderr)
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", conv, *convert)
        run(RESHARD, conv, two, *degrees, *reshard)
        def files(d):
            return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs if ".shardkit" not in r)
        self.assertEqual(files(one), files(two))
        for f in files(one):
            self.assertEqual(read_bytes(os.path.join(one, f)), read_bytes(os.path.join(two, f)), f)
        run(VERIFY, one)
        return one, p.stderr

    def test_other_degrees_in_one_pass_hold_the_one_process_run(self):
        """NNM tp2 pp2 (cut from a one-process run, replicas equal, as NNM saves them) converted to tp1 pp1 in
        one pass holds exactly that run's weights and optimizer state, by the fixture's own statement of them."""
        c = dict(LLAMA, kv_heads=2, layers=4)
        full, _ = make_nnm(None, c, write=False)
        nnm = os.path.join(self.dir, "nnm")
        make_nnm(nnm, c, tp=2, pp=2, from_full=full[(0, 0)])
        out, err = self.one_pass_and_two(nnm, ("--tp", 1, "--pp", 1))
        self.check_tag(out, full)
        manifest = read_json(os.path.join(out, "manifest.json"))
        self.assertEqual((manifest["grid"]["tp"], manifest["grid"]["pp"], manifest["model"]["num_kv_heads"]), (1, 1, 2))
        self.assertIn("tensors", manifest)  # fingerprints, which ckpt-verify --against compares
        self.assertIn("optimizer grouping written: nxdt-biases-apart", err)
        # More stages, uneven cuts, more tp ranks: each as convert-then-reshard writes it.
        self.one_pass_and_two(nnm, ("--tp", 1, "--pp", 4))
        self.one_pass_and_two(nnm, ("--tp", 4, "--pp", 3, "--pipeline_cuts", "1,3"))

    def test_own_degrees_go_through_the_engine_when_the_files_read_as_a_tag(self):
        """At NNM's own degrees the reshard engine writes the tag too when the model format is known and
        replicas are equal: the manifest records the format and fingerprints, model files list their
        entries in the family's module order whatever order NNM's file had, and the values are the
        fixture's. Otherwise (replicas that differ) the files are written as mapped, and it says so."""
        c = dict(LLAMA, kv_heads=2, layers=4)
        full, _ = make_nnm(None, c, write=False)
        nnm, out, one = (os.path.join(self.dir, n) for n in ("nnm", "out.ckpt", "one.ckpt"))
        expected, _ = make_nnm(nnm, c, tp=2, pp=2, from_full=full[(0, 0)])
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out)
        self.assertNotIn("written file for file as mapped", p.stderr)
        self.check_tag(out, expected)
        manifest = read_json(os.path.join(out, "manifest.json"))
        self.assertEqual(manifest["model"]["num_kv_heads"], 2)
        self.assertIn("tensors", manifest)
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", one, "--tp", 1, "--pp", 1)
        v = run(VERIFY, one, "--against", out, "--json")
        self.assertTrue(json.loads(v.stdout)["same"])
        # An error of the engine's own (here a budget too small) ends the run: it does not fall back to
        # writing as mapped, which would ignore what was asked.
        small = os.path.join(self.dir, "small.ckpt")
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", small, "--memory_budget", "1K", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--memory_budget 1.0 KiB is smaller than one slice", p.stderr)
        self.assertNotIn("written file for file", p.stderr)
        self.assertFalse(os.path.exists(small))
        # Weights in another key order (NNM's HF converter writes HF's order, and no optimizer state):
        # the output lists them in module order, holding the same values.
        in_order = [k for k, _ in torch.load(os.path.join(out, "model", rank_file(0, 1))).items()]
        for f in glob.glob(os.path.join(nnm, "*", "*.ckpt")):
            ck = torch.load(f)
            ck["state_dict"] = dict(reversed(list(ck["state_dict"].items())))
            torch.save(ck, f)
        weights = os.path.join(self.dir, "weights.ckpt")
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", weights, "--weights_only", "--heads", 4, "--kv_heads", 2)
        got = torch.load(os.path.join(weights, "model", rank_file(0, 1)))
        params = lambda keys: [k for k in keys if not k.endswith("inv_freq")]  # buffers keep their neighbour
        self.assertEqual(params(got), params(in_order))
        self.assertEqual(sorted(got), sorted(in_order))
        want = dict(expected[(0, 1)]["model"])
        self.assert_same("model 0,1", {k: got[k] for k in want}, want)
        run(RESHARD, weights, os.path.join(self.dir, "tp1w.ckpt"), "--tp", 1, "--pp", 1)  # no hints: the manifest has them
        # Replicas that differ (each rank trained apart): written as mapped, said so, no fingerprints.
        shutil.rmtree(nnm), shutil.rmtree(out)
        make_nnm(nnm, c, tp=2, pp=2)
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out)
        self.assertIn("note: written file for file as mapped; the manifest records no model format and no fingerprints", p.stderr)
        self.assertIn("hold different copies", p.stderr)
        self.assertNotIn("tensors", read_json(os.path.join(out, "manifest.json")))

    def test_other_degrees_in_one_pass_zero1_xser_and_gpt(self):
        for name, c, zero1_dp, xser in (("zero1", dict(LLAMA, kv_heads=2, layers=2), 2, ("--save_xser",)),
                                        ("gpt", dict(LLAMA, gpt=True, layers=2), 0, ())):
            with self.subTest(name):
                full, _ = make_nnm(None, c, write=False)
                nnm = os.path.join(self.dir, "nnm")
                shutil.rmtree(nnm, ignore_errors=True)
                make_nnm(nnm, c, tp=2, pp=1, zero1_dp=zero1_dp, from_full=full[(0, 0)])
                groups = ("--optimizer_groups", "nxdt") if c["gpt"] else ()
                out, _ = self.one_pass_and_two(nnm, ("--tp", 1, "--pp", 2), convert=groups, reshard=xser)
                if zero1_dp:
                    self.assertTrue(os.path.isdir(os.path.join(out, "optim", rank_file(0, 1, 1) + ".tensors")))

    def test_other_degrees_need_the_model_format_said_before_writing(self):
        c = dict(LLAMA, kv_heads=2, layers=2)
        full, _ = make_nnm(None, c, write=False)
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, c, tp=2, pp=1, from_full=full[(0, 0)])
        # --weights_only writes no user_content.pt, so hyper_parameters.cfg does not describe the model to the engine.
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--tp", 1, "--weights_only", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("does not record its model format (no hyper_parameters.cfg), so give --heads", p.stderr)
        self.assertIn("--nnm_config (the NNM job's YAML)", p.stderr)
        self.assertFalse(os.path.exists(out))
        self.assertEqual(sorted(os.listdir(self.dir)), ["nnm", "stub"])
        # NNM's own job YAML says it; one that contradicts the tensors is refused.
        yaml = os.path.join(self.dir, "megatron_llama_config.yaml")
        with open(yaml, "w") as f:
            f.write("model:\n  num_layers: 2\n  num_attention_heads: 4\n  num_kv_heads: 2\n")
        one, _ = self.one_pass_and_two(nnm, ("--tp", 1, "--pp", 1), convert=("--weights_only", "--nnm_config", yaml))
        self.assertEqual(read_json(os.path.join(one, "manifest.json"))["model"]["num_kv_heads"], 2)
        self.assertFalse(os.path.exists(os.path.join(one, "optim")))
        with open(yaml, "w") as f:
            f.write("model:\n  num_attention_heads: 4\n  num_kv_heads: 1\n")
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--tp", 1, "--nnm_config", yaml, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--kv_heads 1 contradicts", p.stderr)
        self.assertFalse(os.path.exists(out))
        # At its own degrees too, a hint the checkpoint's hyper_parameters contradict is refused.
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--heads", 2, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--heads 2 contradicts", p.stderr)
        self.assertIn("hyper_parameters.cfg.num_attention_heads) is 4", p.stderr)
        self.assertFalse(os.path.exists(out))
        # At its own degrees the converter records the format the YAML gives, so later commands need none.
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--weights_only", "--heads", 4, "--kv_heads", 2)
        self.assertEqual(read_json(os.path.join(out, "manifest.json"))["model"]["num_attention_heads"], 4)
        run(RESHARD, out, os.path.join(self.dir, "tp1.ckpt"), "--tp", 1, "--pp", 1)

    def test_mpirun_one_pass_writes_what_one_process_writes(self):
        c = dict(LLAMA, kv_heads=2, layers=4)
        full, _ = make_nnm(None, c, write=False)
        nnm = os.path.join(self.dir, "nnm")
        make_nnm(nnm, c, tp=2, pp=2, from_full=full[(0, 0)])
        one, two = os.path.join(self.dir, "one.ckpt"), os.path.join(self.dir, "two.ckpt")
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", one, "--tp", 1, "--pp", 4)
        run("mpirun", "--allow-run-as-root", "--oversubscribe", "-np", 2, CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", two,
            "--tp", 1, "--pp", 4)
        m1, m2 = (read_json(os.path.join(d, "manifest.json")) for d in (one, two))
        self.assertEqual(m1["files"], m2["files"])  # same bytes: sizes and CRC-32s
        self.assertEqual(m1["tensors"], m2["tensors"])

    def test_mpirun_ranks_split_the_files_and_write_what_one_process_writes(self):
        nnm = os.path.join(self.dir, "nnm")
        expected, _ = make_nnm(nnm, dict(LLAMA, layers=4), tp=2, pp=2)
        one, two = os.path.join(self.dir, "one.ckpt"), os.path.join(self.dir, "two.ckpt")
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", one)
        p = run("mpirun", "--allow-run-as-root", "--oversubscribe", "-np", 2, CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", two)
        self.assertIn("rank 1: converted", p.stderr)
        self.check_tag(two, expected)
        m1, m2 = (read_json(os.path.join(d, "manifest.json")) for d in (one, two))
        self.assertEqual(m1["files"], m2["files"])  # same bytes: sizes and CRC-32s
        self.assertEqual(m2["world_size"], 2)


if __name__ == "__main__":
    unittest.main()

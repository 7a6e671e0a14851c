"""HF-style Llama tags (NxDT's model_source: hf) against what NxD itself writes.

The fixtures in tests/data/upstream/hf_llama were written by NxD's own
checkpoint_converter.py (--convert_from_full_state) from full_gqa/ and
full_mha/ (see that folder's README). Every check here compares tensors with
those files, bit for bit: exports with the full state dict the converter was
given, re-laid tags with the tags the converter wrote for that layout.
"""
import glob
import json
import os
import shutil
import subprocess
import unittest

import torch

from canon import EXPORT, IMPORT, INSPECT, RESHARD, VERIFY, TempDirTest
from hf_export import read_safetensors

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "hf_llama")
TAGS = os.path.join(HERE, "tags")
GQA_CONFIG = os.path.join(HERE, "full_gqa", "config.json")
MHA_CONFIG = os.path.join(HERE, "full_mha", "config.json")


def load_json(path):
    with open(path) as f:
        return json.load(f)


def full_state(which):
    return torch.load(os.path.join(HERE, "full_" + which, "checkpoint.pt"))


def rank_files(tag):
    """{(tp, pp): {name: tensor}} of a tag's model/ folder (plain .pt)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(tag, "model", "dp_rank_*_tp_rank_*_pp_rank_*.pt"))):
        stem = os.path.basename(path)[:-3].split("_")
        out[(int(stem[5]), int(stem[8]))] = torch.load(path)
    return out


class HfLlamaTags(TempDirTest):
    def run_tool(self, *argv, code=0):
        p = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
        self.assertEqual(p.returncode, code, p.stdout + p.stderr)
        return p

    def assert_same_files(self, ours, theirs):
        """Every rank file of `ours` holds exactly `theirs`' tensors, by name, bit for bit."""
        a, b = rank_files(ours), rank_files(theirs)
        self.assertEqual(sorted(a), sorted(b))
        for rank in b:
            self.assertEqual(sorted(a[rank]), sorted(b[rank]), rank)
            for name, t in b[rank].items():
                self.assertEqual(a[rank][name].dtype, t.dtype, (rank, name))
                self.assertTrue(torch.equal(a[rank][name], t), (rank, name))

    def export_equals_full(self, tag, which, *flags):
        out = os.path.join(self.dir, "hf_" + os.path.basename(tag))
        p = self.run_tool(EXPORT, tag, out, "--format", "hf", "--model_config",
                          GQA_CONFIG if which == "gqa" else MHA_CONFIG, *flags)
        got, _ = read_safetensors(os.path.join(out, "model.safetensors"))
        want = full_state(which)
        self.assertEqual(sorted(got), sorted(want))
        for name, t in want.items():
            self.assertTrue(torch.equal(got[name], t), name)
        config = load_json(os.path.join(out, "config.json"))
        self.assertEqual(config["num_key_value_heads"], load_json(GQA_CONFIG if which == "gqa" else MHA_CONFIG)["num_key_value_heads"])
        return p.stderr

    def test_every_upstream_layout_exports_the_state_it_was_made_from(self):
        err = self.export_equals_full(os.path.join(TAGS, "trn1_tp8_pp2_kv4_fused"), "gqa")
        self.assertIn("kv_size_multiplier 4 and trn1 inferred from the data", err)
        self.assertIn("[[0, 2, 4, 6], [1, 3, 5, 7]]", err)
        self.export_equals_full(os.path.join(TAGS, "trn1_tp8_pp2_kv4_split"), "gqa")
        self.export_equals_full(os.path.join(TAGS, "trn1_tp4_pp1_kv2_fused"), "gqa")
        err = self.export_equals_full(os.path.join(TAGS, "trn2_tp4_pp1_kv2_fused_runtime_rule_shardkit"), "gqa")
        self.assertIn("kv_size_multiplier 2 and trn2 inferred", err)
        self.export_equals_full(os.path.join(TAGS, "mha_tp4_pp2_stride3"), "mha")

    def test_reshard_writes_what_the_converter_writes_for_that_layout(self):
        src = os.path.join(TAGS, "trn1_tp8_pp2_kv4_fused")
        cases = [
            (["--tp", "4", "--pp", "1", "--out_kv_size_multiplier", "2"], "trn1_tp4_pp1_kv2_fused"),
            (["--tp", "4", "--pp", "1", "--out_kv_size_multiplier", "2", "--out_hw_backend", "trn2"],
             "trn2_tp4_pp1_kv2_fused_runtime_rule_shardkit"),
            (["--tp", "8", "--pp", "2", "--out_fuse_qkv", "false"], "trn1_tp8_pp2_kv4_split"),
        ]
        for flags, want in cases:
            out = os.path.join(self.dir, want)
            self.run_tool(RESHARD, src, out, "--model_config", GQA_CONFIG, *flags)
            self.assert_same_files(out, os.path.join(TAGS, want))
            # The manifest records what no tensor shows, so the next tool needs no hints.
            model = load_json(os.path.join(out, "manifest.json"))["model"]
            self.assertEqual(model["model_family"], "hf_llama")
            self.assertEqual(model["kv_size_multiplier"], 4 if "tp8" in want else 2)
            self.export_equals_full(out, "gqa")
        # And back: separate q/k/v into the fused tp 8 layout.
        out = os.path.join(self.dir, "fused_again")
        self.run_tool(RESHARD, os.path.join(TAGS, "trn1_tp8_pp2_kv4_split"), out, "--model_config", GQA_CONFIG, "--tp", "8",
                      "--pp", "2", "--out_fuse_qkv", "true")
        self.assert_same_files(out, src)

    def test_mha_stride3_reshards_and_exports(self):
        out = os.path.join(self.dir, "mha_tp2")
        self.run_tool(RESHARD, os.path.join(TAGS, "mha_tp4_pp2_stride3"), out, "--model_config", MHA_CONFIG, "--tp", "2", "--pp", "1")
        files = rank_files(out)
        self.assertEqual(files[(0, 0)]["model.layers.1.self_attn.qkv_proj.weight"].shape, (96, 64))
        self.export_equals_full(out, "mha")

    def test_verify_against_compares_across_kv_layouts(self):
        p = self.run_tool(VERIFY, os.path.join(TAGS, "trn1_tp8_pp2_kv4_fused"), "--against", os.path.join(TAGS, "trn1_tp4_pp1_kv2_fused"),
                          "--model_config", GQA_CONFIG)
        self.assertIn("same     ", p.stdout)
        self.assertIn("27 logical tensors", p.stdout)
        self.run_tool(VERIFY, os.path.join(TAGS, "trn1_tp8_pp2_kv4_split"), "--against", os.path.join(TAGS, "trn1_tp4_pp1_kv2_fused"),
                      "--model_config", GQA_CONFIG)
        # The converter's Trn2 tag pairs queries with other KV heads: read as Trn1 (what its data says), it is a different model.
        p = self.run_tool(VERIFY, os.path.join(TAGS, "trn2_tp4_pp1_kv2_fused_converter"), "--against",
                          os.path.join(TAGS, "trn1_tp4_pp1_kv2_fused"), "--model_config", GQA_CONFIG, code=1)
        self.assertIn("model.layers.0.self_attn.qkv_proj.weight_qkv", p.stdout)

    def test_across_model_families(self):
        """HF-style -> Megatron-style -> HF-style: the converter's tag back bit for bit, the Megatron tag exporting the same model."""
        src = os.path.join(TAGS, "trn1_tp8_pp2_kv4_fused")
        mega = os.path.join(self.dir, "megatron_tp2")
        p = self.run_tool(RESHARD, src, mega, "--model_config", GQA_CONFIG, "--tp", "2", "--pp", "1", "--out_model_family", "megatron")
        self.assertIn("model family: hf_llama -> megatron", p.stderr)
        model = rank_files(mega)[(0, 0)]
        self.assertEqual(model["language_model.encoder.layers.0.self_attention.query.weight"].shape, (32, 64))
        # 128 tokens padded to a multiple of 128 x 2: 256 rows, tp rank 1's all padding, zeros.
        self.assertEqual(model["language_model.embedding.word_embeddings.weight"].shape, (128, 64))
        self.assertTrue(torch.equal(model["language_model.embedding.word_embeddings.weight"], full_state("gqa")["model.embed_tokens.weight"]))
        pad = rank_files(mega)[(1, 0)]["language_model.embedding.word_embeddings.weight"]
        self.assertTrue(torch.equal(pad, torch.zeros(128, 64, dtype=torch.bfloat16)))
        self.export_equals_full(mega, "gqa")
        p = self.run_tool(VERIFY, mega, "--against", src, "--model_config", GQA_CONFIG)
        self.assertIn("same     ", p.stdout)
        back = os.path.join(self.dir, "hf_again")
        self.run_tool(RESHARD, mega, back, "--tp", "8", "--pp", "2", "--out_model_family", "hf_llama", "--out_qkv_linear", "true",
                      "--out_kv_size_multiplier", "4", "--out_hw_backend", "trn1")
        self.assert_same_files(back, src)
        # Megatron-style with 2 KV heads over tp 4 is shardkit's own replication: said when written and by ckpt-inspect.
        mega4 = os.path.join(self.dir, "megatron_tp4")
        p = self.run_tool(RESHARD, src, mega4, "--model_config", GQA_CONFIG, "--tp", "4", "--pp", "1", "--out_model_family", "megatron")
        self.assertIn("warning: 2 KV heads over tp 4 are replicated by shardkit's rule", p.stderr)
        p = self.run_tool(INSPECT, mega4)
        self.assertIn("model: tp 4, pp 1, dp 1, megatron: llama-style, 4 layers, hidden 64, ffn 96, 8 heads (2 KV), vocab 128", p.stdout)
        self.assertIn("note: 2 KV heads over tp 4 are replicated by shardkit's rule", p.stdout)
        p = self.run_tool(INSPECT, back)
        self.assertIn("hf_llama: HF-style llama, 4 layers, hidden 64, ffn 96, 8 heads (2 KV), KV replicated x4 (trn1), vocab 128", p.stdout)
        self.assertNotIn("note:", p.stdout)
        # Optimizer state is grouped differently by the two families: refused unless left behind.
        zero1 = self.with_zero1_optimizer("trn1_tp4_pp1_kv2_fused", dp=1)
        out = os.path.join(self.dir, "no")
        p = self.run_tool(RESHARD, zero1, out, "--model_config", GQA_CONFIG, "--tp", "2", "--pp", "1", "--out_model_family", "megatron",
                          code=2)
        self.assertIn("pass --weights_only", p.stderr)
        self.run_tool(RESHARD, zero1, out, "--model_config", GQA_CONFIG, "--tp", "2", "--pp", "1", "--out_model_family", "megatron",
                      "--weights_only")

    def test_hdf5_export_and_import_keep_the_layout_and_optimizer(self):
        """ckpt-export to HDF5 and ckpt-import back: the same tag file for file, ZeRO-1 state and NxDT's HF grouping included."""
        src = self.with_zero1_optimizer("trn1_tp4_pp1_kv2_fused", dp=2)
        h5 = os.path.join(self.dir, "state.h5")
        self.run_tool(EXPORT, src, h5, "--model_config", GQA_CONFIG)
        back = os.path.join(self.dir, "back")
        self.run_tool(IMPORT, h5, back, "--tp", "4", "--pp", "1", "--dp", "2", "--zero1")
        self.assert_same_files(back, src)
        for d in range(2):
            name = "dp_rank_%02d_tp_rank_03_pp_rank_00.pt" % d
            a, b = torch.load(os.path.join(back, "optim", name)), torch.load(os.path.join(src, "optim", name))
            self.assertEqual([g["params"] for g in a["param_groups"]], [g["params"] for g in b["param_groups"]])
            self.assertEqual([g["weight_decay"] for g in a["param_groups"]], [0.01, 0.0])
            for i, st in b["base_state"].items():
                self.assertTrue(torch.equal(a["base_state"][i]["exp_avg_sq"], st["exp_avg_sq"]), i)
                self.assertTrue(torch.equal(a["sharded_master_weights"][i], b["sharded_master_weights"][i]), i)
        self.assertEqual(load_json(os.path.join(back, "manifest.json"))["model"]["kv_size_multiplier"], 2)

    def test_the_job_config_gives_what_the_tag_does_not(self):
        """--config JOB.yaml: NxDT's model.model_config, kv_replicator, fuse_qkv and qkv_linear, checked against the data."""
        conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "hf_llama.yaml")
        with open(conf) as f:
            text = f.read()

        def job(name, kv="kv_replicator: 4", **changes):
            t = text.replace("model_config: hf_llama_config.json", "model_config: " + GQA_CONFIG).replace("num_layers: 2", "num_layers: 4")
            for key, value in changes.items():
                t = t.replace(key, value)
            path = os.path.join(self.dir, name + ".yaml")
            with open(path, "w") as f:
                f.write(t.replace("kv_replicator: 2", kv))
            return path

        src = os.path.join(TAGS, "trn1_tp8_pp2_kv4_fused")
        out = os.path.join(self.dir, "out")
        p = self.run_tool(RESHARD, src, out, "--config", job("good"), "--tp", "8", "--pp", "2", "--out_fuse_qkv", "false")
        self.assert_same_files(out, os.path.join(TAGS, "trn1_tp8_pp2_kv4_split"))
        p = self.run_tool(RESHARD, src, os.path.join(self.dir, "no"), "--config", job("m2", kv="kv_replicator: 2"), "--tp", "8", "--pp", "2",
                          code=2)
        self.assertIn("--kv_size_multiplier 2 contradicts the data", p.stderr)
        p = self.run_tool(RESHARD, src, os.path.join(self.dir, "no"), "--config", job("split", **{"fuse_qkv: True": "fuse_qkv: False"}),
                          "--tp", "8", "--pp", "2", code=2)
        self.assertIn("the job config says model.qkv_linear True, model.fuse_qkv False, but the tag holds "
                      "'self_attn.qkv_proj.weight_qkv'", p.stderr)
        p = self.run_tool(RESHARD, src, os.path.join(self.dir, "no"), "--config", job("bad_heads"), "--heads", "4", "--tp", "8", "--pp", "2",
                          code=2)
        self.assertIn("--heads 4 contradicts", p.stderr)
        # The YAML's model.num_layers overrides config.json's, as NxDT's _get_model does, and is checked against the tensors.
        p = self.run_tool(RESHARD, src, os.path.join(self.dir, "no"), "--config", job("layers", **{"num_layers: 4": "num_layers: 3"}),
                          "--tp", "8", "--pp", "2", code=2)
        self.assertIn("the given layer count is 3, but the tensors give 4", p.stderr)

    def test_a_tag_mixing_families_is_refused(self):
        tag = self.copy_tag("trn1_tp4_pp1_kv2_fused", "mixed")
        path = os.path.join(tag, "model", "dp_rank_00_tp_rank_02_pp_rank_00.pt")
        sd = torch.load(path)
        sd["language_model.encoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        torch.save(sd, path)
        out = os.path.join(self.dir, "out")
        p = self.run_tool(RESHARD, tag, out, "--model_config", GQA_CONFIG, "--tp", "2", "--pp", "1", "--out_kv_size_multiplier", "1", code=2)
        self.assertIn("dp_rank_00_tp_rank_02_pp_rank_00.pt: 'language_model.encoder.final_layernorm.weight' is a megatron name, but the "
                      "tag's model is hf_llama: a tag mixing model families is refused", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_the_converters_trn2_tag_is_read_as_trn1_and_refused_as_trn2(self):
        tag = os.path.join(TAGS, "trn2_tp4_pp1_kv2_fused_converter")
        out = os.path.join(self.dir, "x")
        p = self.run_tool(RESHARD, tag, out, "--model_config", GQA_CONFIG, "--tp", "4", "--pp", "1", "--dry_run")
        self.assertIn("kv_size_multiplier 2 and trn1 inferred from the data", p.stderr)
        p = self.run_tool(RESHARD, tag, out, "--model_config", GQA_CONFIG, "--tp", "4", "--pp", "1", "--hw_backend", "trn2", code=2)
        self.assertIn("--hw_backend trn2 contradicts the data", p.stderr)
        self.assertIn("writes Trn2 tags with the Trn1 rule", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_import_writes_what_the_converter_writes(self):
        """ckpt-import --model_source hf, given the converter's arguments, writes its files: same names, tensors, bytes."""
        gqa = os.path.join(HERE, "full_gqa", "checkpoint.pt")
        cases = [
            (gqa, GQA_CONFIG, ["--tp", "8", "--pp", "2", "--qkv_linear", "true", "--fuse_qkv", "true", "--kv_size_multiplier", "4"],
             "trn1_tp8_pp2_kv4_fused"),
            (gqa, GQA_CONFIG, ["--tp", "8", "--pp", "2", "--qkv_linear", "true", "--fuse_qkv", "false", "--kv_size_multiplier", "4"],
             "trn1_tp8_pp2_kv4_split"),
            (gqa, GQA_CONFIG, ["--tp", "4", "--pp", "1", "--qkv_linear", "true", "--kv_size_multiplier", "2", "--hw_backend", "trn2"],
             "trn2_tp4_pp1_kv2_fused_runtime_rule_shardkit"),
            (os.path.join(HERE, "full_mha", "checkpoint.pt"), MHA_CONFIG, ["--tp", "4", "--pp", "2"], "mha_tp4_pp2_stride3"),
        ]
        for src, config, flags, want in cases:
            out = os.path.join(self.dir, "imported_" + want)
            self.run_tool(IMPORT, src, out, "--format", "hf", "--model_source", "hf", "--model_config", config, *flags)
            self.assert_same_files(out, os.path.join(TAGS, want))
        # From an HF folder (our own export of the full state) too.
        folder = os.path.join(self.dir, "hf_folder")
        self.run_tool(EXPORT, os.path.join(TAGS, "trn1_tp4_pp1_kv2_fused"), folder, "--format", "hf", "--model_config", GQA_CONFIG)
        out = os.path.join(self.dir, "from_folder")
        self.run_tool(IMPORT, folder, out, "--format", "hf", "--model_source", "hf", "--tp", "4", "--pp", "1", "--qkv_linear", "true",
                      "--kv_size_multiplier", "2")
        self.assert_same_files(out, os.path.join(TAGS, "trn1_tp4_pp1_kv2_fused"))
        # A single file needs its config.
        p = self.run_tool(IMPORT, gqa, os.path.join(self.dir, "no_config"), "--format", "hf", "--model_source", "hf", "--tp", "1", "--pp", "1",
                          code=2)
        self.assertIn("needs --model_config", p.stderr)

    def test_full_state_export_is_the_converters_input(self):
        for tag, which in [("trn1_tp8_pp2_kv4_fused", "gqa"), ("mha_tp4_pp2_stride3", "mha")]:
            out = os.path.join(self.dir, "full_" + tag)
            self.run_tool(EXPORT, os.path.join(TAGS, tag), out, "--format", "full_state", "--model_config",
                          GQA_CONFIG if which == "gqa" else MHA_CONFIG)
            got, want = torch.load(os.path.join(out, "checkpoint.pt")), full_state(which)
            self.assertEqual(list(got), list(want))  # HF's names in HF's order
            for name, t in want.items():
                self.assertTrue(torch.equal(got[name], t), name)
            self.assertEqual(sorted(os.listdir(out)), ["checkpoint.pt", "config.json"])

    def with_zero1_optimizer(self, name, dp):
        """A copy of fixture `name` (pp 1) with ZeRO-1 optimizer files as NxD's NeuronZero1Optimizer saves them, grouped as NxDT
        grouped this model's parameters when run (optimizer_groups.json, do_layer_norm_weight_decay True: norms in group 1, group 0's
        weight_decay 0.01). Moments and masters are functions of the weight (exp_avg = w/2, exp_avg_sq = w^2, master = w), so
        every re-laid id can be checked against the weight it must belong to."""
        tag = self.copy_tag(name, "zero1_" + name)
        groups = load_json(os.path.join(HERE, "optimizer_groups.json"))["variants"]["gqa_qkv_linear_fused_tp8_kv4"]["pp1"][
            "do_layer_norm_weight_decay=true"]
        order = [n for g in groups for n in g["params"]]
        ids, at = [], 0
        for g in groups:
            ids.append(list(range(at, at + len(g["params"]))))
            at += len(g["params"])
        dummies = [{"params": [torch.nn.Parameter(torch.zeros(1))], "weight_decay": g["weight_decay"]} for g in groups]
        hyper = torch.optim.AdamW(dummies, lr=3e-4, betas=(0.9, 0.95), eps=1e-8).state_dict()["param_groups"]
        param_groups = [dict(h, params=i) for h, i in zip(hyper, ids)]

        def shard(x, d):
            pad = (-x.shape[0]) % dp
            x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))]) if pad else x
            return x.chunk(dp)[d].clone()

        os.makedirs(os.path.join(tag, "optim"))
        for (t, p), model in rank_files(tag).items():
            w = {n: model[n].float().contiguous() for n in order}
            for d in range(dp):
                osd = {"state": {}, "param_groups": param_groups,
                       "base_state": {i: {"step": torch.tensor(5.0), "exp_avg": shard(w[n] / 2, d), "exp_avg_sq": shard(w[n] ** 2, d)}
                                      for i, n in enumerate(order)},
                       "shape_info": {i: list(model[n].shape) for i, n in enumerate(order)},
                       "sharded_master_weights": {i: shard(w[n], d) for i, n in enumerate(order)}}
                torch.save(osd, os.path.join(tag, "optim", "dp_rank_%02d_tp_rank_%02d_pp_rank_%02d.pt" % (d, t, p)))
        open(os.path.join(tag, "done"), "w").close()  # NxD's save_checkpoint marks a finished tag so (trainer/checkpoint.py)
        return tag

    def test_zero1_optimizer_state_is_relaid_with_nxdts_hf_grouping(self):
        src = self.with_zero1_optimizer("trn1_tp4_pp1_kv2_fused", dp=2)
        out = os.path.join(self.dir, "tp8_pp2")
        self.run_tool(RESHARD, src, out, "--model_config", GQA_CONFIG, "--tp", "8", "--pp", "2", "--dp", "1",
                      "--out_kv_size_multiplier", "4")
        want_groups = load_json(os.path.join(HERE, "optimizer_groups.json"))["variants"]["gqa_qkv_linear_fused_tp8_kv4"]["pp2"]
        models = rank_files(out)
        for (t, p), model in models.items():
            osd = torch.load(os.path.join(out, "optim", "dp_rank_00_tp_rank_%02d_pp_rank_%02d.pt" % (t, p)))
            groups = want_groups["pp_rank_%d" % p]["do_layer_norm_weight_decay=true"]
            self.assertEqual([g["weight_decay"] for g in osd["param_groups"]], [g["weight_decay"] for g in groups])
            names = [n for g in groups for n in g["params"]]
            self.assertEqual([len(g["params"]) for g in osd["param_groups"]], [len(g["params"]) for g in groups])
            for i, n in enumerate(names):
                w = model[n].float()
                state = osd["base_state"][i]
                self.assertTrue(torch.equal(state["exp_avg"], w / 2), (t, p, i, n))
                self.assertTrue(torch.equal(state["exp_avg_sq"], w ** 2), (t, p, i, n))
                self.assertTrue(torch.equal(osd["sharded_master_weights"][i], w), (t, p, i, n))
                self.assertEqual(list(osd["shape_info"][i]), list(model[n].shape))
        # The weights are the converter's tp 8 pp 2 tag's.
        self.assert_same_files(out, os.path.join(TAGS, "trn1_tp8_pp2_kv4_fused"))

    def test_optimizer_grouped_otherwise_is_refused(self):
        src = self.with_zero1_optimizer("trn1_tp4_pp1_kv2_fused", dp=1)
        path = os.path.join(src, "optim", "dp_rank_00_tp_rank_01_pp_rank_00.pt")
        osd = torch.load(path)
        g0, g1 = osd["param_groups"]
        g0["params"], g1["params"] = g0["params"] + g1["params"][:1], g1["params"][1:]  # one norm moved into the decaying group
        torch.save(osd, path)
        p = self.run_tool(RESHARD, src, os.path.join(self.dir, "out"), "--model_config", GQA_CONFIG, "--tp", "2", "--pp", "1",
                          "--out_kv_size_multiplier", "1", code=2)
        self.assertIn("dp_rank_00_tp_rank_01_pp_rank_00.pt: its param_groups hold groups of sizes [19, 8] over the stage's 27 "
                      "parameters, which do not fit the grouping of the first optimizer file (nxdt-hf", p.stderr)

    def copy_tag(self, name, as_name):
        dst = os.path.join(self.dir, as_name)
        shutil.copytree(os.path.join(TAGS, name), dst)
        return dst

    def test_replicas_are_compared_not_trusted(self):
        for tensor, rank, what in [("model.layers.3.self_attn.qkv_proj.weight_qkv", 2, "tp ranks 0 and 2"),
                                   ("model.layers.1.post_attention_layernorm.weight", 3, "tp ranks 0 and 3")]:
            tag = self.copy_tag("trn1_tp4_pp1_kv2_fused", "copy_" + str(rank))
            path = os.path.join(tag, "model", "dp_rank_00_tp_rank_%02d_pp_rank_00.pt" % rank)
            sd = torch.load(path)
            t = sd[tensor]
            t.view(-1)[t.numel() - 1] += 1  # a KV row (the last row is V's) or a norm weight
            torch.save(sd, path)
            out = os.path.join(self.dir, "out")
            p = self.run_tool(RESHARD, tag, out, "--model_config", GQA_CONFIG, "--tp", "2", "--pp", "1", "--out_kv_size_multiplier", "1",
                              code=2)
            self.assertIn("'" + tensor + "' (param): " + what + " hold different copies", p.stderr)
            self.assertFalse(os.path.exists(out))
            self.run_tool(RESHARD, tag, out, "--model_config", GQA_CONFIG, "--tp", "2", "--pp", "1", "--out_kv_size_multiplier", "1",
                          "--trust_first_replica")
            shutil.rmtree(out)

    def test_hints_that_contradict_the_data_are_refused(self):
        tag = os.path.join(TAGS, "trn1_tp4_pp1_kv2_fused")
        out = os.path.join(self.dir, "out")
        p = self.run_tool(RESHARD, tag, out, "--model_config", GQA_CONFIG, "--kv_size_multiplier", "4", "--tp", "2", "--pp", "1", code=2)
        self.assertIn("--kv_size_multiplier 4 contradicts the data", p.stderr)
        self.assertIn("[[0, 2], [1, 3]]", p.stderr)
        config = load_json(GQA_CONFIG)
        config["intermediate_size"] = 128
        bad = os.path.join(self.dir, "config.json")
        json.dump(config, open(bad, "w"))
        p = self.run_tool(RESHARD, tag, out, "--model_config", bad, "--tp", "2", "--pp", "1", code=2)
        self.assertIn("FFN width (intermediate_size) is 128, but the tensors give 96", p.stderr)
        p = self.run_tool(RESHARD, tag, out, "--tp", "2", "--pp", "1", code=2)
        self.assertIn("give --heads, or --model_config", p.stderr)
        # m 2 at tp 2 is one KV head per rank too, but tp 8 with m 2 is not whole heads: refused with the multiplier that fits.
        p = self.run_tool(RESHARD, tag, out, "--model_config", GQA_CONFIG, "--tp", "8", "--pp", "1", code=2)
        self.assertIn("kv_size_multiplier 4 fits", p.stderr)
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main()

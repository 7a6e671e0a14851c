"""shardkit against LoRA fine-tuning tags NxD's own LoRA modules and
save_checkpoint wrote (tests/data/upstream/nxd_lora: NxD fbac349, NxDT 9169aa0,
run on CPU; see its README): the shipped config (tp 4, kv_replicator 2,
qkv_linear, fuse_qkv False, xser) and a model with adapters on every linear
layer (plain .pt), in NxD's three save modes.

  - ckpt-inspect names LoRA (rank, alpha, scale, targets, save mode), from
    the lora_config of NxD's tags or the manifest of shardkit's;
  - ckpt-reshard to tp 1 and back gives the tag's tensors bit for bit:
    adapters, their optimizer state (only theirs: the base is frozen), the
    KV rows of lora_B as the base's, and lora_config in every model file;
  - the adapters' rows are cut as their base's: W + scale * B A over the
    whole model, computed here from shardkit's tp 1 re-cut, equals shardkit's
    tp 1 re-cut of NxD's own per-rank merge (the merge_lora tag) within the
    rounding the computation allows;
  - the merged tag exports as a Hugging Face model (NxD's merge); a tag holding
    base and adapters exports merged, W + scale * B A in float32, equal to
    NxD's own merge within the bound the rounding allows (derived below); an
    adapter-only tag is refused, naming why.

The dev-time counterpart, NxD's load_checkpoint reading shardkit's re-cut,
is tests/data/upstream/nxd_lora/load_check.py (needs upstream source)."""
import json
import os
import unittest

import torch

from canon import EXPORT, INSPECT, RESHARD, VERIFY, TempDirTest, run
from hf_export import read_safetensors

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_lora")
HEADS = ["--heads", "8"]  # NxD records no model format; the fixture's model has 8 heads (README)
SCALE = 32 / 16  # lora_alpha / lora_rank


def tag(model, tp, mode):
    return os.path.join(DATA, f"{model}_tp{tp}", mode, "step_2")


def model_file(root, t=0):
    return torch.load(os.path.join(root, "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"))


def optim_file(root, t=0):
    return torch.load(os.path.join(root, "optim", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"))


class LoraTags(TempDirTest):
    def reshard(self, src, tp, name, *extra):
        out = os.path.join(self.dir, name)
        # kv_replicator 2 at tp 4 (Trn1), none at tp 1 and 2 (2 KV heads)
        kv = ["--out_kv_size_multiplier", "2", "--out_hw_backend", "trn1"] if tp == 4 else ["--out_kv_size_multiplier", "1"]
        run(RESHARD, src, out, "--tp", str(tp), "--pp", "1", *HEADS, *kv, *extra)
        return out

    def test_inspect_names_lora(self):
        for mode, says in (("base_adapter", "base and adapters"), ("merged", "adapters merged into the base")):
            p = run(INSPECT, tag("qkv", 4, mode))
            self.assertIn(f"model: LoRA rank 16, alpha 32 (scale 2) on qkv_proj; {says}", p.stdout)
        p = run(INSPECT, tag("all_targets", 4, "adapter_only"))
        self.assertIn("LoRA rank 16, alpha 32 (scale 2) on qkv_proj, down_proj, o_proj, gate_up_proj; adapters only", p.stdout)
        # a tag shardkit wrote records it in its manifest's model format
        p = run(INSPECT, self.reshard(tag("qkv", 4, "base_adapter"), 2, "tp2"))
        self.assertIn("HF-style llama", p.stdout)
        self.assertIn("LoRA rank 16, alpha 32 (scale 2) on qkv_proj; base and adapters", p.stdout)

    def test_verify_reads_both_containers(self):
        for mode in ("base_adapter", "merged"):
            run(VERIFY, tag("qkv", 4, mode), *HEADS)
        p = run(RESHARD, tag("qkv", 4, "merged"), os.path.join(self.dir, "m"), "--tp", "1", "--pp", "1", *HEADS,
                "--out_kv_size_multiplier", "1", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("saved with merged: its optimizer files hold the state of the training's parameters", p.stderr)

    def test_reshard_to_tp1_and_back_bit_for_bit(self):
        src = tag("all_targets", 4, "base_adapter")
        one = self.reshard(src, 1, "tp1")
        back = self.reshard(one, 4, "tp4")
        for t in range(4):
            a, b = model_file(src, t), model_file(back, t)
            self.assertEqual(sorted(a), sorted(b))
            self.assertEqual(a["lora_config"], b["lora_config"])
            for k, v in a.items():
                if k != "lora_config":
                    self.assertTrue(torch.equal(v, b[k]), k)
            oa, ob = optim_file(src, t), optim_file(back, t)
            self.assertEqual(oa["param_groups"], ob["param_groups"])
            self.assertEqual(sorted(oa["state"]), sorted(ob["state"]))  # the adapters' ids only
            for i, st in oa["state"].items():
                for key, v in st.items():
                    self.assertTrue(torch.equal(v, ob["state"][i][key]), (i, key))
        # the shipped config in xser: the same logical state after the round trip
        x = tag("qkv", 4, "base_adapter")
        run(VERIFY, self.reshard(self.reshard(x, 1, "x1"), 4, "x4"), "--against", x, *HEADS)

    def test_kv_rows_of_lora_b_follow_the_base(self):
        one = model_file(self.reshard(tag("all_targets", 4, "base_adapter"), 1, "tp1"))
        p = "model.layers.0.self_attn.qkv_proj."
        for t in range(4):  # Trn1, kv_replicator 2: rank t holds KV head t % 2, in lora_B as in the base
            local = model_file(tag("all_targets", 4, "base_adapter"), t)
            for w in ("base_layer.weight_k", "lora_B.weight_k", "lora_B.weight_v"):
                n = local[p + w].shape[0]
                self.assertTrue(torch.equal(local[p + w], one[p + w][(t % 2) * n:(t % 2 + 1) * n]), (t, w))
        self.assertEqual(tuple(one[p + "lora_B.weight_k"].shape), (8, 16))
        self.assertEqual(tuple(one[p + "lora_A.weight"].shape), (16, 32))

    def test_merge_of_the_recut_equals_nxds_merge(self):
        full = model_file(self.reshard(tag("all_targets", 4, "base_adapter"), 1, "adapters"))
        # NxD saves the training's optimizer with every mode; a merged tag's model is read alone
        merged = model_file(self.reshard(tag("all_targets", 4, "merged"), 1, "merged", "--weights_only"))
        self.assertEqual(merged["lora_config"]["merge_lora"], True)
        checked = 0
        for k, w in merged.items():
            stem = k[: -len(k.split(".")[-1])]
            leaf = k.split(".")[-1]
            if stem + "lora_A.weight" not in full:
                if k != "lora_config":
                    self.assertTrue(torch.equal(w, full[k]), k)  # untargeted: the base itself
                continue
            base, a, b = full[stem + "base_layer." + leaf], full[stem + "lora_A.weight"], full[stem + "lora_B." + leaf]
            mine = base + (b @ a) * SCALE
            # NxD merges per rank in float32: (B_r @ A_r) * scale summed in another order than
            # the whole B @ A, then added once; each side rounds the rank-16 dot products and the
            # sum, so they differ by a few float32 ulps of the result: allow 4 ulps of its largest
            # element (observed: within 2, tests/data/upstream/nxd_lora/check_full.out.txt).
            tol = 4 * torch.finfo(torch.float32).eps * float(w.abs().max())
            self.assertLessEqual(float((mine - w).abs().max()), tol, k)
            self.assertGreater(float((b @ a).abs().max()), 1e3 * tol, k)  # the adapter is not negligible
            checked += 1
        self.assertEqual(checked, 2 * 6)  # q, k, v, o_proj, gate_up_proj, down_proj per layer

    def test_hf_export_of_the_merged_tag(self):
        out = os.path.join(self.dir, "hf")
        run(EXPORT, tag("all_targets", 4, "merged"), out, "--format", "hf", *HEADS, "--weights_only")
        hf, _ = read_safetensors(os.path.join(out, "model.safetensors"))
        nxd = model_file(self.reshard(tag("all_targets", 4, "merged"), 1, "merged", "--weights_only"))
        self.assertTrue(torch.equal(hf["model.layers.1.mlp.down_proj.weight"], nxd["model.layers.1.mlp.down_proj.weight"]))
        self.assertTrue(torch.equal(hf["model.layers.0.self_attn.k_proj.weight"], nxd["model.layers.0.self_attn.qkv_proj.weight_k"]))

    def export_hf(self, model, mode, *extra):
        out = os.path.join(self.dir, f"hf_{model}_{mode}")
        run(EXPORT, tag(model, 4, mode), out, "--format", "hf", *HEADS, *extra)
        return read_safetensors(os.path.join(out, "model.safetensors"))[0]

    def assert_within_rounding(self, mine, nxd, a, b, name):
        # Both sides compute fl(W + fl(fl(B A) * scale)) in float32 (scale 2 is exact), NxD per
        # rank, shardkit on the logical rows: each rank-r dot product is off its exact value by
        # at most gamma_r * sum_k |B_ik| |A_kj| (gamma_r = r u / (1 - r u), u = 2^-24), the add
        # by u |result|. Their difference is at most twice that, per element:
        u = 2.0 ** -24  # float32's unit roundoff
        r = a.shape[0]
        gamma = r * u / (1 - r * u)
        bound = 2 * (gamma * SCALE * (b.double().abs() @ a.double().abs()) + u * torch.maximum(mine.abs(), nxd.abs()).double())
        self.assertTrue(bool(((mine.double() - nxd.double()).abs() <= bound).all()), name)
        return bound

    def check_hf_merge_equals_nxds(self, model, targeted, peft=None):
        """shardkit's HF export of the tp 4 base-and-adapter tag (merged while
        streaming) against its export of NxD's own per-rank merge (the merged tag)."""
        ours = self.export_hf(model, "base_adapter")
        nxd = self.export_hf(model, "merged", "--weights_only")
        self.assertEqual(list(ours), list(nxd))
        full = model_file(self.reshard(tag(model, 4, "base_adapter"), 1, f"adapters_{model}", "--no_save_xser"))  # B and A, logical
        F = 48  # ffn (README): gate_proj is gate_up_proj's rows [0, F), up_proj [F, 2F)
        where = {"q_proj": ("self_attn.qkv_proj.", "weight_q", None), "k_proj": ("self_attn.qkv_proj.", "weight_k", None),
                 "v_proj": ("self_attn.qkv_proj.", "weight_v", None), "o_proj": ("self_attn.o_proj.", "weight", None),
                 "gate_proj": ("mlp.gate_up_proj.", "weight", slice(0, F)), "up_proj": ("mlp.gate_up_proj.", "weight", slice(F, 2 * F)),
                 "down_proj": ("mlp.down_proj.", "weight", None)}
        merged = 0
        for name, w in ours.items():
            self.assertEqual(w.dtype, torch.float32, name)  # the base's dtype (README: float32)
            module = name.split(".")[-2]
            prefix = ".".join(name.split(".")[:3]) + "."  # model.layers.N.
            if module not in targeted:
                self.assertTrue(torch.equal(w, nxd[name]), name)  # untargeted: the base, bit for bit
                continue
            stem, leaf, rows = where[module]
            b, a = full[prefix + stem + "lora_B." + leaf], full[prefix + stem + "lora_A.weight"]
            base = full[prefix + stem + "base_layer." + leaf]
            if rows is not None:
                b, base = b[rows], base[rows]
            bound = self.assert_within_rounding(w, nxd[name], a, b, name)
            # and the merge happened: the adapter moves the weight far past the bound
            self.assertGreater(float((w - base).abs().max()), 1e3 * float(bound.max()), name)
            if peft is not None:  # peft's adapter applied to the base by the merge formula
                stem = "base_model.model." + name[: -len(".weight")]
                pa, pb = peft[stem + ".lora_A.weight"], peft[stem + ".lora_B.weight"]
                self.assertTrue(torch.equal(pa, a) and torch.equal(pb, b), name)
                self.assert_within_rounding(base + (pb @ pa) * SCALE, nxd[name], pa, pb, name)
            merged += 1
        return merged

    def test_hf_export_merges_the_shipped_configs_adapters_as_nxd_does(self):
        # qkv_proj only, xser, kv_replicator 2: q, k, v of both layers
        self.assertEqual(self.check_hf_merge_equals_nxds("qkv", {"q_proj", "k_proj", "v_proj"}), 2 * 3)

    def test_hf_export_merges_row_and_column_parallel_adapters_as_nxd_does(self):
        targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        self.assertEqual(self.check_hf_merge_equals_nxds("all_targets", targets), 2 * 7)

    def test_peft_adapter_applied_to_the_base_gives_nxds_merge(self):
        out = os.path.join(self.dir, "peft")
        run(EXPORT, tag("all_targets", 4, "base_adapter"), out, "--format", "peft", *HEADS)
        with open(os.path.join(out, "adapter_config.json")) as f:
            config = json.load(f)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        self.assertEqual((config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]), ("LORA", 16, 32, False))
        self.assertEqual(config["target_modules"], targets)  # HF's module order
        peft, header = read_safetensors(os.path.join(out, "adapter_model.safetensors"))
        self.assertEqual(len(peft), 2 * 7 * 2)  # lora_A and lora_B of 7 modules in 2 layers
        self.assertEqual(header["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]["shape"], [8, 16])
        self.assertEqual(header["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"]["shape"], [16, 32])
        self.assertEqual(self.check_hf_merge_equals_nxds("all_targets", set(targets), peft), 2 * 7)
        # the shipped config: q, k and v share NxD's one lora_A
        out = os.path.join(self.dir, "peft_qkv")
        run(EXPORT, tag("qkv", 4, "base_adapter"), out, "--format", "peft", *HEADS)
        peft, _ = read_safetensors(os.path.join(out, "adapter_model.safetensors"))
        self.assertEqual(self.check_hf_merge_equals_nxds("qkv", {"q_proj", "k_proj", "v_proj"}, peft), 2 * 3)

    def test_peft_export_of_a_merged_tag_is_refused(self):
        out = os.path.join(self.dir, "no")
        p = run(EXPORT, tag("qkv", 4, "merged"), out, "--format", "peft", *HEADS, "--weights_only", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("has them merged", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_hf_export_of_an_adapter_only_tag_is_refused(self):
        out = os.path.join(self.dir, "no")
        p = run(EXPORT, tag("qkv", 4, "adapter_only"), out, "--format", "hf", *HEADS, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("adapter-only LoRA tag", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_adapter_only_is_refused_naming_what_is_missing(self):
        p = run(RESHARD, tag("qkv", 4, "adapter_only"), os.path.join(self.dir, "out"), "--tp", "1", "--pp", "1", *HEADS, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("adapter-only LoRA tag", p.stderr)
        self.assertIn("no base weights", p.stderr)


if __name__ == "__main__":
    unittest.main()

"""shardkit against adapter-only LoRA tags (NxD's save_lora_base False, NxDT's
default) that NxD's own LoRA modules and save_checkpoint wrote
(tests/data/upstream/nxd_lora, README there): the shipped config (tp 4,
kv_replicator 2, qkv_linear, xser) and adapters on every linear layer (.pt).

  - the model's sizes come from the adapters' shapes and, for what no
    adapter holds (the vocabulary; the FFN width when no MLP is targeted),
    from --model_config (the base's HF config.json); refused naming the size
    none gives;
  - ckpt-inspect and ckpt-verify (--against) read them; ckpt-reshard re-cuts
    them to tp 1 and back (and over pp 2) bit for bit, the adapters'
    optimizer state and lora_config (lora_dropout included) carried, lora_B's
    KV rows placed as the base's replication places them;
  - --format peft writes the same folder as the base-and-adapter tag's;
  - --format hf --lora_base BASE (an HF folder or a tag) merges them into
    BASE, bit for bit the merged export of the tag that saved both, and in
    bfloat16 within the rounding the merge allows; refused without a base or
    with one the adapters do not fit, naming what is missing or the tensor.
"""
import filecmp
import json
import os
import shutil
import unittest

import torch

from canon import EXPORT, INSPECT, RESHARD, VERIFY, TempDirTest, run
from hf_export import read_safetensors

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_lora")
HEADS = ["--heads", "8"]  # NxD records no model format; the fixture's model has 8 heads (README)
SCALE = 32 / 16  # lora_alpha / lora_rank
# The fixture's model (README): what its base's config.json says.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
          "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
          "hidden_act": "silu"}


def tag(model, tp, mode):
    return os.path.join(DATA, f"{model}_tp{tp}", mode, "step_2")


def rank_file(root, kind, t=0, p=0):
    return torch.load(os.path.join(root, kind, f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"))


def assert_same_files(test, a, b, tp, pp=1):
    """Every model and optimizer file of a and b: the same keys, lora_config, tensors and state."""
    for p in range(pp):
        for t in range(tp):
            ma, mb = rank_file(a, "model", t, p), rank_file(b, "model", t, p)
            test.assertEqual(sorted(ma), sorted(mb), (t, p))
            test.assertEqual(ma["lora_config"], mb["lora_config"])  # every field, lora_dropout included
            for k, v in ma.items():
                if k != "lora_config":
                    test.assertTrue(torch.equal(v, mb[k]), (t, p, k))
            oa, ob = rank_file(a, "optim", t, p), rank_file(b, "optim", t, p)
            test.assertEqual(oa["param_groups"], ob["param_groups"])
            test.assertEqual(sorted(oa["state"]), sorted(ob["state"]))
            for i, st in oa["state"].items():
                for key, v in st.items():
                    test.assertTrue(torch.equal(v, ob["state"][i][key]), (t, p, i, key))


class AdapterOnlyTags(TempDirTest):
    def setUp(self):
        super().setUp()
        self.config = os.path.join(self.dir, "config.json")
        with open(self.config, "w") as f:
            json.dump(CONFIG, f)
        self.hints = HEADS + ["--model_config", self.config]

    def reshard(self, src, tp, name, *extra, pp=1):
        out = os.path.join(self.dir, name)
        # kv_replicator 2 at tp 4 (Trn1), none at tp 1 and 2 (2 KV heads)
        kv = ["--out_kv_size_multiplier", "2", "--out_hw_backend", "trn1"] if tp == 4 else ["--out_kv_size_multiplier", "1"]
        run(RESHARD, src, out, "--tp", str(tp), "--pp", str(pp), *self.hints, *kv, *extra)
        return out

    def test_inspect_and_verify_read_them(self):
        for model in ("qkv", "all_targets"):
            p = run(INSPECT, tag(model, 4, "adapter_only"))
            self.assertIn("; adapters only", p.stdout)
            run(VERIFY, tag(model, 4, "adapter_only"), *self.hints)
        # a tag shardkit re-cut records the format: read again without hints, and against the source
        one = self.reshard(tag("qkv", 4, "adapter_only"), 1, "tp1")
        p = run(INSPECT, one)
        self.assertIn("LoRA rank 16, alpha 32 (scale 2) on qkv_proj; adapters only", p.stdout)
        run(VERIFY, one, "--against", tag("qkv", 4, "adapter_only"), *self.hints)

    def test_a_size_no_adapter_gives_is_refused_by_name(self):
        # qkv_proj's adapters tell the hidden size and the heads' rows, not the FFN width
        out = os.path.join(self.dir, "out")
        recut = [out, "--tp", "1", "--pp", "1", "--out_kv_size_multiplier", "1", *HEADS]
        p = run(RESHARD, tag("qkv", 4, "adapter_only"), *recut, "--vocab_size", "64", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("adapter-only LoRA tag", p.stderr)
        self.assertIn("the FFN width (intermediate_size)", p.stderr)
        # down_proj's do; no adapter holds the vocabulary
        p = run(RESHARD, tag("all_targets", 4, "adapter_only"), *recut, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("the vocabulary size", p.stderr)
        self.assertFalse(os.path.exists(out))
        run(RESHARD, tag("all_targets", 4, "adapter_only"), *recut, "--vocab_size", "64")
        with open(os.path.join(out, "manifest.json")) as f:
            self.assertEqual(json.load(f)["model"]["ffn_hidden_size"], 48)  # from down_proj's lora_A

    def test_reshard_to_tp1_and_back_bit_for_bit(self):
        src = tag("all_targets", 4, "adapter_only")
        one = self.reshard(src, 1, "tp1")
        assert_same_files(self, src, self.reshard(one, 4, "tp4"), 4)
        # the adapters are the base-and-adapter tag's (one training, saved twice): its re-cut's adapters, every one
        both = rank_file(self.reshard(tag("all_targets", 4, "base_adapter"), 1, "both"), "model")
        mine = rank_file(one, "model")
        self.assertEqual(len(mine), 1 + 2 * 10)  # lora_config; per layer qkv_proj's A and 3 B's, A and B of 3 modules ...
        for k, v in mine.items():
            if k != "lora_config":
                self.assertTrue(torch.equal(v, both[k]), k)
        # ... and the tp 1 fixture's where both runs cut alike (README: K/V rows, qkv_proj's lora_A, down_proj)
        full = rank_file(tag("all_targets", 1, "adapter_only"), "model")
        for layer in range(2):
            for leaf in ("self_attn.qkv_proj.lora_A.weight", "self_attn.qkv_proj.lora_B.weight_k", "self_attn.qkv_proj.lora_B.weight_v",
                         "mlp.down_proj.lora_A.weight", "mlp.down_proj.lora_B.weight"):
                k = f"model.layers.{layer}.{leaf}"
                self.assertTrue(torch.equal(mine[k], full[k]), k)
        # the shipped config, xser: the same logical state after the round trip
        x = tag("qkv", 4, "adapter_only")
        run(VERIFY, self.reshard(self.reshard(x, 1, "x1"), 4, "x4"), "--against", x, *self.hints)

    def test_optimizer_lists_the_training_and_keeps_the_adapters_state(self):
        src = tag("all_targets", 4, "adapter_only")
        one = self.reshard(src, 1, "tp1")
        o, base = rank_file(one, "optim"), rank_file(tag("all_targets", 4, "base_adapter"), "optim")
        # NxD's optimizer lists base and adapters whatever the save mode: as many ids as the training's parameters
        self.assertEqual(sum(len(g["params"]) for g in o["param_groups"]), sum(len(g["params"]) for g in base["param_groups"]))
        self.assertEqual(len(o["state"]), 2 * 10)  # the adapters' only (per layer: qkv_proj's A and 3 B's, 3 A and B pairs)
        for st in o["state"].values():
            self.assertEqual(set(st), {"step", "exp_avg", "exp_avg_sq"})

    def test_kv_rows_of_lora_b_follow_the_base_replication(self):
        one_dir = self.reshard(tag("qkv", 4, "adapter_only"), 1, "tp1", "--no_save_xser")
        one = rank_file(one_dir, "model")
        back = self.reshard(one_dir, 4, "tp4", "--no_save_xser")
        p = "model.layers.1.self_attn.qkv_proj.lora_B."
        self.assertEqual(tuple(one[p + "weight_k"].shape), (8, 16))  # 2 KV heads of head_dim 4, rank 16
        for t in range(4):  # Trn1, kv_replicator 2: rank t holds KV head t % 2, in lora_B as in the base
            local = rank_file(back, "model", t)
            for w in ("weight_k", "weight_v"):
                self.assertTrue(torch.equal(local[p + w], one[p + w][(t % 2) * 4:(t % 2 + 1) * 4]), (t, w))

    def test_pipeline_recut_and_back(self):
        one = self.reshard(tag("all_targets", 4, "adapter_only"), 1, "tp1")
        two = self.reshard(one, 2, "tp2pp2", pp=2)
        self.assertIn("model.layers.1.self_attn.qkv_proj.lora_A.weight", rank_file(two, "model", 0, 1))
        self.assertNotIn("model.layers.0.self_attn.qkv_proj.lora_A.weight", rank_file(two, "model", 0, 1))
        assert_same_files(self, one, self.reshard(two, 1, "back"), 1)

    def test_peft_export_is_the_base_and_adapter_tags(self):
        for model in ("qkv", "all_targets"):
            outs = []
            for mode in ("base_adapter", "adapter_only"):
                outs.append(os.path.join(self.dir, f"peft_{model}_{mode}"))
                run(EXPORT, tag(model, 4, mode), outs[-1], "--format", "peft", *self.hints)
            for f in ("adapter_model.safetensors", "adapter_config.json"):
                self.assertTrue(filecmp.cmp(os.path.join(outs[0], f), os.path.join(outs[1], f), shallow=False), (model, f))
            with open(os.path.join(outs[1], "adapter_config.json")) as f:
                self.assertEqual(json.load(f)["lora_dropout"], 0.05)  # the tag's lora_config's (README)

    def stripped_base(self, name, src):
        """The base model alone, as a plain NxD tag: src's model files without adapters and lora_config,
        base_layer names restored (what the fine-tuning started from), no optimizer."""
        out = os.path.join(self.dir, name)
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("optim", "manifest.json"))
        for f in os.listdir(os.path.join(out, "model")):
            path = os.path.join(out, "model", f)
            sd = torch.load(path)
            base = type(sd)((k.replace(".base_layer.", "."), v) for k, v in sd.items() if k != "lora_config" and ".lora_" not in k)
            torch.save(base, path)
        return out

    def export_hf(self, src, name, *extra):
        out = os.path.join(self.dir, name)
        run(EXPORT, src, out, "--format", "hf", *self.hints, *extra)
        return out

    def safetensors_equal(self, a, b):
        return filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(b, "model.safetensors"), shallow=False)

    def test_merge_into_a_given_base_equals_the_merged_export(self):
        base_tag = self.stripped_base("base", tag("all_targets", 4, "base_adapter"))
        want = self.export_hf(tag("all_targets", 4, "base_adapter"), "want")
        got = self.export_hf(tag("all_targets", 4, "adapter_only"), "from_tag", "--lora_base", base_tag)
        self.assertTrue(self.safetensors_equal(want, got))
        base_hf = self.export_hf(base_tag, "base_hf")
        self.assertFalse(self.safetensors_equal(want, base_hf))  # the base alone is not the merge
        got = self.export_hf(tag("all_targets", 4, "adapter_only"), "from_hf", "--lora_base", base_hf)
        self.assertTrue(self.safetensors_equal(want, got))
        # the shipped config (xser, kv_replicator 2): its base re-cut to .pt files, exported to an HF folder
        qkv_base = self.export_hf(self.stripped_base("qkv_base", self.reshard(tag("qkv", 4, "base_adapter"), 4, "qkv_pt", "--no_save_xser")), "qkv_hf")
        want = self.export_hf(tag("qkv", 4, "base_adapter"), "qkv_want")
        self.assertTrue(self.safetensors_equal(want, self.export_hf(tag("qkv", 4, "adapter_only"), "qkv_got", "--lora_base", qkv_base)))

    def test_hf_export_without_a_base_is_refused_naming_it(self):
        out = os.path.join(self.dir, "no")
        p = run(EXPORT, tag("qkv", 4, "adapter_only"), out, "--format", "hf", *self.hints, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("needs the base weights to merge the adapters into", p.stderr)
        self.assertIn("--lora_base", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_a_base_the_adapters_do_not_fit_is_refused_naming_the_tensor(self):
        # an HF Llama of hidden 64 (8 heads of 8): qkv_proj's adapters are [16, 32] and [.., 16]
        folder = os.path.join(self.dir, "wide")
        os.makedirs(folder)
        cfg = dict(CONFIG, hidden_size=64)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
        H, F, V, KV = 64, 48, 64, 2 * 8
        sd = {"model.embed_tokens.weight": torch.zeros(V, H), "model.norm.weight": torch.ones(H), "lm_head.weight": torch.zeros(V, H)}
        for i in range(2):
            p = f"model.layers.{i}."
            sd.update({p + "self_attn.q_proj.weight": torch.zeros(H, H), p + "self_attn.k_proj.weight": torch.zeros(KV, H),
                       p + "self_attn.v_proj.weight": torch.zeros(KV, H), p + "self_attn.o_proj.weight": torch.zeros(H, H),
                       p + "mlp.gate_proj.weight": torch.zeros(F, H), p + "mlp.up_proj.weight": torch.zeros(F, H),
                       p + "mlp.down_proj.weight": torch.zeros(H, F), p + "input_layernorm.weight": torch.ones(H),
                       p + "post_attention_layernorm.weight": torch.ones(H)})
        torch.save(sd, os.path.join(folder, "pytorch_model.bin"))
        out = os.path.join(self.dir, "no")
        p = run(EXPORT, tag("qkv", 4, "adapter_only"), out, "--format", "hf", *HEADS, "--lora_base", folder, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("the base's model.layers.0.self_attn.q_proj.weight is", p.stderr)
        self.assertIn("fit", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_bf16_merge_within_the_rounding(self):
        # the base hand-cast to bfloat16 (the tool has no dtype option); the adapters stay float32
        base = self.stripped_base("base", tag("all_targets", 4, "base_adapter"))
        for f in os.listdir(os.path.join(base, "model")):
            path = os.path.join(base, "model", f)
            sd = torch.load(path)
            torch.save(type(sd)((k, v.to(torch.bfloat16)) for k, v in sd.items()), path)
        got, _ = read_safetensors(os.path.join(self.export_hf(tag("all_targets", 4, "adapter_only"), "bf16", "--lora_base", base), "model.safetensors"))
        w = read_safetensors(os.path.join(self.export_hf(base, "base_hf"), "model.safetensors"))[0]
        peft_dir = os.path.join(self.dir, "peft")
        run(EXPORT, tag("all_targets", 4, "adapter_only"), peft_dir, "--format", "peft", *self.hints)
        peft, _ = read_safetensors(os.path.join(peft_dir, "adapter_model.safetensors"))
        merged = 0
        for name, x in got.items():
            self.assertEqual(x.dtype, torch.bfloat16, name)
            stem = "base_model.model." + name[: -len(".weight")]
            if stem + ".lora_A.weight" not in peft:
                self.assertTrue(torch.equal(x, w[name]), name)  # untargeted: the base, bit for bit
                continue
            a, b = peft[stem + ".lora_A.weight"].double(), peft[stem + ".lora_B.weight"].double()
            exact = w[name].double() + (b @ a) * SCALE
            # shardkit computes y = fl32(W + fl32(fl32(B A) * scale)) and rounds y once to bfloat16. In float32
            # (u = 2^-24) the rank-r dot products are off by at most gamma_r sum_k |B_ik||A_kj| (gamma_r =
            # r u / (1 - r u)), the add by u |y|; the one rounding to bfloat16 (8 significant bits: unit
            # roundoff 2^-8) adds at most 2^-8 |y|. So |out - exact| <= e32 + 2^-8 (|exact| + e32).
            u, r = 2.0 ** -24, a.shape[0]
            gamma = r * u / (1 - r * u)
            e32 = gamma * SCALE * (b.abs() @ a.abs()) + u * (exact.abs() + 1e-30)
            bound = e32 + 2.0 ** -8 * (exact.abs() + e32)
            self.assertTrue(bool(((x.double() - exact).abs() <= bound).all()), name)
            self.assertFalse(torch.equal(x, w[name]), name)  # the merge moved it
            merged += 1
        self.assertEqual(merged, 2 * 7)


if __name__ == "__main__":
    unittest.main()

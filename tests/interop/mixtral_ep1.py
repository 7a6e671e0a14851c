"""The Mixtral (MoE) tags NxD's own code wrote at ep 1 (tests/data/upstream/nxd_mixtral:
tp 2, dp 2, ZeRO-1 NeuronZero1Optimizer, fp64 moments; see its README), both styles,
through every command at any tp. Issue #38, at ep 1.

  - Megatron-style (NxDT NeuronSwitchMLP) model: ckpt-reshard --weights_only tp 2 -> tp 1
    gives the gathered full state bit for bit, tp 1 -> tp 2 gives NxD's files back, and
    ckpt-verify --against says the round trip holds the same model;
  - optimizer state, both styles, plain and xser, and the moe_frequency 2 tags (dense and
    MoE layers mixed): tp 2 dp 2 -> tp 1 at dp 1 and dp 2 gives the full state's moments
    (ZeRO-1: chunks of the local tensor's dim 0, a 3-D expert tensor's too, as torch-xla
    cuts them, README "Layout facts"), and back to tp 2 dp 2 gives NxD's
    optimizer files, moments included; ckpt-verify says ok on NxD's tags and --against
    says the round trip equal;
  - HF: ckpt-export --format hf of the tp 2 tags equals hf_reference/ep1; ckpt-import of
    it into tp 2 of either style, resharded to tp 1, equals the import at tp 1.

The truth is the full state the upstream run gathered (and the README's layout facts
where NxD's gather differs from the tp 1 tensor: Megatron's dense dense_h_to_4h, whose
rank rows are each rank's own [gate ; up]), never anything computed here from shardkit."""
import json
import os
import unittest

import torch

from canon import EXPORT, IMPORT, RESHARD, TempDirTest, VERIFY, run
from mixtral_tags import DATA, copy_tag

TP, DP = 2, 2
TAGS = {  # name: (tag, style, full state)
    "hf_ep1_pt": ("hf_ep1_pt", "hf", "hf_ep1"),
    "hf_ep1_xser": ("hf_ep1_xser", "hf", "hf_ep1"),
    "megatron_ep1_pt": ("megatron_ep1_pt", "megatron", "megatron_ep1"),
    "megatron_ep1_xser": ("megatron_ep1_xser", "megatron", "megatron_ep1"),
    "hf_freq2_ep1_pt": ("hf_freq2_ep1_pt", "hf", "hf_freq2_ep1"),
    "megatron_freq2_ep1_pt": ("megatron_freq2_ep1_pt", "megatron", "megatron_freq2_ep1"),
}
BUFFER = "rotary_emb.inv_freq"  # Megatron's persistent buffer: in the model files, not an optimizer parameter


def full_state(name):
    return torch.load(os.path.join(DATA, TAGS[name][2] + "_full_state.pt"))


def hints(name):
    """What no tensor shows, as the run's config (in its full state) records it."""
    cfg = full_state(name)["config"]
    if TAGS[name][1] == "hf":
        return ["--heads", cfg["num_attention_heads"], "--moe_top_k", cfg["num_experts_per_tok"],
                "--rope_theta", cfg["rope_theta"], "--layernorm_epsilon", cfg["rms_norm_eps"]]
    m = cfg["model"]
    return ["--heads", m["num_attention_heads"], "--kv_heads", m["num_kv_heads"], "--moe_top_k", m["moe"]["top_k"],
            "--layernorm_epsilon", m["layernorm_epsilon"]]


def tp1_tensor(key, full):
    """The tp 1 tensor of NxD's gathered `full`: the same, except Megatron's dense dense_h_to_4h,
    gathered with stride 1 while each tp rank's rows are its own [gate ; up] (README, "Which
    layers are MoE"): at tp 1 they are [gate ; up] of the whole."""
    if not key.endswith("mlp.dense_h_to_4h.weight"):
        return full
    rows, cols = full.shape
    return full.reshape(TP, 2, rows // (2 * TP), cols).transpose(0, 1).reshape(rows, cols)


def model_rel(t):
    return f"model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"


def optim_rel(d, t):
    return f"optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt"


def parameter_names(tag):
    """The optimizer's ids, in named_parameters order: tp rank 0's model file keys less the buffer."""
    return [k for k in torch.load(os.path.join(tag, model_rel(0))) if BUFFER not in k]


def states(opt):
    """id -> AdamW entry: ZeRO-1's base_state or torch's state."""
    return opt["base_state"] if "base_state" in opt else opt["state"]


def read_json(path):
    with open(path) as f:
        return json.load(f)


def bits(x):
    return x.contiguous().view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8)


class MixtralEp1(TempDirTest):
    def copy(self, name):
        return copy_tag(os.path.join(TAGS[name][0], "step_2"), os.path.join(self.dir, name))

    def pt_twin(self, name):
        """NxD's plain .pt tag of the run (an xser tag holds the same state, README)."""
        return os.path.join(DATA, TAGS[name][0].replace("_xser", "_pt"), "step_2")

    def assert_equal_tensor(self, got, want, at):
        self.assertEqual((got.dtype, tuple(got.shape)), (want.dtype, tuple(want.shape)), at)
        self.assertTrue(torch.equal(bits(got), bits(want)), at)

    def reshard(self, src, dst, tp, dp, *extra):
        """Written as plain .pt (an xser source's output would be xser), so torch reads it here."""
        run(RESHARD, src, dst, "--tp", tp, "--pp", 1, "--dp", dp, "--no_save_xser", *extra)
        return dst

    def check_tp1_model(self, name, tag):
        full = full_state(name)["model"]
        got = torch.load(os.path.join(tag, model_rel(0)))
        self.assertEqual(sorted(got), sorted(full))
        for key, want in full.items():
            with self.subTest(tag=name, tensor=key):
                self.assert_equal_tensor(got[key], tp1_tensor(key, want), key)

    def check_same_files(self, name, got_tag, rels, field_of=None):
        """Each file of `rels` in got_tag equals NxD's (its .pt twin), key by key; optimizer files compared by field_of."""
        want_tag = self.pt_twin(name)
        for rel in rels:
            want, got = torch.load(os.path.join(want_tag, rel)), torch.load(os.path.join(got_tag, rel))
            if field_of:
                field_of(want, got, rel)
                continue
            self.assertEqual(list(got), list(want), rel)
            for key in want:
                with self.subTest(tag=name, file=rel, tensor=key):
                    self.assert_equal_tensor(got[key], want[key], f"{rel} {key}")

    # --- 1. Megatron-style weights at any tp ---

    def test_megatron_weights_round_trip_through_tp_1(self):
        for name in ("megatron_ep1_pt", "megatron_ep1_xser"):
            src = self.copy(name)
            tp1 = self.reshard(src, os.path.join(self.dir, name + "_tp1"), 1, 1, "--weights_only", *hints(name))
            self.check_tp1_model(name, tp1)
            tp2 = self.reshard(tp1, os.path.join(self.dir, name + "_tp2"), TP, 1, "--weights_only")
            self.check_same_files(name, tp2, [model_rel(t) for t in range(TP)])
            run(VERIFY, tp2)
            p = run(VERIFY, tp2, "--against", src, "--weights_only", *hints(name), check=False)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    # --- 2. the optimizer state at ep 1 ---

    def check_tp1_moments(self, name, tag, dp):
        full = full_state(name)["optimizer"]
        names = parameter_names(tag)
        self.assertEqual(sorted(names), sorted(full))
        checked = 0
        for d in range(dp):
            opt = torch.load(os.path.join(tag, optim_rel(d, 0)))
            self.assertEqual(sorted(states(opt)), list(range(len(names))))
            for i, key in enumerate(names):
                entry = states(opt)[i]
                for field in ("exp_avg", "exp_avg_sq"):
                    want = tp1_tensor(key, full[key][field])
                    if dp > 1:  # ZeRO-1: chunk d of dim 0, padded to dp chunks (torch-xla)
                        rows = -(-want.shape[0] // dp)
                        want = want[d * rows:(d + 1) * rows]
                        self.assertEqual(list(opt["shape_info"][i]), list(full[key][field].shape))
                    with self.subTest(tag=name, dp=d, tensor=key, field=field):
                        self.assert_equal_tensor(entry[field], want, f"{key} {field}")
                    checked += 1
                self.assertTrue(torch.equal(torch.as_tensor(entry["step"]), torch.as_tensor(full[key]["step"])), key)
        self.assertEqual(checked, 2 * len(full) * dp)

    def same_optimizer(self, want, got, rel):
        self.assertEqual(sorted(got), sorted(want), rel)
        self.assertEqual(got["param_groups"], want["param_groups"], rel)
        self.assertEqual({i: list(s) for i, s in got["shape_info"].items()}, {i: list(s) for i, s in want["shape_info"].items()}, rel)
        self.assertEqual(sorted(got["base_state"]), sorted(want["base_state"]), rel)
        for i, entry in want["base_state"].items():
            for field in ("exp_avg", "exp_avg_sq"):
                with self.subTest(file=rel, id=i, field=field):
                    self.assert_equal_tensor(got["base_state"][i][field], entry[field], f"{rel} {i} {field}")

    def optimizer_round_trip(self, name):
        src = self.copy(name)
        run(VERIFY, src)  # NxD's own tag: ok
        for dp in (2, 1):
            tp1 = self.reshard(src, os.path.join(self.dir, f"{name}_tp1_dp{dp}"), 1, dp, *hints(name))
            self.check_tp1_model(name, tp1)
            self.check_tp1_moments(name, tp1, dp)
        tp2 = self.reshard(tp1, os.path.join(self.dir, name + "_tp2"), TP, DP)  # from tp 1 dp 1
        self.check_same_files(name, tp2, [optim_rel(d, t) for d in range(DP) for t in range(TP)], self.same_optimizer)
        self.check_same_files(name, tp2, [model_rel(t) for t in range(TP)])
        p = run(VERIFY, tp2, "--against", src, *hints(name), check=False)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_hf_optimizer_round_trip(self):
        for name in ("hf_ep1_pt", "hf_ep1_xser"):
            self.optimizer_round_trip(name)

    def test_megatron_optimizer_round_trip(self):
        for name in ("megatron_ep1_pt", "megatron_ep1_xser"):
            self.optimizer_round_trip(name)

    def test_dense_and_moe_layers_mixed(self):
        for name in ("hf_freq2_ep1_pt", "megatron_freq2_ep1_pt"):
            self.optimizer_round_trip(name)

    def test_verify_against_tells_a_changed_moment(self):
        name = "hf_ep1_pt"
        src = self.copy(name)
        tp1 = self.reshard(src, os.path.join(self.dir, "tp1"), 1, 1, *hints(name))
        rel = os.path.join(tp1, optim_rel(0, 0))
        opt = torch.load(rel)
        gate_up = parameter_names(tp1).index("model.layers.1.mlp.expert_mlps.mlp_op.gate_up_proj.weight")
        states(opt)[gate_up]["exp_avg_sq"][3, 15, 63] += 1.0  # the last expert's last up column
        torch.save(opt, rel)
        os.remove(os.path.join(tp1, "manifest.json"))  # its checksum would tell the file, not the tensor
        p = run(VERIFY, tp1, "--against", src, *hints(name), check=False)
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("model.layers.1.mlp.expert_mlps.mlp_op.gate_up_proj.weight", p.stdout + p.stderr)


    # --- 3. Hugging Face's MixtralForCausalLM at tp > 1 ---

    def test_hf_export_of_the_tp_2_tags_is_the_reference_folder(self):
        ref = os.path.join(DATA, "hf_reference", "ep1")
        want = torch.load(os.path.join(ref, "pytorch_model.bin"))
        for name in ("hf_ep1_pt", "hf_ep1_xser"):
            out = os.path.join(self.dir, name + "_hf")
            run(EXPORT, self.copy(name), out, "--format", "hf", "--bin", *hints(name))
            got = torch.load(os.path.join(out, "pytorch_model.bin"))
            self.assertEqual(list(got), list(want), name)
            for key, t in want.items():
                with self.subTest(tag=name, tensor=key):
                    self.assert_equal_tensor(got[key], t, key)
            config, ref_config = (read_json(os.path.join(d, "config.json")) for d in (out, ref))
            for key in ("architectures", "num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size",
                        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta"):
                self.assertEqual(config[key], ref_config[key], key)

    def test_hf_import_at_tp_2_of_either_style(self):
        ref = os.path.join(DATA, "hf_reference", "ep1")
        for style in ("hf", "megatron"):
            extra = ["--model_source", "hf"] if style == "hf" else []
            tp1, tp2 = (os.path.join(self.dir, f"{style}_import_tp{tp}") for tp in (1, 2))
            for tp, out in ((1, tp1), (TP, tp2)):
                run(IMPORT, "--format", "hf", ref, out, "--tp", tp, "--pp", 1, *extra)
            if style == "hf":  # the run's own weights, so NxD's tp 2 files: every tensor of each rank
                for t in range(TP):
                    want = torch.load(os.path.join(self.pt_twin("hf_ep1_pt"), model_rel(t)))
                    got = torch.load(os.path.join(tp2, model_rel(t)))
                    self.assertEqual(sorted(got), sorted(want))
                    for key in want:
                        with self.subTest(rank=t, tensor=key):
                            self.assert_equal_tensor(got[key], want[key], key)
            back = self.reshard(tp2, os.path.join(self.dir, f"{style}_back"), 1, 1, "--weights_only")
            want, got = (torch.load(os.path.join(d, model_rel(0))) for d in (tp1, back))
            self.assertEqual(list(got), list(want), style)
            for key in want:
                with self.subTest(style=style, tensor=key):
                    self.assert_equal_tensor(got[key], want[key], key)
            p = run(VERIFY, tp2, "--against", tp1, "--weights_only", check=False)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)


if __name__ == "__main__":
    unittest.main()

"""Mixtral (MoE) through Hugging Face's MixtralForCausalLM, both styles, tp 1 ep 1 (issue #38 item 4).

The truth is tests/data/upstream/nxd_mixtral (see its README): hf_reference/epE is the
HF folder of the full state NxD's own run gave (hf_epE_full_state.pt, NxD's orientation),
made and checked against NxD's inference converter by hf_reference.py, and moe_check.pt
holds layer 0's MoE output on six tokens computed from it by hf_moe.py.

  - ckpt-import --format hf of the folder, into the HF-style family (--model_source hf) and
    the Megatron-style one: the tag's expert tensors equal the full state's gate_up_proj /
    down_proj (NxD's input-major orientation) bit for bit, the router its linear_router;
  - ckpt-export --format hf of that tag gives the folder's tensors back bit for bit, in HF's
    names (and, for the HF-style family, HF's order); --format full_state likewise, in HF's
    orientation; config.json says MixtralForCausalLM with its experts;
  - the exported weights, through HF's MoE forward (hf_moe.py), give moe_check.pt's output;
  - ckpt-export's h5 and its import give the tag back;
  - a folder missing an expert's tensor is refused naming it. (Import at tp 2:
    tests/interop/mixtral_ep1.py.)"""
import json
import os
import shutil
import sys
import unittest

import torch

from canon import EXPORT, IMPORT, INSPECT, TempDirTest, run

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_mixtral")
sys.path.insert(0, DATA)
import hf_moe  # noqa: E402  (the fixture's HF Mixtral MoE forward, torch only)

MODEL_FILE = os.path.join("model", "dp_rank_00_tp_rank_00_pp_rank_00.pt")
GATE_UP = "mlp.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = "mlp.expert_mlps.mlp_op.down_proj.weight"
ROUTER = "mlp.router.linear_router.weight"


def reference(ep):
    folder = os.path.join(DATA, "hf_reference", f"ep{ep}")
    return folder, torch.load(os.path.join(folder, "pytorch_model.bin"))


def megatron_name(hf_style):
    """The Megatron-style name of an HF-style MoE tensor (NxDT NeuronSwitchMLP's `mlp.moe.`)."""
    return "language_model.encoder." + hf_style[len("model."):].replace(".mlp.", ".mlp.moe.")


class MixtralHf(TempDirTest):
    def tool(self, *args, code=0):
        p = run(*args, check=False)
        self.assertEqual(p.returncode, code, f"{args}: {p.stdout} {p.stderr}")
        return p

    def imported(self, ep, style):
        src, _ = reference(ep)
        out = os.path.join(self.dir, f"tag_{style}_ep{ep}")
        extra = ["--model_source", "hf"] if style == "hf" else []
        self.tool(IMPORT, "--format", "hf", src, out, "--tp", 1, "--pp", 1, *extra)
        return out

    def assert_same_state(self, got, want, same_order):
        self.assertEqual(sorted(got), sorted(want))
        if same_order:
            self.assertEqual(list(got), list(want))
        for name, t in want.items():
            with self.subTest(tensor=name):
                self.assertEqual(got[name].dtype, t.dtype)
                self.assertEqual(got[name].shape, t.shape)
                self.assertTrue(torch.equal(got[name], t))

    def test_import_holds_nxds_orientation(self):
        for ep in (1, 2):
            full = torch.load(os.path.join(DATA, f"hf_ep{ep}_full_state.pt"))["model"]
            for style in ("hf", "megatron"):
                with self.subTest(ep=ep, style=style):
                    model = torch.load(os.path.join(self.imported(ep, style), MODEL_FILE))
                    moe = [k for k in full if k.endswith((GATE_UP, DOWN, ROUTER))]
                    self.assertEqual(len(moe), 6)
                    for k in moe:
                        name = k if style == "hf" else megatron_name(k)
                        self.assertIn(name, model)
                        self.assertTrue(torch.equal(model[name], full[k]), name)
                    if style == "hf":  # every tensor of the run, nothing else
                        self.assert_same_state(model, full, same_order=False)

    def test_export_is_the_reference_folder(self):
        for ep in (1, 2):
            _, want = reference(ep)
            for style in ("hf", "megatron"):
                with self.subTest(ep=ep, style=style):
                    out = os.path.join(self.dir, f"export_{style}_ep{ep}")
                    self.tool(EXPORT, self.imported(ep, style), out, "--format", "hf", "--bin")
                    got = torch.load(os.path.join(out, "pytorch_model.bin"))
                    # The Megatron-style family's export keeps its own module order (norms first), as for Llama.
                    self.assert_same_state(got, want, same_order=style == "hf")
                    config = json.load(open(os.path.join(out, "config.json")))
                    ref = json.load(open(os.path.join(reference(ep)[0], "config.json")))
                    self.assertEqual(config["architectures"], ["MixtralForCausalLM"])
                    for key in ("model_type", "num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "sliding_window",
                                "rms_norm_eps", "rope_theta", "tie_word_embeddings"):
                        self.assertEqual(config[key], ref[key], key)
                    self.assertEqual(sorted(os.listdir(out)), ["config.json", "model.safetensors", "pytorch_model.bin"])

    def test_full_state_is_in_hfs_orientation(self):
        _, want = reference(1)
        out, tag = os.path.join(self.dir, "full"), self.imported(1, "hf")
        self.tool(EXPORT, tag, out, "--format", "full_state")
        got = torch.load(os.path.join(out, "checkpoint.pt"))
        self.assert_same_state(got, want, same_order=True)
        self.assertEqual(got["model.layers.0.block_sparse_moe.experts.0.w1.weight"].shape, (32, 16))  # (I, H), not NxD's (H, I)
        # And it imports back (a single file with its config.json).
        back = os.path.join(self.dir, "from_full")
        self.tool(IMPORT, "--format", "hf", os.path.join(out, "checkpoint.pt"), back, "--tp", 1, "--pp", 1, "--model_source", "hf",
                  "--model_config", os.path.join(out, "config.json"))
        a = torch.load(os.path.join(back, MODEL_FILE))
        b = torch.load(os.path.join(tag, MODEL_FILE))
        self.assert_same_state(a, b, same_order=True)

    def test_h5_round_trip(self):
        """ckpt-export's h5 holds each expert weight as a 2-D dataset of its leading dimensions' rows; import gives the tag back."""
        tag = self.imported(1, "megatron")
        h5 = os.path.join(self.dir, "x.h5")
        self.tool(EXPORT, tag, h5)
        back = os.path.join(self.dir, "back")
        self.tool(IMPORT, h5, back, "--tp", 1, "--pp", 1)
        self.assert_same_state(torch.load(os.path.join(back, MODEL_FILE)), torch.load(os.path.join(tag, MODEL_FILE)), same_order=True)

    def test_exported_weights_compute_the_reference_moe_output(self):
        check = torch.load(os.path.join(reference(1)[0], "moe_check.pt"))
        out = os.path.join(self.dir, "export")
        self.tool(EXPORT, self.imported(1, "megatron"), out, "--format", "hf", "--bin")
        sd = torch.load(os.path.join(out, "pytorch_model.bin"))
        p = f"model.layers.{check['layer']}.block_sparse_moe."
        experts = range(sd[p + "gate.weight"].shape[0])
        w = {n: [sd[f"{p}experts.{e}.{n}.weight"] for e in experts] for n in ("w1", "w2", "w3")}
        config = json.load(open(os.path.join(out, "config.json")))
        got, logits = hf_moe.hf_sparse_moe(check["tokens"], sd[p + "gate.weight"], w["w1"], w["w2"], w["w3"], config["num_experts_per_tok"])
        self.assertTrue(torch.equal(got, check["hf_output"]))
        self.assertTrue(torch.equal(logits, check["nxd_router_logits"]))
        self.assertTrue(torch.allclose(got, check["nxd_output"], rtol=1e-5, atol=1e-7))
        # w1 and w3 swapped compute something else: the check can fail.
        swapped, _ = hf_moe.hf_sparse_moe(check["tokens"], sd[p + "gate.weight"], w["w3"], w["w2"], w["w1"], 2)
        self.assertFalse(torch.allclose(swapped, check["nxd_output"], rtol=1e-5, atol=1e-7))

    def test_inspect_names_the_imported_family(self):
        for style, label in (("hf", "hf_mixtral"), ("megatron", "megatron_mixtral")):
            tag = self.imported(1, style)
            self.assertIn(label + ":", self.tool(INSPECT, tag).stdout)
            got = json.loads(self.tool(INSPECT, tag, "--json").stdout)["model"]
            self.assertEqual((got["num_experts"], got["moe_top_k"], got["moe_frequency"]), (4, 2, 1))

    def test_a_folder_missing_an_expert_tensor_is_refused(self):
        src, _ = reference(1)
        # A folder missing an expert's tensor is refused naming it. (Import at tp > 1: mixtral_ep1.py.)
        broken = os.path.join(self.dir, "broken")
        shutil.copytree(src, broken)
        sd = torch.load(os.path.join(broken, "pytorch_model.bin"))
        del sd["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
        torch.save(sd, os.path.join(broken, "pytorch_model.bin"))
        p = self.tool(IMPORT, "--format", "hf", broken, os.path.join(self.dir, "b"), "--tp", 1, "--pp", 1, code=2)
        self.assertIn("experts.3.w2.weight", p.stderr)
        self.assertIn("MixtralForCausalLM", p.stderr)


if __name__ == "__main__":
    unittest.main()

"""The expert-parallel Megatron-style Mixtral tags NxD's own code wrote
(tests/data/upstream/nxd_mixtral megatron_ep2_pt, megatron_ep2_xser: NxDT's Megatron
GPTModel on NxD's MoE modules, tp 2, dp 2, ep 2; see its README, "Megatron style"),
weights only, through every command. Issue #38, items 2 and 4.

  - read: ckpt-reshard --weights_only ep 2 -> tp 1 ep 1 gives the gathered full state
    (megatron_ep2_full_state.pt) bit for bit, both containers, in NxD's ep 1 key order
    (the SPMDRank int32 tensors are dropped: they follow the target's ep);
    ckpt-verify --against across layouts, and it tells a changed expert tensor;
    ckpt-inspect names the family, the experts and ep; ckpt-export --format hf of the
    ep 2 tag equals that of the tp 1 ep 1 tag, in HF's orientation of the full state;
  - write: tp 1 ep 1 -> tp 2 ep 2 (--ep 2) equals NxD's model files tensor for tensor,
    in NxD's order (SPMDRank zeros included); xser: info.pt (expert_model_parallel marks),
    and in the ep_rank_01 tensor folders the expert tensors alone;
  - ckpt-import --format hf of a MixtralForCausalLM folder into the Megatron style at
    tp 2 ep 2: its experts are NxD's boxes (hf_ep2_pt holds the same weights), and back
    to tp 1 ep 1 it equals the import at tp 1;
  (the optimizer state at ep 2, NxD's NeuronEPZero1Optimizer: mixtral_ep_optim.py).

The truth is what NxD wrote and gathered, not anything computed here."""
import json
import os
import unittest

import torch

from canon import EXPORT, IMPORT, INSPECT, RESHARD, TempDirTest, VERIFY, run
from mixtral_ep import canonical_items
from mixtral_hf import megatron_name
from mixtral_tags import DATA, copy_tag

TP, EP = 2, 2
TAGS = ("megatron_ep2_pt", "megatron_ep2_xser")
FULL = torch.load(os.path.join(DATA, "megatron_ep2_full_state.pt"))
CONFIG = FULL["config"]["model"]
TP1 = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
MOE = ".mlp.moe."
ROUTER = MOE + "router.linear_router.weight"
GATE_UP = MOE + "expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = MOE + "expert_mlps.mlp_op.down_proj.weight"


def hints():
    """What no tensor shows, as the run's config (in its full state) records it."""
    return ["--heads", CONFIG["num_attention_heads"], "--kv_heads", CONFIG["num_kv_heads"], "--moe_top_k", CONFIG["moe"]["top_k"],
            "--layernorm_epsilon", CONFIG["layernorm_epsilon"]]


def model_rels():
    """NxD's ep model file names (trainer/checkpoint.py _get_path(..., ep=True))."""
    return [f"model/dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for e in range(EP) for t in range(TP)]


def bits(x):
    return x.contiguous().view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8)


class MixtralMegatronEp(TempDirTest):
    def assert_equal_tensor(self, got, want, at):
        self.assertEqual((got.dtype, tuple(got.shape)), (want.dtype, tuple(want.shape)), at)
        self.assertTrue(torch.equal(bits(got), bits(want)), at)

    def to_tp1(self, name):
        src = copy_tag(os.path.join(name, "step_2"), os.path.join(self.dir, name))
        out = os.path.join(self.dir, name + "_tp1")
        run(RESHARD, src, out, "--tp", 1, "--pp", 1, "--ep", 1, "--weights_only", "--no_save_xser", *hints())
        return src, out

    def assert_full_state(self, tag, name):
        got = torch.load(os.path.join(tag, TP1))
        nxd_ep1 = torch.load(os.path.join(DATA, "megatron_ep1_pt", "step_2", TP1))
        self.assertEqual(list(got), list(nxd_ep1), name)  # NxD's keys at ep 1, in its order: no spmd_rank
        self.assertEqual(sorted(got), sorted(FULL["model"]))
        for key, want in FULL["model"].items():
            with self.subTest(tag=name, tensor=key):
                self.assert_equal_tensor(got[key], want, key)

    # --- 1. read ---

    def test_ep2_reads_as_the_full_state(self):
        for name in TAGS:
            _, tp1 = self.to_tp1(name)
            rank_files = [n for n in os.listdir(os.path.join(tp1, "model")) if n.endswith(".pt")]
            self.assertEqual(rank_files, [os.path.basename(TP1)])
            self.assert_full_state(tp1, name)

    def test_verify_against_across_layouts(self):
        src, tp1 = self.to_tp1("megatron_ep2_pt")
        xser = copy_tag(os.path.join("megatron_ep2_xser", "step_2"), os.path.join(self.dir, "xser"))
        for a, b in ((tp1, src), (xser, src), (tp1, xser)):
            p = run(VERIFY, a, "--against", b, "--weights_only", *hints(), check=False)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        sd = torch.load(os.path.join(tp1, TP1))
        key = "language_model.encoder.layers.1" + GATE_UP
        sd[key][3, 15, 63] += 1.0  # the last expert's last up column: ep rank 1's, tp rank 1's
        torch.save(sd, os.path.join(tp1, TP1))
        os.remove(os.path.join(tp1, "manifest.json"))  # its checksum would tell the file, not the tensor
        p = run(VERIFY, tp1, "--against", src, "--weights_only", *hints(), check=False)
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn(key, p.stdout + p.stderr)

    def test_inspect_names_family_experts_and_ep(self):
        routers = sorted(k for k in FULL["model"] if k.endswith(ROUTER))
        for name in TAGS:
            tag = copy_tag(os.path.join(name, "step_2"), os.path.join(self.dir, name))
            got = json.loads(run(INSPECT, tag, "--json", check=False).stdout)["model"]
            self.assertEqual(got["model_family"], "megatron_mixtral", name)
            self.assertEqual(got["num_experts"], FULL["model"][routers[0]].shape[0], name)
            self.assertEqual(got["ep"], FULL["ep"], name)
            self.assertEqual(got["moe_layers"], [int(k.split(".")[3]) for k in routers], name)

    def test_hf_export_of_ep2_is_the_ep1_export(self):
        src, tp1 = self.to_tp1("megatron_ep2_xser")
        outs = {}
        for tag, extra in ((tp1, []), (src, hints())):
            outs[tag] = os.path.join(self.dir, os.path.basename(tag) + "_hf")
            run(EXPORT, tag, outs[tag], "--format", "hf", "--bin", "--weights_only", *extra)
        want, got = (torch.load(os.path.join(outs[t], "pytorch_model.bin")) for t in (tp1, src))
        self.assertEqual(list(got), list(want))
        for key, t in want.items():
            with self.subTest(tensor=key):
                self.assert_equal_tensor(got[key], t, key)
        # HF's orientation of the full state (README "HF reference"): w1 / w3 the gate / up halves transposed.
        ffn = CONFIG["ffn_hidden_size"]
        for layer in range(CONFIG["num_layers"]):
            at = f"language_model.encoder.layers.{layer}"
            gate_up, down = FULL["model"][at + GATE_UP], FULL["model"][at + DOWN]
            hf = f"model.layers.{layer}.block_sparse_moe."
            self.assert_equal_tensor(got[hf + "gate.weight"], FULL["model"][at + ROUTER], hf + "gate")
            for e in range(gate_up.shape[0]):
                self.assert_equal_tensor(got[f"{hf}experts.{e}.w1.weight"], gate_up[e][:, :ffn].t().contiguous(), f"{layer} {e} w1")
                self.assert_equal_tensor(got[f"{hf}experts.{e}.w3.weight"], gate_up[e][:, ffn:].t().contiguous(), f"{layer} {e} w3")
                self.assert_equal_tensor(got[f"{hf}experts.{e}.w2.weight"], down[e].t().contiguous(), f"{layer} {e} w2")

    # --- 2. write ---

    def assert_nxds_model_files(self, got_tag, want_tag, name):
        for rel in model_rels():
            want, got = canonical_items(want_tag, rel), canonical_items(got_tag, rel)
            self.assertEqual([k for k, _ in got], [k for k, _ in want], rel)  # NxD's keys, in NxD's order
            for (key, w), (_, g) in zip(want, got):
                with self.subTest(tag=name, file=rel, tensor=key):
                    self.assert_equal_tensor(g, w, f"{rel} {key}")

    def test_ep2_writes_nxds_plain_files(self):
        nxd, tp1 = self.to_tp1("megatron_ep2_pt")
        out = os.path.join(self.dir, "ep2")
        run(RESHARD, tp1, out, "--tp", TP, "--pp", 1, "--ep", EP, "--weights_only")
        self.assertEqual(sorted(os.listdir(os.path.join(out, "model"))), sorted(os.listdir(os.path.join(nxd, "model"))))
        self.assert_nxds_model_files(out, nxd, "megatron_ep2_pt")
        for rel in model_rels():  # the SPMDRank tensors, read raw
            got, want = torch.load(os.path.join(out, rel)), torch.load(os.path.join(nxd, rel))
            spmd = [k for k in want if ".spmd_rank." in k]
            self.assertEqual(len(spmd), 2 * CONFIG["num_layers"], rel)
            for key in spmd:
                self.assert_equal_tensor(got[key], want[key], f"{rel} {key}")
        p = run(VERIFY, out, "--against", nxd, "--weights_only", *hints(), check=False)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        back = os.path.join(self.dir, "back")
        run(RESHARD, out, back, "--tp", 1, "--pp", 1, "--ep", 1, "--weights_only")
        self.assert_full_state(back, "back")

    def test_ep2_writes_nxds_xser_files(self):
        nxd, tp1 = self.to_tp1("megatron_ep2_xser")
        out = os.path.join(self.dir, "ep2x")
        run(RESHARD, tp1, out, "--tp", TP, "--pp", 1, "--ep", EP, "--weights_only", "--save_xser")
        listing = lambda tag: sorted(os.listdir(os.path.join(tag, "model")))  # noqa: E731
        self.assertEqual(listing(out), listing(nxd))
        for rel in model_rels():
            with self.subTest(file=rel):
                got_info, want_info = (torch.load(os.path.join(t, rel + ".info.pt")) for t in (out, nxd))
                self.assertEqual(got_info, want_info)
                tids = lambda tag: sorted(os.listdir(os.path.join(tag, rel + ".tensors")))  # noqa: E731
                self.assertEqual(tids(out), tids(nxd))
                if "_ep_rank_00_" not in rel:  # ep rank 1: the expert tensors alone (README: tids 10, 11, 21, 22)
                    experts = sorted(f"tensor_{t}.pt" for t, d in want_info.items() if d["expert_model_parallel"])
                    self.assertEqual(len(experts), 2 * CONFIG["num_layers"])
                    self.assertEqual(tids(out), experts)
        self.assert_nxds_model_files(out, nxd, "megatron_ep2_xser")

    def test_hf_import_into_the_megatron_style_at_ep2(self):
        ref = os.path.join(DATA, "hf_reference", "ep2")  # HF folder of hf_ep2's full state: hf_ep2_pt holds its boxes
        ep2, ep1 = os.path.join(self.dir, "import_ep2"), os.path.join(self.dir, "import_ep1")
        run(IMPORT, "--format", "hf", ref, ep2, "--tp", TP, "--pp", 1, "--dp", EP, "--ep", EP)
        run(IMPORT, "--format", "hf", ref, ep1, "--tp", 1, "--pp", 1)
        self.assertEqual(sorted(os.listdir(os.path.join(ep2, "model"))), sorted(os.path.basename(r) for r in model_rels()))
        nxd = os.path.join(DATA, "hf_ep2_pt", "step_2")
        for rel in model_rels():
            want, got = torch.load(os.path.join(nxd, rel)), torch.load(os.path.join(ep2, rel))
            moe = [k for k in want if ".mlp." in k]  # router, experts, SPMDRank: the same boxes in either style
            self.assertEqual(len(moe), 5 * CONFIG["num_layers"], rel)
            for key in moe:
                with self.subTest(file=rel, tensor=key):
                    self.assert_equal_tensor(got[megatron_name(key)], want[key], key)
        back = os.path.join(self.dir, "back")
        run(RESHARD, ep2, back, "--tp", 1, "--pp", 1, "--ep", 1, "--weights_only")
        want, got = (torch.load(os.path.join(d, TP1)) for d in (ep1, back))
        self.assertEqual(list(got), list(want))
        for key in want:
            with self.subTest(tensor=key):
                self.assert_equal_tensor(got[key], want[key], key)
        p = run(VERIFY, ep2, "--against", ep1, "--weights_only", check=False)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)


if __name__ == "__main__":
    unittest.main()

"""ckpt-reshard --weights_only of the expert-parallel HF-style Mixtral tags NxD's own
code wrote (tests/data/upstream/nxd_mixtral hf_ep2_pt, hf_ep2_xser: tp 2, dp 2, ep 2;
see its README, "Layout facts"). Issue #38, item 2.

  - read: ep 2 -> tp 1 ep 1, the one model file holds every tensor of the gathered
    full state (hf_ep2_full_state.pt) bit for bit and nothing else (the SPMDRank
    int32 tensors are dropped: they follow the target's ep);
  - write: tp 1 ep 1 -> tp 2 ep 2 (--ep 2) equals NxD's own files: every plain model
    file key for key, in NxD's order, tensor for tensor (SPMDRank zeros of the
    target's shapes included); xser: the same X.pt contents, info.pt (dtype, shape,
    expert_model_parallel) and, in the ep_rank_01 tensor folders, the expert
    tensors alone;
  - the non-expert tensors of every ep rank are compared as replicas, an SPMDRank
    tensor that is not NxD's training value is refused, and what stays unsupported
    (an ep that does not divide the experts, a plain optimizer at ep > 1) is
    refused naming MoE or ep (the Megatron-style ep 2 tags: mixtral_megatron_ep.py; the
    ep 2 optimizer: mixtral_ep_optim.py).

The truth is what NxD wrote and gathered, not anything computed here."""
import json
import os
import unittest

import torch

from canon import PT_CANONICAL, RESHARD, TempDirTest, VERIFY, run
from mixtral_tags import TAGS, copy_tag, full_state, model_files, tensors_of

CONFIG = full_state(2)["config"]
TP1 = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


def hints():
    return ["--heads", str(CONFIG["num_attention_heads"]), "--moe_top_k", str(CONFIG["num_experts_per_tok"]),
            "--rope_theta", str(CONFIG["rope_theta"]), "--layernorm_epsilon", str(CONFIG["rms_norm_eps"])]


def canonical_items(tag, rel):
    """(key, tensor) of a rank file in file order, as shardkit's tag reader loads it (xser resolved)."""
    canonical = json.loads(run(PT_CANONICAL, "tag-file", tag, rel).stdout)
    tensors = tensors_of(canonical)
    return [(k["v"], tensors.get(k["v"])) for k, _ in canonical["items"]]


class MixtralEp(TempDirTest):
    def to_tp1(self, name):
        src = copy_tag(TAGS[name][0], os.path.join(self.dir, name))
        out = os.path.join(self.dir, name + "_tp1")
        run(RESHARD, src, out, "--tp", "1", "--pp", "1", "--ep", "1", "--weights_only", *hints())
        return src, out

    def assert_full_state(self, tag, name):
        full = full_state(2)["model"]
        got = dict(canonical_items(tag, TP1))
        self.assertEqual(sorted(got), sorted(full))  # no spmd_rank: NxD has none at ep 1
        for key, want in full.items():
            with self.subTest(tag=name, tensor=key):
                self.assertEqual(got[key].dtype, want.dtype)
                self.assertEqual(got[key].shape, want.shape)
                self.assertTrue(torch.equal(got[key], want))

    def test_ep2_reads_as_the_full_state(self):
        for name in ("hf_ep2_pt", "hf_ep2_xser"):
            _, tp1 = self.to_tp1(name)
            rank_files = [n for n in os.listdir(os.path.join(tp1, "model")) if n.endswith(".pt") and not n.endswith(".info.pt")]
            self.assertEqual(rank_files, [os.path.basename(TP1)])
            self.assert_full_state(tp1, name)

    def assert_same_model_files(self, got_tag, want_tag, name):
        for rel, _, _ in model_files(want_tag, 2):
            want, got = canonical_items(want_tag, rel), canonical_items(got_tag, rel)
            self.assertEqual([k for k, _ in got], [k for k, _ in want], rel)  # NxD's keys, in NxD's order
            for (key, w), (_, g) in zip(want, got):
                with self.subTest(tag=name, file=rel, tensor=key):
                    self.assertEqual(g.dtype, w.dtype)
                    self.assertEqual(g.shape, w.shape)
                    self.assertTrue(torch.equal(g, w))

    def test_ep2_writes_nxds_plain_files(self):
        nxd, tp1 = self.to_tp1("hf_ep2_pt")
        out = os.path.join(self.dir, "ep2")
        run(RESHARD, tp1, out, "--tp", "2", "--pp", "1", "--ep", "2", "--weights_only")
        self.assertEqual(sorted(os.listdir(os.path.join(out, "model"))), sorted(os.listdir(os.path.join(nxd, "model"))))
        self.assert_same_model_files(out, nxd, "hf_ep2_pt")
        for rel, _, _ in model_files(nxd, 2):  # the SPMDRank tensors, read raw
            got, want = torch.load(os.path.join(out, rel)), torch.load(os.path.join(nxd, rel))
            for key in (k for k in want if "spmd_rank" in k):
                self.assertEqual(got[key].dtype, torch.int32)
                self.assertTrue(torch.equal(got[key], want[key]), key)
        p = run(VERIFY, out, "--against", nxd, "--weights_only", *hints(), check=False)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # And back: ep 2 -> ep 1 again gives the full state.
        back = os.path.join(self.dir, "back")
        run(RESHARD, out, back, "--tp", "1", "--pp", "1", "--ep", "1", "--weights_only")
        self.assert_full_state(back, "back")

    def test_ep2_writes_nxds_xser_files(self):
        nxd, tp1 = self.to_tp1("hf_ep2_xser")
        out = os.path.join(self.dir, "ep2x")
        run(RESHARD, tp1, out, "--tp", "2", "--pp", "1", "--ep", "2", "--weights_only", "--save_xser")
        listing = lambda tag: sorted(os.listdir(os.path.join(tag, "model")))  # noqa: E731
        self.assertEqual(listing(out), listing(nxd))
        for rel, e, _ in model_files(nxd, 2):
            with self.subTest(file=rel):
                got_info, want_info = torch.load(os.path.join(out, rel + ".info.pt")), torch.load(os.path.join(nxd, rel + ".info.pt"))
                self.assertEqual(got_info, want_info)
                tids = lambda tag: sorted(os.listdir(os.path.join(tag, rel + ".tensors")))  # noqa: E731
                self.assertEqual(tids(out), tids(nxd))
                if e > 0:
                    experts = sorted(f"tensor_{t}.pt" for t, d in want_info.items() if d["expert_model_parallel"])
                    self.assertEqual(tids(out), experts)
                    self.assertGreater(len(experts), 0)
        self.assert_same_model_files(out, nxd, "hf_ep2_xser")

    def test_ep_replicas_are_compared(self):
        src = copy_tag(TAGS["hf_ep2_pt"][0], os.path.join(self.dir, "bad"))
        rel = "model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"
        sd = torch.load(os.path.join(src, rel))
        sd["model.norm.weight"][3] += 1
        torch.save(sd, os.path.join(src, rel))
        out = os.path.join(self.dir, "out")
        p = run(RESHARD, src, out, "--tp", "1", "--pp", "1", "--ep", "1", "--weights_only", "--no_verify", *hints(), check=False)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("'model.norm.weight' (param): tp rank 0 and ep rank 1, tp rank 0 hold different copies", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_spmd_rank_other_than_trainings_is_refused(self):
        src = copy_tag(TAGS["hf_ep2_pt"][0], os.path.join(self.dir, "spmd"))
        rel = "model/dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00.pt"
        sd = torch.load(os.path.join(src, rel))
        key = "model.layers.1.mlp.expert_mlps.spmd_rank.local_expert_indices"
        sd[key] = torch.tensor([[2, 3]], dtype=torch.int32)  # inference's create_spmd_ranks would fill it
        torch.save(sd, os.path.join(src, rel))
        out = os.path.join(self.dir, "out")
        p = run(RESHARD, src, out, "--tp", "1", "--pp", "1", "--ep", "1", "--weights_only", "--no_verify", *hints(), check=False)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn(f"{rel}: '{key}' is int32 [1, 2], not NxD's SPMDRank as training saves it", p.stderr)
        self.assertFalse(os.path.exists(out))

    def expect_refused(self, args, out, words):
        p = run(*args, check=False)
        self.assertEqual(p.returncode, 2, f"{args}: {p.stdout} {p.stderr}")
        for w in words:
            self.assertIn(w, p.stderr)
        self.assertFalse(os.path.exists(out), out)

    def test_unsupported_is_refused(self):
        src = copy_tag(TAGS["hf_ep2_pt"][0], os.path.join(self.dir, "src"))
        out = os.path.join(self.dir, "out")
        w = ["--weights_only", *hints()]
        self.expect_refused([RESHARD, src, out, "--tp", "1", "--pp", "1", "--ep", "3", *w], out,
                            ["--ep 3", "does not divide the 4 MoE experts"])
        self.expect_refused([RESHARD, src, out, "--tp", "1", "--pp", "1", "--ep", "2", "--dp", "3", *w], out, ["--ep 2 does not divide --dp 3"])
        self.expect_refused([RESHARD, src, out, "--tp", "1", "--pp", "1", "--no-zero1", *hints()], out, ["MoE", "optimizer"])


if __name__ == "__main__":
    unittest.main()

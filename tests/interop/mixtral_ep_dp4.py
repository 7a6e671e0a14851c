"""The expert-parallel optimizer where dp != ep: Mixtral tags NxD's own code wrote at tp 1
dp 4 ep 2 (tests/data/upstream/nxd_mixtral hf_tp1_dp4_ep2_pt, hf_tp1_dp4_ep2_xser,
megatron_tp1_dp4_ep2_pt; its README's "dp 4 ep 2"). Issue #38.

At dp 2 ep 2 every dp rank is its own ep rank, so "file d holds ep rank d % ep's experts as
expert-dp chunk d / ep" (ckpt/spec/ep_zero1_state.h) cannot be told from other rules. Here
file 1 holds ep rank 1's experts as chunk 0, and file 2 ep rank 0's as chunk 1.

  - read: each tag -> tp 1 ep 1 (dp 1 and dp 4) equals the gathered full state bit for bit,
    model, moments and step (check_tp1 of mixtral_ep_optim); ckpt-verify --against is ok;
  - write: tp 1 ep 1 -> tp 1 ep 2 dp 4 equals NxD's optim and model files entry for entry
    (keys in order, offsets, param_groups, every tensor's dtype, shape and bits), both styles;
    its xser form holds the same tensors (ckpt-verify --against NxD's tag); and back to ep 1.

(NxD's load_checkpoint reading shardkit's output at this mesh: load_check_tp1_dp4.out.txt.)
The truth is what NxD wrote and gathered, never anything computed here from shardkit."""
import os
import unittest

import torch

from canon import RESHARD, TempDirTest, VERIFY, run
import mixtral_ep
import mixtral_megatron_ep
from mixtral_ep1 import optim_rel
from mixtral_ep_optim import check_tp1
from mixtral_optim import assert_same
from mixtral_tags import DATA, copy_tag

DP, EP = 4, 2
STEP = "step_2"
MODEL_RELS = [f"model/dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt" for e in range(EP)]
# style: (its tags, its full state, its hints)
STYLES = {
    "hf": (("hf_tp1_dp4_ep2_pt", "hf_tp1_dp4_ep2_xser"), "hf_tp1_dp4_ep2_full_state.pt", mixtral_ep.hints),
    "megatron": (("megatron_tp1_dp4_ep2_pt",), "megatron_tp1_dp4_ep2_full_state.pt", mixtral_megatron_ep.hints),
}


def full_state(style):
    return torch.load(os.path.join(DATA, STYLES[style][1]))


class MixtralEpDp4(TempDirTest):
    def reshard(self, src, name, *args):
        out = os.path.join(self.dir, name)
        run(RESHARD, src, out, "--pp", 1, "--tp", 1, *args)
        return out

    def verify(self, tag, *args):
        """ckpt-verify exits 0 and says ok (alone) or same (--against)."""
        p = run(VERIFY, tag, *args, check=False)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertTrue(p.stdout.startswith("same " if "--against" in args else "ok "), p.stdout)

    def test_the_run_is_dp_4_ep_2(self):
        """The fixture is the mesh this file is about (so the tests below cannot pass on a dp = ep tag)."""
        for style, (names, _, _) in STYLES.items():
            self.assertEqual((full_state(style)["tp"], full_state(style)["dp"], full_state(style)["ep"]), (1, DP, EP))
            for name in names:
                tag = os.path.join(DATA, name, STEP)
                for folder, rels in (("optim", [optim_rel(d, 0) for d in range(DP)]), ("model", MODEL_RELS)):
                    files = sorted(f for f in os.listdir(os.path.join(tag, folder)) if f.endswith("pp_rank_00.pt"))
                    self.assertEqual(files, [os.path.basename(r) for r in rels], (name, folder))

    def test_reads_as_the_full_state(self):
        for style, (names, _, hints) in STYLES.items():
            full = full_state(style)
            for name in names:
                src = copy_tag(os.path.join(name, STEP), os.path.join(self.dir, name))
                self.verify(src, *hints())
                for dp in (1, DP):
                    tp1 = self.reshard(src, f"{name}_tp1_dp{dp}", "--ep", 1, "--dp", dp, "--no_save_xser", *hints())
                    check_tp1(self, tp1, dp, full)
                    self.verify(tp1, "--against", src, *hints())

    def test_writes_nxds_files(self):
        for style, (names, _, hints) in STYLES.items():
            nxd = os.path.join(DATA, names[0], STEP)  # the plain .pt tag
            src = copy_tag(os.path.join(names[-1], STEP), os.path.join(self.dir, style + "_src"))  # xser where there is one
            tp1 = self.reshard(src, style + "_tp1", "--ep", 1, "--dp", 1, "--no_save_xser", *hints())
            out = self.reshard(tp1, style + "_dp4", "--ep", EP, "--dp", DP, "--no_save_xser")
            self.assertEqual(sorted(os.listdir(os.path.join(out, "optim"))), sorted(os.listdir(os.path.join(nxd, "optim"))))
            for rel in [optim_rel(d, 0) for d in range(DP)] + MODEL_RELS:
                with self.subTest(style=style, file=rel):
                    assert_same(self, torch.load(os.path.join(out, rel)), torch.load(os.path.join(nxd, rel)), rel)
            self.verify(out, "--against", src, *hints())
            xser = self.reshard(tp1, style + "_dp4_xser", "--ep", EP, "--dp", DP, "--save_xser")
            self.verify(xser, "--against", nxd, *hints())
            check_tp1(self, self.reshard(out, style + "_back", "--ep", 1, "--dp", DP, "--no_save_xser"), DP, full_state(style))


if __name__ == "__main__":
    unittest.main()

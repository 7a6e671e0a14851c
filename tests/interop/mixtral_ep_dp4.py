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

And what an expert-parallel optimizer cannot be, refused by name (MixtralEpRefusals): a source
holding fp32 master weights (a shardkit-train mixed-precision tag) or --no-zero1 into ep 2, and
a plain ZeRO-1 optim file (NxD's ep 1 NeuronZero1Optimizer file) in a tag whose model files are ep 2.

(NxD's load_checkpoint reading shardkit's output at this mesh: load_check_tp1_dp4.out.txt.)
The truth is what NxD wrote and gathered, never anything computed here from shardkit."""
import glob
import json
import os
import shutil
import subprocess
import unittest

import torch

from canon import RESHARD, TOKENIZE, TRAIN, TempDirTest, VERIFY, run
import mixtral_ep
import mixtral_megatron_ep
from mixtral_ep1 import optim_rel
from mixtral_ep_optim import check_tp1
from mixtral_optim import assert_same
from mixtral_tags import DATA, copy_tag
import train_moe  # its tiny Mixtral and config shrink (a module: its tests run in their own file)

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
            # The source is right (else a rule wrong the same way in reader and writer would write NxD's files back).
            check_tp1(self, tp1, 1, full_state(style))
            out = self.reshard(tp1, style + "_dp4", "--ep", EP, "--dp", DP, "--no_save_xser")
            self.assertEqual(sorted(os.listdir(os.path.join(out, "optim"))), sorted(os.listdir(os.path.join(nxd, "optim"))))
            for rel in [optim_rel(d, 0) for d in range(DP)] + MODEL_RELS:
                with self.subTest(style=style, file=rel):
                    assert_same(self, torch.load(os.path.join(out, rel)), torch.load(os.path.join(nxd, rel)), rel)
            self.verify(out, "--against", src, *hints())
            xser = self.reshard(tp1, style + "_dp4_xser", "--ep", EP, "--dp", DP, "--save_xser")
            self.verify(xser, "--against", nxd, *hints())
            check_tp1(self, self.reshard(out, style + "_back", "--ep", 1, "--dp", DP, "--no_save_xser"), DP, full_state(style))


class MixtralEpRefusals(TempDirTest):
    def refused(self, program, *args):
        p = run(program, *args, check=False)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        return p.stderr

    def mixed_precision_tag(self):
        """A one-rank shardkit-train run of NxDT's HF Mixtral config (train_moe's shrink) in its own mixed precision,
        masters saved: its optim file holds fp32 sharded_master_weights."""
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, "/usr/share/common-licenses/GPL-3", os.path.join(self.dir, "data", "tok"))
        self.mixtral = os.path.join(self.dir, "mixtral.json")
        with open(self.mixtral, "w") as f:
            json.dump(train_moe.MIXTRAL, f)
        argv = train_moe.TrainMoe.argv(self, train_moe.CONFIGS[0], "mixed",
                                       "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True")
        p = subprocess.run([TRAIN, *argv], cwd=self.dir, capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        (tag,) = glob.glob(os.path.join(self.dir, "mixed", "checkpoints", "*--step=2-*.ckpt"))
        masters = torch.load(os.path.join(tag, optim_rel(0, 0)))["sharded_master_weights"]
        self.assertTrue(masters and all(t.dtype == torch.float32 for t in masters.values()))
        return tag

    def test_master_weights_and_no_zero1_into_ep_2_are_refused_by_name(self):
        tag = self.mixed_precision_tag()
        out = os.path.join(self.dir, "out")
        to_ep2 = [tag, out, "--tp", 1, "--pp", 1, "--ep", 2, "--dp", 2]
        self.assertIn("error: --ep 2: the source holds fp32 master weights, which NxD's NeuronEPZero1Optimizer state dict has no place "
                      "for (it saves none); pass --weights_only, or keep ep 1", self.refused(RESHARD, *to_ep2))
        self.assertIn("error: --ep 2: NxD saves an expert-parallel MoE optimizer as NeuronEPZero1Optimizer (ZeRO-1) state; shardkit "
                      "writes no plain optimizer files at ep > 1", self.refused(RESHARD, *to_ep2, "--no-zero1"))
        self.assertFalse(os.path.exists(out))
        run(RESHARD, *to_ep2, "--weights_only")  # the way the refusal names
        self.assertEqual(sorted(os.listdir(os.path.join(out, "model"))),
                         [f"dp_rank_00_ep_rank_0{e}_tp_rank_00_pp_rank_00.pt" for e in range(2)])
        self.assertFalse(os.path.exists(os.path.join(out, "optim")))

    def test_a_plain_zero1_optim_file_in_an_ep_tag_is_refused_by_name(self):
        for container in ("pt", "xser"):
            tag = copy_tag(os.path.join(f"hf_ep2_{container}", STEP), os.path.join(self.dir, container))
            shutil.rmtree(os.path.join(tag, "optim"))  # NxD's ep 1 NeuronZero1Optimizer files, same names, same model
            shutil.copytree(os.path.join(DATA, f"hf_ep1_{container}", STEP, "optim"), os.path.join(tag, "optim"))
            why = (": is not NxD's NeuronEPZero1Optimizer state dict (ep_param_group_offset and its ZeRO-1 parts), which shardkit reads "
                   "as the optimizer state of an expert-parallel (ep 2) tag")
            with self.subTest(container=container):
                self.assertIn(optim_rel(0, 0) + why, self.refused(RESHARD, tag, os.path.join(self.dir, "out"), "--tp", 1, "--pp", 1,
                                                                  "--ep", 1, *mixtral_ep.hints()))
                p = run(VERIFY, tag, *mixtral_ep.hints(), check=False)
                self.assertNotEqual(p.returncode, 0, p.stdout)
                self.assertIn(os.path.basename(optim_rel(0, 0)), p.stdout + p.stderr)
                self.assertIn(why[2:], p.stdout + p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "out")))


if __name__ == "__main__":
    unittest.main()

"""ckpt-reshard WITH the optimizer of the expert-parallel Mixtral tags NxD's own code wrote
(tests/data/upstream/nxd_mixtral hf_ep2_pt, hf_ep2_xser, megatron_ep2_pt, megatron_ep2_xser:
tp 2, dp 2, ep 2, NxD's NeuronEPZero1Optimizer; its README's "Layout facts"). Issue #38, item 3.

  - read: ep 2 -> tp 1 ep 1 (dp 1 and dp 2): the model equals the gathered full state
    (hf_ep2_full_state.pt) and every moment (exp_avg, exp_avg_sq of all 21 parameters)
    equals the full state's bit for bit, in NxD's ep 1 NeuronZero1Optimizer form
    (ids in named_parameters order, ZeRO-1 chunk d of dim 0), in both styles; no master weights
    (NxD's EP state dict carries none); ckpt-verify --against the source is ok;
  - write: tp 1 ep 1 -> tp 2 dp 2 ep 2 (--ep 2) equals NxD's own optim files entry for
    entry: keys and their order, the four offsets, param_groups, base_state and
    shape_info keys in order, every tensor's dtype, shape and bits; and back to ep 1;
  - ckpt-verify says ok on NxD's ep 2 tags (its optim files checked over expert-dp).

(NxD's load_checkpoint reading shardkit's ep 2 output: load_check_shardkit_ep2_optim.out.txt.)
The truth is what NxD wrote and gathered, never anything computed here from shardkit."""
import os
import unittest

import torch

from canon import RESHARD, TempDirTest, VERIFY, run
import mixtral_ep
import mixtral_megatron_ep
from mixtral_ep import hints
from mixtral_ep1 import BUFFER, bits, optim_rel
from mixtral_optim import assert_same
from mixtral_tags import DATA, TAGS, copy_tag, full_state

TP, DP = 2, 2
TP1_MODEL = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
# style: (its ep 2 tags (plain, xser), its gathered full state, its hints)
STYLES = {
    "hf": ((TAGS["hf_ep2_pt"][0], TAGS["hf_ep2_xser"][0]), lambda: full_state(2), mixtral_ep.hints),
    "megatron": ((os.path.join("megatron_ep2_pt", "step_2"), os.path.join("megatron_ep2_xser", "step_2")),
                 lambda: torch.load(os.path.join(DATA, "megatron_ep2_full_state.pt")), mixtral_megatron_ep.hints),
}


def assert_tensor(test, got, want, at):
    test.assertEqual((got.dtype, tuple(got.shape)), (want.dtype, tuple(want.shape)), at)
    test.assertTrue(torch.equal(bits(got), bits(want)), at)


def check_tp1(test, tag, dp, full):
    """The tp 1 ep 1 tag equals the full state: model, and each dp rank's chunk of every moment."""
    model = torch.load(os.path.join(tag, TP1_MODEL))
    test.assertEqual(sorted(model), sorted(full["model"]))
    for key, want in full["model"].items():
        assert_tensor(test, model[key], want, key)
    names = [k for k in model if BUFFER not in k]  # named_parameters order (Megatron's rotary buffer is no parameter)
    checked = 0
    for d in range(dp):
        opt = torch.load(os.path.join(tag, optim_rel(d, 0)))
        test.assertNotIn("sharded_master_weights", opt)
        test.assertNotIn("ep_param_group_offset", opt)  # ep 1: NeuronZero1Optimizer's form
        test.assertEqual(list(opt["base_state"]), list(range(len(names))))
        for i, key in enumerate(names):
            test.assertEqual(list(opt["shape_info"][i]), list(full["model"][key].shape), key)
            for field in ("exp_avg", "exp_avg_sq"):
                want = full["optimizer"][key][field]
                rows = -(-want.shape[0] // dp)  # ZeRO-1: chunk d of dim 0, padded to dp chunks
                with test.subTest(tag=tag, dp=d, tensor=key, field=field):
                    assert_tensor(test, opt["base_state"][i][field], want[d * rows:(d + 1) * rows], f"{key} {field}")
                checked += 1
            test.assertTrue(torch.equal(torch.as_tensor(opt["base_state"][i]["step"]), torch.as_tensor(full["optimizer"][key]["step"])))
    test.assertEqual(checked, 2 * len(full["optimizer"]) * dp)


class MixtralEpOptim(TempDirTest):
    def reshard(self, src, name, *args):
        out = os.path.join(self.dir, name)
        run(RESHARD, src, out, "--pp", 1, "--no_save_xser", *args)
        return out

    def check_tp1(self, tag, dp, style="hf"):
        check_tp1(self, tag, dp, STYLES[style][1]())

    def test_ep2_optimizer_reads_as_the_full_state(self):
        for style, (rels, _, style_hints) in STYLES.items():
            for rel in rels:
                name = rel.split(os.sep)[0]
                src = copy_tag(rel, os.path.join(self.dir, name))
                p = run(VERIFY, src, *style_hints(), check=False)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                for dp in (1, 2):
                    tp1 = self.reshard(src, f"{name}_tp1_dp{dp}", "--tp", 1, "--ep", 1, "--dp", dp, *style_hints())
                    self.check_tp1(tp1, dp, style)
                    p = run(VERIFY, tp1, "--against", src, *style_hints(), check=False)
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_megatron_ep2_optimizer_writes_nxds_files(self):
        nxd = os.path.join(DATA, STYLES["megatron"][0][0])
        src = copy_tag(STYLES["megatron"][0][1], os.path.join(self.dir, "src"))
        tp1 = self.reshard(src, "tp1", "--tp", 1, "--ep", 1, "--dp", 1, *mixtral_megatron_ep.hints())
        ep2 = self.reshard(tp1, "ep2", "--tp", TP, "--ep", 2, "--dp", DP)
        for d in range(DP):
            for t in range(TP):
                with self.subTest(dp=d, tp=t):
                    assert_same(self, torch.load(os.path.join(ep2, optim_rel(d, t))), torch.load(os.path.join(nxd, optim_rel(d, t))))
        back = self.reshard(ep2, "back", "--tp", 1, "--ep", 1, "--dp", 2)
        self.check_tp1(back, 2, "megatron")

    def test_ep2_optimizer_writes_nxds_files(self):
        nxd = os.path.join(DATA, TAGS["hf_ep2_pt"][0])
        src = copy_tag(TAGS["hf_ep2_xser"][0], os.path.join(self.dir, "src"))
        tp1 = self.reshard(src, "tp1", "--tp", 1, "--ep", 1, "--dp", 1, *hints())
        ep2 = self.reshard(tp1, "ep2", "--tp", TP, "--ep", 2, "--dp", DP)
        for d in range(DP):
            for t in range(TP):
                with self.subTest(dp=d, tp=t):
                    assert_same(self, torch.load(os.path.join(ep2, optim_rel(d, t))), torch.load(os.path.join(nxd, optim_rel(d, t))))
        self.assertEqual(sorted(os.listdir(os.path.join(ep2, "optim"))), sorted(os.listdir(os.path.join(nxd, "optim"))))
        p = run(VERIFY, ep2, "--against", src, *hints(), check=False)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # ep 2 -> ep 1 again: the same tp 1 tag.
        back = self.reshard(ep2, "back", "--tp", 1, "--ep", 1, "--dp", 2)
        self.check_tp1(back, 2)

    def test_what_ep_2_cannot_hold_is_refused(self):
        tp1 = self.reshard(copy_tag(TAGS["hf_ep2_pt"][0], os.path.join(self.dir, "src")), "tp1", "--tp", 1, "--ep", 1, *hints())
        out = os.path.join(self.dir, "out")
        p = run(RESHARD, tp1, out, "--tp", TP, "--pp", 1, "--ep", 2, "--dp", DP, "--no-zero1", check=False)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("NeuronEPZero1Optimizer (ZeRO-1)", p.stderr)
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main()

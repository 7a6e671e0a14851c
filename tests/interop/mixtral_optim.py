"""shardkit against the optimizer state of the Mixtral (MoE) tags NxD's own code
wrote under expert parallelism (tests/data/upstream/nxd_mixtral; its README's
"Layout facts" and "NxDT's save route at ep 2"). Issue #38, items 3 and 5.

  - every optim file NxD's NeuronEPZero1Optimizer wrote (ep 2, HF and Megatron
    style, plain and xser) parsed by shardkit (ckpt/spec/ep_zero1_state.h) and
    written back by its .pt writer loads in torch equal to NxD's file: keys and
    their order, offsets, param_groups, every tensor;
  - the moments in shardkit's rewritten files equal the gathered full state at
    the place the README's layout facts give: non-expert parameters chunk d of
    dim 0 of the tp box, experts ep rank d's experts whole (expert-dp 1);
  - NxDT's lossy ep 2 save (optim/ named by ep rank, written by dp rank 0 alone)
    is refused by ckpt-reshard, ckpt-export (with or without their verification
    first) and ckpt-verify --against (exit 2, nothing written) and reported by
    ckpt-verify, each naming the optim/ folder, what was lost, why, and
    --weights_only; NxD's own ep 2 tags are not told so."""
import os
import unittest

import torch

from canon import EXPORT, PT_CANONICAL, RESHARD, TempDirTest, VERIFY, run
from mixtral_tags import DATA, NXDT_TAG, copy_tag
TP, DP, EP = 2, 2, 2
OFFSETS = ["ep_param_id_offset", "ep_param_group_offset", "ep_base_state_offset", "ep_shape_info_offset"]
EXPERT_LEAVES = ("expert_mlps.mlp_op.gate_up_proj.weight", "expert_mlps.mlp_op.down_proj.weight")


def optim_rel(d, t):
    return f"optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt"


def assert_same(test, got, want, at="<root>"):
    """Equal as torch loads them: dict keys in order, lists, numbers, tensors by dtype, shape and bits."""
    test.assertEqual(type(got), type(want), at)
    if isinstance(want, dict):
        test.assertEqual(list(got.keys()), list(want.keys()), at)
        for k in want:
            assert_same(test, got[k], want[k], f"{at}/{k}")
    elif isinstance(want, (list, tuple)):
        test.assertEqual(len(got), len(want), at)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(test, a, b, f"{at}/{i}")
    elif isinstance(want, torch.Tensor):
        test.assertEqual((got.dtype, tuple(got.shape)), (want.dtype, tuple(want.shape)), at)
        test.assertTrue(torch.equal(got.view(torch.uint8) if got.dim() else got, want.view(torch.uint8) if want.dim() else want), at)
    else:
        test.assertEqual(got, want, at)


def tp_box(name, full, t, ep_rank):
    """README "Layout facts": what tp rank t (and ep rank ep_rank, for experts) holds of `full`."""
    if name.endswith(EXPERT_LEAVES):
        n = full.shape[0] // EP
        x = full[ep_rank * n:(ep_rank + 1) * n]
        if name.endswith(EXPERT_LEAVES[0]):  # [gate || up] on dim 2, stride 2 over tp
            half = x.shape[2] // 2
            c = half // TP
            return torch.cat([x[:, :, t * c:(t + 1) * c], x[:, :, half + t * c:half + (t + 1) * c]], dim=2)
        r = x.shape[1] // TP
        return x[:, t * r:(t + 1) * r]
    if full.dim() == 1 or name.endswith("router.linear_router.weight"):
        return full
    if name.endswith(("o_proj.weight", "self_attention.dense.weight")):
        c = full.shape[1] // TP
        return full[:, t * c:(t + 1) * c]
    r = full.shape[0] // TP
    return full[t * r:(t + 1) * r]


def parameter_names(tag):
    """named_parameters order: the ep rank 0 model file's keys less NxD's buffers."""
    m = torch.load(os.path.join(tag, "model", "dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt"))
    return [k for k in m if "spmd_rank" not in k and "inv_freq" not in k]


class MixtralOptim(TempDirTest):
    def copy(self, rel):
        return copy_tag(rel, os.path.join(self.dir, rel.replace(os.sep, "_")))

    def rewritten(self, tag, d, t):
        out = os.path.join(self.dir, f"rewritten_{d}_{t}.pt")
        run(PT_CANONICAL, "ep-optim", tag, optim_rel(d, t), out)
        return torch.load(out)

    def test_every_ep_optim_file_round_trips_as_nxd_wrote_it(self):
        for style in ("hf", "megatron"):
            pt_tag = os.path.join(DATA, f"{style}_ep2_pt", "step_2")
            for container in ("pt", "xser"):
                tag = self.copy(os.path.join(f"{style}_ep2_{container}", "step_2"))
                for d in range(DP):
                    for t in range(TP):
                        with self.subTest(style=style, container=container, dp=d, tp=t):
                            got = self.rewritten(tag, d, t)
                            want = torch.load(os.path.join(pt_tag, optim_rel(d, t)))  # both containers hold one state
                            self.assertEqual(list(got)[:4], OFFSETS)
                            assert_same(self, got, want)

    def test_rewritten_moments_equal_the_full_state(self):
        checked = 0
        for style in ("hf", "megatron"):
            tag = os.path.join(DATA, f"{style}_ep2_pt", "step_2")
            full = torch.load(os.path.join(DATA, f"{style}_ep2_full_state.pt"))["optimizer"]
            names = parameter_names(tag)
            non_expert = [n for n in names if not n.endswith(EXPERT_LEAVES)]
            expert = [n for n in names if n.endswith(EXPERT_LEAVES)]
            for d in range(DP):
                for t in range(TP):
                    got = self.rewritten(tag, d, t)
                    offset = got["ep_base_state_offset"]
                    self.assertEqual(offset, len(non_expert))
                    self.assertEqual(sorted(got["base_state"]), list(range(len(names))))
                    for key, entry in got["base_state"].items():
                        name = non_expert[key] if key < offset else expert[key - offset]
                        for field in ("exp_avg", "exp_avg_sq"):
                            box = tp_box(name, full[name][field], t, d)  # dp rank d is ep rank d (ep 2 = dp 2)
                            if key < offset:  # ZeRO-1 chunk d of dim 0 over dp
                                rows = -(-box.shape[0] // DP)
                                box = box[d * rows:(d + 1) * rows]
                            with self.subTest(style=style, dp=d, tp=t, name=name, field=field):
                                self.assertEqual(list(got["shape_info"][key]), list(tp_box(name, full[name][field], t, d).shape))
                                assert_same(self, entry[field], box.contiguous())
                            checked += 1
        self.assertEqual(checked, DP * TP * 2 * (21 + 19))  # 2 moments of HF's 21 parameters and Megatron's 19, in 4 files

    def expect_lost(self, text, where, xser):
        """The explanation, from `where` (the reader names the optim/ folder; ckpt-verify reports it as optim/'s problem)."""
        self.assertIn(f"{where}: NxDT saved an expert-parallel (ep=2) dp=2 ZeRO-1 optimizer of an MoE model", text)
        self.assertIn("have no tensors in their .tensors/ folders" if xser else "optim/ holds ep rank 0's files alone", text)
        for part in ("Lost: the moments of the experts of ep rank 1", "zero1_optimizer from cfg.wrap_with_zero", "--weights_only"):
            self.assertIn(part, text)

    def test_nxdt_lossy_ep_saves_are_refused_with_the_explanation(self):
        for container in ("pt", "xser"):
            tag = self.copy(os.path.join(f"nxdt_ep2_{container}", NXDT_TAG))
            out = os.path.join(self.dir, container + "_out")
            # ckpt-export's h5 carries the optimizer (its HF export takes the model alone, so it is not refused for this).
            for args in ([RESHARD, tag, out, "--tp", 1, "--pp", 1], [EXPORT, tag, out]):
                # Verified first (the default), the report tells it; read without, the reader refuses naming the folder.
                for no_verify, where in ((False, "optim/: damaged by design"), (True, f"{tag}/optim")):
                    with self.subTest(container=container, command=os.path.basename(args[0]), no_verify=no_verify):
                        p = run(*args, *(["--no_verify"] if no_verify else []), check=False)
                        self.assertEqual(p.returncode, 2, f"{args}: {p.stdout} {p.stderr}")
                        self.expect_lost(p.stderr, where, container == "xser")
                        self.assertFalse(os.path.exists(out))
            with self.subTest(container=container, command="ckpt-verify --against"):
                p = run(VERIFY, tag, "--against", tag, check=False)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.expect_lost(p.stderr, f"{tag}/optim", container == "xser")
            with self.subTest(container=container, command="ckpt-verify"):
                p = run(VERIFY, tag, check=False)
                self.assertNotEqual(p.returncode, 0)
                self.expect_lost(p.stdout, "optim/: damaged by design", container == "xser")
            # --weights_only takes the model: the lost optimizer is not what stops it.
            p = run(RESHARD, tag, out, "--tp", 1, "--pp", 1, "--weights_only", "--no_verify", check=False)
            self.assertNotIn("NxDT saved an expert-parallel", p.stderr)

    def test_nxds_own_ep_saves_are_not_told_lost(self):
        for rel in (os.path.join("hf_ep2_pt", "step_2"), os.path.join("megatron_ep2_xser", "step_2")):
            tag = self.copy(rel)
            for args in ([VERIFY, tag], [RESHARD, tag, os.path.join(self.dir, "out"), "--tp", 1, "--pp", 1]):
                p = run(*args, check=False)
                self.assertNotIn("NxDT saved an expert-parallel", p.stdout + p.stderr)


if __name__ == "__main__":
    unittest.main()

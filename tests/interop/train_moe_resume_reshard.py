"""exp_manager.resume_reshard across tp and ep for MoE tags (issue #39 item 3).

A tiny HF Mixtral (train_moe_ep_ckpt's, fp32) runs 6 steps at layout A on 4 ranks, saving at step 3. A run at
layout B resumes from the step 3 tag with resume_reshard: every rank reshards it together (ZeRO-1 optimizer
state included: NxD's NeuronEPZero1Optimizer at ep > 1), then trains to step 6. Its losses and gradient norms
over steps 4-6 equal the uninterrupted layout-A run within 1e-5 (what the dense resume_reshard test,
train_parallel.py, asserts; layouts differ by summation order only). Cases: ep 1 tp 1 -> tp 2; ep 2 -> ep 1; ep 2 tp 2 -> pp 2;
ep 1 -> ep 2. A tag holding fp32 master weights (mixed precision) is refused at ep > 1 by name: NxD's
NeuronEPZero1Optimizer state has no place for them.
"""
import os
import re
import subprocess
import unittest

from canon import VERIFY
from train_moe_ep_ckpt import TrainMoeEpCkpt, files
from train_parallel import GRAD_NORM_RTOL, LOSS_RTOL
from train_resume import losses

# A tag at step 3; a learning rate at which the optimizer state resumed shows in the next steps' losses.
EVERY_3 = ["exp_manager.checkpoint_callback_params.every_n_train_steps=3", "exp_manager.checkpoint_callback_params.save_top_k=-1",
           "model.optim.lr=0.01"]
STEPS = 6


class TrainMoeResumeReshard(TrainMoeEpCkpt):
    def resume_at(self, run, source, tp, ep, pp=1):
        """Run `run` at tp/ep/pp resumes `source`'s step 3 tag with resume_reshard; returns the resharded tag."""
        tag = self.tag(source, 3)
        r = self.trained(self.argv(run, f"exp_manager.resume_from_checkpoint={tag}", "+exp_manager.resume_reshard=True",
                                   f"distributed_strategy.pipeline_model_parallel_size={pp}", *EVERY_3, tp=tp, ep=ep, steps=STEPS),
                         ranks=4)
        new_tag = os.path.join(self.dir, run, f"checkpoints-tp{tp}pp{pp}dp{4 // (tp * pp)}" + (f"ep{ep}" if ep > 1 else ""),
                               os.path.basename(tag))
        self.assertIn(f"resharding it into {new_tag}", r.stderr)
        self.assertIn("resumed from " + new_tag, r.stderr)
        v = subprocess.run([VERIFY, new_tag], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        # As train_parallel.py's assert_same_losses (whose check that the losses fall does not hold on these random tokens).
        for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
            a, b = losses(os.path.join(self.dir, source), key), losses(os.path.join(self.dir, run), key)
            self.assertEqual(sorted(b), list(range(4, STEPS + 1)))
            for s in b:
                self.assertLess(abs(a[s] - b[s]) / abs(a[s]), rtol, f"{run} vs {source}: {key} at step {s}")
        return new_tag

    def test_moe_tags_resume_resharded_across_tp_and_ep(self):
        self.trained(self.argv("ep1", *EVERY_3, tp=1, ep=1, steps=STEPS), ranks=4)
        self.trained(self.argv("ep2", *EVERY_3, tp=2, ep=2, steps=STEPS), ranks=4)
        # ep 1, tp 1 dp 4 -> tp 2 dp 2: the experts' gate_up split on the intermediate dim, the optimizer's ZeRO-1 shards
        # over dp 2.
        tp2 = self.resume_at("tp2", "ep1", tp=2, ep=1)
        self.assertEqual(files(tp2), sorted([f"model/dp_rank_00_tp_rank_0{t}_pp_rank_00.pt" for t in (0, 1)] +
                                            [f"optim/dp_rank_0{d}_tp_rank_0{t}_pp_rank_00.pt" for d in (0, 1) for t in (0, 1)]))
        # ep 2 -> ep 1 (tp 2 dp 2): NeuronEPZero1Optimizer's state read back into one ZeRO-1 file per dp rank.
        ep1 = self.resume_at("to_ep1", "ep2", tp=2, ep=1)
        self.assertEqual(files(ep1), files(tp2))
        # ep 1 -> ep 2 (tp 1 dp 4 -> tp 2 dp 2 ep 2): written as NxD's ep layout, its optimizer NeuronEPZero1Optimizer's.
        ep2 = self.resume_at("to_ep2", "ep1", tp=2, ep=2)
        self.assertEqual(files(ep2), files(self.tag("ep2", 3)))
        # ep 2 at tp 2 -> pp 2 (tp 1 pp 2 dp 2 ep 2): each stage's layer, its experts cut over ep as before.
        pp2 = self.resume_at("to_pp2", "ep2", tp=1, ep=2, pp=2)
        self.assertEqual(files(pp2), sorted([f"model/dp_rank_00_ep_rank_0{e}_tp_rank_00_pp_rank_0{p}.pt" for e in (0, 1) for p in (0, 1)] +
                                            [f"optim/dp_rank_0{d}_tp_rank_00_pp_rank_0{p}.pt" for d in (0, 1) for p in (0, 1)]))

    def test_master_weights_are_refused_at_ep_above_1_by_name(self):
        # Mixed precision (the config's own precision), masters saved: the ep 1 tag holds fp32 master weights.
        mixed = lambda argv: [a for a in argv if a != "precision.type=fp32"]  # noqa: E731
        self.trained(mixed(self.argv("mixed", "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True", tp=2, ep=1)),
                     ranks=4)
        tag = self.tag("mixed", 2)
        p = self.train(mixed(self.argv("mixed_ep2", f"exp_manager.resume_from_checkpoint={tag}", "+exp_manager.resume_reshard=True",
                                       tp=2, ep=2, steps=3)), 4)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertRegex(p.stderr, re.escape(f"{tag}: cannot resume_reshard it at distributed_strategy.expert_model_parallel_size 2: "
                                             "it holds fp32 master weights"))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "mixed_ep2", "checkpoints-tp2pp1dp2ep2")))


def load_tests(loader, tests, pattern):
    """This class's own tests (not those it inherits from train_moe_ep_ckpt, which run in their own file)."""
    return unittest.TestSuite(TrainMoeResumeReshard(n) for n in sorted(vars(TrainMoeResumeReshard)) if n.startswith("test_"))


if __name__ == "__main__":
    unittest.main()

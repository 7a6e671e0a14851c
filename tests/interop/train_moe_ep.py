"""shardkit-train with expert parallelism (issue #39): NxDT's HF Mixtral at expert_model_parallel_size 2.

- Each ep rank holds its contiguous experts and the MoE layers exchange tokens by all-to-all over the ep group,
  the capacity of each expert computed from the sending rank's tokens (NxD's forward_capacity_factor): dp 2 ep 2
  (2 ranks), dp 4 ep 2 (4 ranks: expert gradients summed over expert-data-parallel pairs) and tp 2 dp 2 ep 2
  (4 ranks) train the model one process trains (losses and gradient norms within 1e-5), with token dropping
  (capacity_factor 2.0 of 8 experts, top 2) and without (the dropless config).
- The all-to-all traffic each step is the analytic count: per MoE layer and micro-batch, six exchanges (forward,
  backward, and the forward again under activations_checkpoint_granularity 'full'), each (ep - 1) blocks of
  E / ep experts' C slots of hidden floats.
- An ep that does not divide dp and ep > 1 on a dense model are refused by name (checkpoints and resume at ep > 1,
  and what stays refused of them: train_moe_ep_ckpt.py).
"""
import json
import math
import os
import re
import unittest

import trainer_refuses  # HF_CONFIG, a dense Llama's config.json
import train_moe  # its set-up and helpers (imported as a module: its tests run in their own file)
from train_moe import CONFIGS
from train_resume import losses

NO_CKPT = "exp_manager.create_checkpoint_callback=False"
EP = "distributed_strategy.expert_model_parallel_size"
TP = "distributed_strategy.tensor_model_parallel_size"
FP32 = ["precision.type=fp32", "model.moe.router_aux_loss_coef=0.1", "trainer.max_steps=3", NO_CKPT]
# The shrunk configs (trainer_refuses.shrunk at 4 devices, train_moe.MIXTRAL): 8 sequences of 32 tokens per step,
# one per micro-batch; 4 MoE layers of 8 experts, top 2, hidden 64; full recompute.
SEQUENCES, TOKENS, LAYERS, EXPERTS, TOP_K, HIDDEN = 8, 32, 4, 8, 2, 64


def capacity(capacity_factor):
    """NxD's expert capacity for one micro-batch (ExpertMLPsV2: forward_capacity_factor; full when dropless)."""
    if capacity_factor <= 0 or capacity_factor >= EXPERTS / TOP_K:
        return TOKENS
    return min(TOKENS, math.ceil(TOKENS * TOP_K * capacity_factor / EXPERTS))


def alltoall_bytes_per_step(ep, dp, capacity_factor):
    micro_batches = SEQUENCES // dp  # of each rank
    per_exchange = (ep - 1) * (EXPERTS // ep) * capacity(capacity_factor) * HIDDEN * 4
    return LAYERS * micro_batches * 6 * per_exchange


class TrainMoeEp(train_moe.TrainMoe):
    # TrainMoe's own tests run in train_moe.py; this class reuses its set-up and helpers only.
    test_nxdt_hf_mixtral_configs_train_and_write_nxds_moe_tensors = None
    test_frequency_two_mixes_dense_and_moe_layers = None
    test_every_layout_trains_the_one_process_model = None
    test_killed_run_resumes_exactly = None
    test_what_is_not_built_is_refused_by_name = None

    def compare(self, config, capacity_factor, layouts):
        self.trained(self.argv(config, "one", *FP32, devices=4) + ["trainer.devices=1"])
        one, one_norm = losses(os.path.join(self.dir, "one")), losses(os.path.join(self.dir, "one"), "grad_norm")
        self.assertEqual(sorted(one), [1, 2, 3])
        for name, (ranks, dp, extra) in layouts.items():
            with self.subTest(config=config, layout=name):
                run = f"{config}_{name}"
                self.trained(self.argv(config, run, *FP32, devices=4) + [f"trainer.devices={ranks}", f"{EP}=2", *extra], ranks=ranks)
                got, norm = losses(os.path.join(self.dir, run)), losses(os.path.join(self.dir, run), "grad_norm")
                self.assertEqual(sorted(got), sorted(one))
                for step in one:
                    self.assertAlmostEqual(got[step], one[step], delta=1e-5, msg=step)
                    self.assertAlmostEqual(norm[step], one_norm[step], delta=1e-5 * one_norm[step], msg=step)
                # The token exchange: rank 0's bytes each step (metrics.jsonl) and every rank's in timing.json.
                want = alltoall_bytes_per_step(2, dp, capacity_factor)
                self.assertEqual(set(losses(os.path.join(self.dir, run), "alltoall_bytes").values()), {want})
                with open(os.path.join(self.dir, run, "timing.json")) as f:
                    timing = json.load(f)
                self.assertEqual([r["alltoall_bytes"] for r in timing["ranks"]], [3 * want] * ranks)

    def test_ep2_trains_the_one_process_model_with_token_dropping(self):
        self.compare(CONFIGS[0], 2.0, {"dp2_ep2": (2, 2, [f"{TP}=1"]), "dp4_ep2": (4, 4, [f"{TP}=1"]),
                                       "tp2_dp2_ep2": (4, 2, [f"{TP}=2"])})

    def test_ep2_trains_the_one_process_model_dropless(self):
        self.compare(CONFIGS[1], 0.0, {"dp2_ep2": (2, 2, [f"{TP}=1"]), "dp4_ep2": (4, 4, [f"{TP}=1"])})

    def test_what_is_not_built_at_ep2_is_refused_by_name(self):
        cases = [
            (self.argv(CONFIGS[0], "dense", NO_CKPT, "name=hf_llama", "exp_manager.name=hf_llama", devices=2) +
             [f"model.model_config={trainer_refuses.HF_CONFIG}", f"{EP}=2"], 2,
             re.escape("distributed_strategy.expert_model_parallel_size: expert parallel degree 2 needs an MoE model")),
            (self.argv(CONFIGS[0], "ep3", NO_CKPT, devices=2) + [f"{EP}=3"], 2,
             re.escape("distributed_strategy.expert_model_parallel_size: 3 does not divide the data-parallel size 2")),
        ]
        for argv, ranks, message in cases:
            with self.subTest(message):
                p = self.train(argv, ranks)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertRegex(p.stderr, message)


if __name__ == "__main__":
    unittest.main()

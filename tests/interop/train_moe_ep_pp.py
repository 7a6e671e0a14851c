"""shardkit-train with expert parallelism beside pipeline stages, for the Megatron-style Mixtral, and at mixed
precision (issue #39).

- Pipeline stages: the HF Mixtral at tp 1 pp 2 dp 2 ep 2 (4 ranks), with token dropping, trains the model one process
  trains (losses and gradient norms within 1e-5, from float32 summation order alone: the dp all-reduce adds the
  micro-batches' gradients in another order, each expert's gradient sums its rows grouped by source rank). Each
  stage's ep and expert-dp groups are RankGrid::ExpertGroup's (ckpt/spec/rank_grid.h: inside its tp and pp place);
  its token exchange carries the analytic count of its own MoE layers only.
- The Megatron-style Mixtral (NxDT's NeuronSwitchMLP, models/megatron/transformer.py, on NxD's RouterTopK and
  ExpertMLPs as the HF style builds them) at tp 1 dp 2 ep 2, tp 2 dp 2 ep 2 and pp 2 dp 2 ep 2 with token dropping,
  and its dropless twin at moe frequency 2 (1-based layer_number % frequency == 0: of 2 layers, layer 1 alone is MoE)
  at tp 1 dp 2 ep 2: one process's losses and gradient norms within 1e-5; each rank's exchange is the analytic count
  of its MoE layers.
- Mixed precision as NxDT's Mixtral configs set it (precision.type mixed_precision with zero1: bfloat16 parameters,
  float32 master weights; xla_downcast_bf16 '1', fp32_grad_acc True): at ep 2 against one process at the same
  precision. Step 1 runs the same bfloat16 weights in float32, so its loss and gradient norm agree within 1e-5 as in
  fp32. After an update, a master weight that float32 summation order moves across a bfloat16 rounding midpoint rounds
  to the neighbouring bfloat16, one unit in the last place: at most 2^-7 |w| (bfloat16 keeps 8 significant bits). To
  first order the loss moves by sum_i |dL/dw_i| * 2^-7 |w_i| <= 2^-7 * grad_norm * param_norm (Cauchy-Schwarz), were
  every weight to round the other way: the bound of the later steps, from each step's logged norms.
Checkpoints stay off here (saving and resuming at ep > 1 is its own work).
"""
import json
import math
import os
import sys
import unittest

import numpy as np

from canon import TempDirTest
from indexed_dataset_interop import megatron_write
from train_resume import losses
import train_moe  # its tiny HF Mixtral and set-up helpers (modules: their tests run in their own files)
import train_moe_ep  # its analytic all-to-all count
import train_moe_megatron

NO_CKPT = "exp_manager.create_checkpoint_callback=False"
EP, TP, PP = (f"distributed_strategy.{k}_model_parallel_size" for k in ("expert", "tensor", "pipeline"))
FP32 = ["precision.type=fp32", "model.moe.router_aux_loss_coef=0.1", NO_CKPT]
BF16_ULP = 2.0 ** -7  # one bfloat16 unit in the last place, relative to the value (8 significant bits)


class TrainMoeEpPp(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        rng = np.random.default_rng(39)  # tokens below the tiny models' vocabularies
        megatron_write(os.path.join(self.dir, "data", "tok"), [rng.integers(0, 64, 200) for _ in range(40)], np.uint16)
        self.mixtral = os.path.join(self.dir, "mixtral.json")
        with open(self.mixtral, "w") as f:
            json.dump(train_moe.MIXTRAL, f)

    train = train_moe.TrainMoe.train  # plain functions: these run in this class
    trained = train_moe.TrainMoe.trained

    def hf(self, config, run_dir, *overrides, devices=4):
        return train_moe.TrainMoe.argv(self, config, run_dir, *overrides, devices=devices, steps=3)

    def megatron(self, config, run_dir, *overrides, devices=4):
        return train_moe_megatron.TrainMoeMegatron.argv(self, config, run_dir, *overrides, devices=devices, steps=3)

    def run_layouts(self, argv, prefix, layouts):
        """Trains `argv(run_dir, *extra)` on one rank and on each layout {name: (ranks, extra)} into prefix + name;
        returns {name: (losses, grad norms, param norms)} with "one" the one process's."""
        out = {}
        for name, (ranks, extra) in {"one": (1, ["trainer.devices=1", f"{TP}=1", f"{PP}=1"]), **layouts}.items():
            self.trained(argv(prefix + name, *extra) + ([f"trainer.devices={ranks}"] if ranks > 1 else []), ranks=ranks)
            out[name] = tuple(losses(os.path.join(self.dir, prefix + name), key) for key in ("loss", "grad_norm", "param_norm"))
        self.assertEqual(sorted(out["one"][0]), [1, 2, 3])
        return out

    def assert_same(self, got, one, msg, later_tolerance=None):
        """Losses within 1e-5 and gradient norms within 1e-5 relative; with `later_tolerance(step)`, steps after the first within it."""
        self.assertEqual(sorted(got[0]), sorted(one[0]), msg)
        for step in one[0]:
            loss_tol = 1e-5 if step == 1 or later_tolerance is None else later_tolerance(step)
            norm_tol = 1e-5 * one[1][step] if step == 1 or later_tolerance is None else math.inf
            self.assertAlmostEqual(got[0][step], one[0][step], delta=loss_tol, msg=f"{msg} step {step}")
            self.assertAlmostEqual(got[1][step], one[1][step], delta=norm_tol, msg=f"{msg} step {step}")

    def test_ep2_with_pipeline_stages_trains_the_one_process_model(self):
        # Token dropping (capacity_factor 2.0 of 8 experts, top 2): each rank's capacity from its own micro-batch.
        # Dropless at ep 2 without stages: train_moe_ep.py.
        runs = self.run_layouts(lambda run, *extra: self.hf(train_moe.CONFIGS[0], run, *FP32, *extra), "hf_",
                                {"pp2_dp2_ep2": (4, [f"{TP}=1", f"{PP}=2", f"{EP}=2"])})
        self.assert_same(runs["pp2_dp2_ep2"], runs["one"], "pp2_dp2_ep2")
        # Each stage's ep group exchanges its own two MoE layers' tokens (4 micro-batches per dp rank): half the model's.
        per_stage = train_moe_ep.alltoall_bytes_per_step(2, 2, 2.0) * 2 // train_moe.MIXTRAL["num_hidden_layers"]
        self.assertEqual(set(losses(os.path.join(self.dir, "hf_pp2_dp2_ep2"), "alltoall_bytes").values()), {per_stage})
        with open(os.path.join(self.dir, "hf_pp2_dp2_ep2", "timing.json")) as f:
            self.assertEqual([r["alltoall_bytes"] for r in json.load(f)["ranks"]], [3 * per_stage] * 4)


    def test_megatron_style_at_ep2_trains_the_one_process_model(self):
        # TINY: 4 experts, top 2, hidden 16, 2 layers; 8 sequences of 32 tokens per step, 4 micro-batches per dp rank.
        # Token dropping: capacity_factor 1.0 of 4 experts, top 2, so an expert takes 16 of a micro-batch's 32 tokens.
        dropping, dropless = train_moe_megatron.CONFIGS
        dp2, tp2, pp2 = ([f"{TP}=1", f"{EP}=2"], [f"{TP}=2", f"{EP}=2"], [f"{TP}=1", f"{PP}=2", f"{EP}=2"])
        # {config: (overrides, capacity, {layout: (ranks, overrides, rank 0's MoE layers)})}
        cases = {dropping: (["model.moe.capacity_factor=1.0"], 16, {"dp2_ep2": (2, dp2, 2), "tp2_dp2_ep2": (4, tp2, 2),
                                                                    "pp2_dp2_ep2": (4, pp2, 1)}),
                 dropless: (["model.moe.frequency=2"], 32, {"dp2_ep2": (2, dp2, 1)})}
        fp32 = [*FP32, "model.optim.lr=0.01", "model.moe.output_router_logits=True"]
        for config, (extra, capacity, layouts) in cases.items():
            with self.subTest(config):
                runs = self.run_layouts(lambda run, *more: self.megatron(config, run, *fp32, *extra, *more), f"{config}_",
                                        {name: (ranks, more) for name, (ranks, more, _) in layouts.items()})
                for name, (_, _, moe_layers) in layouts.items():
                    self.assert_same(runs[name], runs["one"], f"{config} {name}")
                    # Per MoE layer and micro-batch six exchanges (full recompute) of (ep - 1) blocks of E / ep experts'
                    # C rows of H floats.
                    want = moe_layers * 4 * 6 * (1 * 2 * capacity * 16) * 4
                    self.assertEqual(set(losses(os.path.join(self.dir, config + "_" + name), "alltoall_bytes").values()), {want})

    def test_mixed_precision_at_ep2_trains_the_one_process_model(self):
        config = train_moe.CONFIGS[0]  # precision.type mixed_precision, zero1 True, as NxDT ships it
        runs = self.run_layouts(lambda run, *extra: self.hf(config, run, "model.moe.router_aux_loss_coef=0.1", NO_CKPT, *extra), "mixed_",
                                {"dp2_ep2": (2, [f"{TP}=1", f"{EP}=2"])})
        one, ep = runs["one"], runs["dp2_ep2"]

        def bound(step):  # the first-order effect of every weight rounding to its neighbouring bfloat16
            return BF16_ULP * one[1][step] * one[2][step]

        self.assert_same(ep, one, "mixed_precision", later_tolerance=bound)
        worst = max(abs(ep[0][s] - one[0][s]) for s in one[0])
        print(f"\n  mixed_precision ep 2: worst loss difference {worst:.2e}; bounds after step 1 "
              f"{', '.join(f'{bound(s):.2e}' for s in sorted(one[0])[1:])}", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()

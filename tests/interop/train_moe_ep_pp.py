"""shardkit-train with expert parallelism beside pipeline stages (issue #39).

- Pipeline stages: the HF Mixtral at tp 1 pp 2 dp 2 ep 2 (4 ranks) trains the model one process trains (losses and
  gradient norms within 1e-5, from float32 summation order alone: the dp all-reduce adds the micro-batches' gradients
  in another order, each expert's gradient sums its rows grouped by source rank). Each stage's ep and expert-dp groups
  are RankGrid::ExpertGroup's (ckpt/spec/rank_grid.h: inside its tp and pp place); its token exchange carries the
  analytic count of its own MoE layers only.
Checkpoints stay off here (saving and resuming at ep > 1 is its own work).
"""
import json
import os
import unittest

import numpy as np

from canon import TempDirTest
from indexed_dataset_interop import megatron_write
from train_resume import losses
import train_moe  # its tiny HF Mixtral and set-up helpers (modules: their tests run in their own files)
import train_moe_ep  # its analytic all-to-all count

NO_CKPT = "exp_manager.create_checkpoint_callback=False"
EP, TP, PP = (f"distributed_strategy.{k}_model_parallel_size" for k in ("expert", "tensor", "pipeline"))
FP32 = ["precision.type=fp32", "model.moe.router_aux_loss_coef=0.1", NO_CKPT]


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

    def run_layouts(self, argv, prefix, layouts):
        """Trains `argv(run_dir, *extra)` on one rank and on each layout {name: (ranks, extra)} into prefix + name;
        returns {name: (losses, grad norms, param norms)} with "one" the one process's."""
        out = {}
        for name, (ranks, extra) in {"one": (1, ["trainer.devices=1", f"{TP}=1", f"{PP}=1"]), **layouts}.items():
            self.trained(argv(prefix + name, *extra) + ([f"trainer.devices={ranks}"] if ranks > 1 else []), ranks=ranks)
            out[name] = tuple(losses(os.path.join(self.dir, prefix + name), key) for key in ("loss", "grad_norm", "param_norm"))
        self.assertEqual(sorted(out["one"][0]), [1, 2, 3])
        return out

    def assert_same(self, got, one, msg):
        """Losses within 1e-5, gradient norms within 1e-5 relative."""
        self.assertEqual(sorted(got[0]), sorted(one[0]), msg)
        for step in one[0]:
            self.assertAlmostEqual(got[0][step], one[0][step], delta=1e-5, msg=f"{msg} step {step}")
            self.assertAlmostEqual(got[1][step], one[1][step], delta=1e-5 * one[1][step], msg=f"{msg} step {step}")

    def test_ep2_with_pipeline_stages_trains_the_one_process_model(self):
        for config, capacity_factor in ((train_moe.CONFIGS[0], 2.0), (train_moe.CONFIGS[1], 0.0)):
            with self.subTest(config):
                runs = self.run_layouts(lambda run, *extra: self.hf(config, run, *FP32, *extra), f"{config}_",
                                        {"pp2_dp2_ep2": (4, [f"{TP}=1", f"{PP}=2", f"{EP}=2"])})
                self.assert_same(runs["pp2_dp2_ep2"], runs["one"], config)
                # Each stage's ep group exchanges its own two MoE layers' tokens: 2 layers, 4 micro-batches of rank 0.
                per_stage = train_moe_ep.alltoall_bytes_per_step(2, 2, capacity_factor) * 2 // train_moe.MIXTRAL["num_hidden_layers"]
                got = losses(os.path.join(self.dir, f"{config}_pp2_dp2_ep2"), "alltoall_bytes")
                self.assertEqual(set(got.values()), {per_stage})
                with open(os.path.join(self.dir, f"{config}_pp2_dp2_ep2", "timing.json")) as f:
                    self.assertEqual([r["alltoall_bytes"] for r in json.load(f)["ranks"]], [3 * per_stage] * 4)


if __name__ == "__main__":
    unittest.main()

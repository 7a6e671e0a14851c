"""shardkit-train on NxDT's HF-style Mixtral configs (issue #39): MoE layers in the training core.

- NxDT's two HF Mixtral example configs (tests/data/configs/nxdt, byte for byte), shrunk by overrides as
  trainer_refuses.py shrinks every config and given a tiny MixtralForCausalLM config.json, train and write
  tags whose model files hold NxD's MoE tensors (the names and per-layer order of NxD's own tag,
  tests/data/upstream/nxd_mixtral/hf_ep1_pt, at tp 1 shapes).
- tp 2 (experts cut as NxD cuts them), with sequence parallelism, dp 2 and tp 2 dp 2 train the model one
  process trains (losses within 1e-5).
- Killed after a checkpoint, a run resumes to exactly the uninterrupted run.
- What is not built is refused by name (pipeline parallelism trains: train_moe_megatron.py):
  moe.dropout (NxDT's attention dropout), a Mixtral config.json under a run name without 'mixtral'.
"""
import glob
import json
import os
import re
import signal
import subprocess
import unittest

import torch

from canon import TOKENIZE, TRAIN, TempDirTest, run
from train_hf_llama import mpirun
from train_resume import losses, start_until
import trainer_refuses  # its shrink of NxDT's configs (imported as a module: its tests run in their own file)

HERE = os.path.dirname(os.path.abspath(__file__))
NXD_TAG = os.path.join(HERE, "..", "data", "upstream", "nxd_mixtral", "hf_ep1_pt", "step_2", "model",
                       "dp_rank_00_tp_rank_00_pp_rank_00.pt")
# A tiny Mixtral: 4 layers (the shrink's num_layers), hidden 64 (its hidden_size), 8 experts of width 32.
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 32,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 260,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "hidden_act": "silu",
           "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
           "router_jitter_noise": 0.0}
CONFIGS = ["hf_mixtral_8x7b_config", "hf_mixtral_8x7b_dropless_config"]
MOE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def assert_resumes_exactly(test, argv, model_file):
    """Killed after a checkpoint, a run resumes to exactly the uninterrupted run: `argv(run_dir, *overrides)` is an
    8-step run, `model_file(run_dir, step)` its tag's first model file (train_moe_megatron.py uses it too)."""
    keep = ["exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True",
            "exp_manager.checkpoint_callback_params.save_top_k=-1"]
    test.trained(argv("full", *keep))
    p = start_until(test, [TRAIN, *argv("killed", *keep)], test.dir, os.path.join(test.dir, "killed", "checkpoints", "*", "done"), 300)
    p.send_signal(signal.SIGKILL)
    p.wait()
    test.assertLess(max(losses(os.path.join(test.dir, "killed"))), 8)
    test.trained(argv("killed", *keep, "exp_manager.resume_if_exists=True"))
    test.assertEqual(losses(os.path.join(test.dir, "killed"))[8], losses(os.path.join(test.dir, "full"))[8])
    a, b = model_file("killed", 8), model_file("full", 8)
    test.assertEqual(list(a), list(b))
    for n in a:
        test.assertTrue(torch.equal(a[n], b[n]), n)


class TrainMoe(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, "/usr/share/common-licenses/GPL-3", os.path.join(self.dir, "data", "tok"))
        self.mixtral = os.path.join(self.dir, "mixtral.json")
        with open(self.mixtral, "w") as f:
            json.dump(MIXTRAL, f)

    def argv(self, name, run_dir, *overrides, devices=1, steps=2):
        """NxDT's config `name` shrunk as trainer_refuses.py shrinks it, on our data and the tiny Mixtral."""
        base = trainer_refuses.TrainerRefuses.shrunk(self, name, run_dir, devices=devices)
        return base + ["~data.train_dir", "+data.data_prefix=[1.0,data/tok]", f"model.model_config={self.mixtral}",
                       f"trainer.max_steps={steps}", "exp_manager.save_xser=False", *overrides]

    def train(self, argv, ranks=1):
        return subprocess.run((mpirun(ranks) if ranks > 1 else []) + [TRAIN, *argv], cwd=self.dir, capture_output=True, text=True,
                              timeout=300)

    def trained(self, argv, ranks=1):
        p = self.train(argv, ranks)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p

    def tag(self, run_dir, step):
        (tag,) = glob.glob(os.path.join(self.dir, run_dir, "checkpoints", f"*--step={step}-*.ckpt"))
        return tag

    def test_nxdt_hf_mixtral_configs_train_and_write_nxds_moe_tensors(self):
        nxd = torch.load(NXD_TAG, map_location="cpu")
        nxd_layer0 = [MOE.match(n).group(2) for n in nxd if n.startswith("model.layers.0.")]
        for name in CONFIGS:
            with self.subTest(name):
                p = self.trained(self.argv(name, name))
                self.assertIn("done: steps 0 -> 2", p.stderr)
                # NxDT's HF Mixtral reads neither key: stated, not silently dropped.
                self.assertIn("model.moe.dropless (NxDT's HF Mixtral does not read it", p.stderr)
                model = torch.load(os.path.join(self.tag(name, 2), "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
                for layer in range(4):  # frequency 1: every layer is MoE
                    at = f"model.layers.{layer}."
                    self.assertEqual([n[len(at):] for n in model if n.startswith(at)], nxd_layer0)
                    self.assertEqual(tuple(model[at + "mlp.router.linear_router.weight"].shape), (8, 64))
                    self.assertEqual(tuple(model[at + "mlp.expert_mlps.mlp_op.gate_up_proj.weight"].shape), (8, 64, 64))
                    self.assertEqual(tuple(model[at + "mlp.expert_mlps.mlp_op.down_proj.weight"].shape), (8, 32, 64))
                # mixed_precision: bfloat16 weights, as NxDT's tags hold them.
                self.assertEqual(model["model.layers.0.mlp.router.linear_router.weight"].dtype, torch.bfloat16)
        # The same weights at step 1: capacity_factor 2.0 of 8 experts, top 2 (capacity T / 2) drops tokens the
        # dropless config (capacity_factor 0) keeps, so the losses differ.
        first = [losses(os.path.join(self.dir, name))[1] for name in CONFIGS]
        self.assertNotEqual(first[0], first[1])
        self.assertAlmostEqual(first[0], first[1], delta=1e-3)

    def test_frequency_two_mixes_dense_and_moe_layers(self):
        self.trained(self.argv(CONFIGS[1], "freq2", "model.moe.frequency=2"))
        model = torch.load(os.path.join(self.tag("freq2", 2), "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        moe = sorted({int(MOE.match(n).group(1)) for n in model if ".mlp.router." in n})
        dense = sorted({int(MOE.match(n).group(1)) for n in model if n.endswith(".mlp.gate_up_proj.weight")})
        self.assertEqual((moe, dense), ([0, 2], [1, 3]))  # 0-based layer_index % moe_frequency == 0

    def test_every_layout_trains_the_one_process_model(self):
        # Tensor parallelism cuts every expert's intermediate dimension as NxD does (ckpt::ExpertSpec); with
        # sequence parallelism too, and with data parallelism (tp 2 dp 2 on 4 ranks). Token dropping on.
        fp32 = ["precision.type=fp32", "model.moe.router_aux_loss_coef=0.1", "trainer.max_steps=4"]
        tp = "distributed_strategy.tensor_model_parallel_size"
        self.trained(self.argv(CONFIGS[0], "one", *fp32, devices=4) + ["trainer.devices=1"])
        layouts = {"dp2": (2, [f"{tp}=1"]), "tp2": (2, [f"{tp}=2", "distributed_strategy.sequence_parallel=False"]),
                   "tp2_sp": (2, [f"{tp}=2"]), "tp2_dp2": (4, [f"{tp}=2"])}
        a = losses(os.path.join(self.dir, "one"))
        self.assertEqual(sorted(a), [1, 2, 3, 4])
        for name, (ranks, extra) in layouts.items():
            with self.subTest(name):
                self.trained(self.argv(CONFIGS[0], name, *fp32, devices=4) + [f"trainer.devices={ranks}", *extra], ranks=ranks)
                b = losses(os.path.join(self.dir, name))
                self.assertEqual(sorted(b), sorted(a))
                for step in a:
                    self.assertAlmostEqual(a[step], b[step], delta=1e-5, msg=step)
        # tp rank 1 holds [gate_1 || up_1] of every expert (stride 2 on the last dim) and down_proj's rows 16..31.
        model = {t: torch.load(os.path.join(self.tag("tp2", 4), "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")) for t in (0, 1)}
        for t in (0, 1):
            self.assertEqual(tuple(model[t]["model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"].shape), (8, 64, 32))
            self.assertEqual(tuple(model[t]["model.layers.0.mlp.expert_mlps.mlp_op.down_proj.weight"].shape), (8, 16, 64))
        router = "model.layers.0.mlp.router.linear_router.weight"
        self.assertTrue(torch.equal(model[0][router], model[1][router]))  # replicated, the same step on both

    def test_killed_run_resumes_exactly(self):
        assert_resumes_exactly(self, lambda run_dir, *extra: self.argv(CONFIGS[0], run_dir, *extra, steps=8),
                               lambda run_dir, step: torch.load(os.path.join(self.tag(run_dir, step), "model",
                                                                             "dp_rank_00_tp_rank_00_pp_rank_00.pt")))

    def test_what_is_not_built_is_refused_by_name(self):
        cases = [
            (self.argv(CONFIGS[0], "drop", "model.moe.dropout=0.1"), 1, "model.moe.dropout: becomes the attention dropout"),
            (self.argv(CONFIGS[0], "name", "name=hf_llama", "exp_manager.name=hf_llama"), 1,
             "does not hold 'mixtral': NxDT's training.py builds its dense HFLLamaModule"),
            (self.argv(CONFIGS[0], "top1", "model.moe.top_k=1"), 1, "model.moe.normalize_top_k_affinities: needs top_k > 1"),
        ]
        for argv, ranks, message in cases:
            with self.subTest(message):
                p = self.train(argv, ranks)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)


if __name__ == "__main__":
    unittest.main()

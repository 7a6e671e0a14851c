"""shardkit-train on NxDT's Megatron-style Mixtral configs (issue #39): NeuronSwitchMLP in the training core.

- NxDT's two Megatron Mixtral example configs (tests/data/configs/nxdt, byte for byte), shrunk by overrides to the
  sizes of NxD's own Megatron Mixtral tag (tests/data/upstream/nxd_mixtral/megatron_ep1_pt: 2 layers, hidden 16,
  4 experts of width 32, vocabulary 64), train at tp 1 and tp 2 and write model files holding that tag's names,
  order and shapes (tp 2: each tp rank's file as NxD's; tp 1: the full tensors of its gathered state).
- The MoE layers are the Megatron model's: 1-based layer_number % frequency == 0 (NxDT models/megatron/
  transformer.py ParallelTransformerLayer), the names of NxD's freq-2 tag; one expert is a dense model.
- The layer itself is the HF-style one's (libtrain/moe_layer, checked against NxD's modules by
  tests/data/upstream/nxd_moe_layer): NeuronSwitchMLP builds NxD's RouterTopK(num_experts, top_k, hidden_size,
  dtype=float32) and ExpertMLPs(..., glu_mlp=True, capacity_factor, normalize_top_k_affinities, dtype=float32)
  as modeling_mixtral.py initialize_mixtral_moe_layer builds them (float32 is both modules' default), and
  MoE(router, expert_mlps, sequence_parallel_enabled=...) around them; the layer's output is mlp_output[0] in
  both. Only the defaults of model.moe differ (megatron_gpt_model.py: capacity_factor E / k,
  output_router_logits False, router_aux_loss_coef 0.0).
- tp 2 (+SP) and dp 2 train the model one process trains (losses within 1e-5); killed, a run resumes exactly.
- Pipeline parallelism, both styles: NxDT's decoder layers concatenate their router logits onto
  past_router_logits (models/megatron/transformer.py ParallelTransformerLayer.forward, modeling_mixtral.py), which
  NxD's pipeline passes from stage to stage (load_balancing_loss_func is autowrapped: lightning_modules/model/base.py)
  to the last stage's loss (gpt_model.py load_balancing_loss_func(lm_output[-1], ...)). Here the routing statistics
  travel with the hidden state and their totals back with its gradient: pp 2 gives pp 1's losses within 1e-5, and
  its tags verify (ckpt-verify).
- Sinkhorn routing is refused by name; router_activation (RouterSinkhorn's only) and dropless are named as ignored.
"""
import glob
import json
import os
import unittest

import numpy as np
import torch

from canon import VERIFY, TempDirTest, run
from indexed_dataset_interop import megatron_write
from train_resume import losses
import train_moe  # its tiny HF Mixtral and its shrink of the HF configs (a module: its tests run in their own file)
import train_moe_ep_ckpt  # its killed-run check at ep > 1 (a module: its tests run in their own file)
import trainer_refuses  # its shrink of NxDT's configs (imported as a module: its tests run in their own file)

HERE = os.path.dirname(os.path.abspath(__file__))
NXD = os.path.join(HERE, "..", "data", "upstream", "nxd_mixtral")
CONFIGS = ["megatron_mixtral_8x7b_config", "megatron_mixtral_8x7b_dropless_config"]
# NxD's tag's model (megatron_ep1_full_state.pt config): its vocabulary is 64, so the data's tokens are below 64.
TINY = ["model.num_layers=2", "model.hidden_size=16", "model.ffn_hidden_size=32", "model.moe.num_experts=4",
        "model.vocab_size=64", "exp_manager.save_xser=False"]
RANK_FILE = "dp_rank_00_tp_rank_{:02d}_pp_rank_00.pt"


def shapes(state):
    return [(n, tuple(t.shape)) for n, t in state.items()]


class TrainMoeMegatron(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        rng = np.random.default_rng(39)
        megatron_write(os.path.join(self.dir, "data", "tok"), [rng.integers(0, 64, 200) for _ in range(40)], np.uint16)

    def argv(self, name, run_dir, *overrides, devices=1, steps=2, pp=1):
        """NxDT's config `name` shrunk as trainer_refuses.py shrinks it, then to NxD's tag's sizes."""
        return (trainer_refuses.TrainerRefuses.shrunk(self, name, run_dir, devices=devices, pp=pp) + TINY +
                [f"trainer.max_steps={steps}", *overrides])

    train = train_moe.TrainMoe.train  # plain functions: these run in this class
    trained = train_moe.TrainMoe.trained
    tag = train_moe.TrainMoe.tag

    def model_file(self, run_dir, step, tp_rank=0):
        (tag,) = glob.glob(os.path.join(self.dir, run_dir, "checkpoints", f"*--step={step}-*.ckpt"))
        return torch.load(os.path.join(tag, "model", RANK_FILE.format(tp_rank)), map_location="cpu")

    def test_nxdt_megatron_mixtral_configs_write_nxds_tensors(self):
        full = torch.load(os.path.join(NXD, "megatron_ep1_full_state.pt"), map_location="cpu")["model"]
        nxd = [torch.load(os.path.join(NXD, "megatron_ep1_pt", "step_2", "model", RANK_FILE.format(t)), map_location="cpu")
               for t in (0, 1)]
        for name in CONFIGS:
            with self.subTest(name):
                p = self.trained(self.argv(name, name))
                self.assertIn("done: steps 0 -> 2", p.stderr)
                # RouterTopK is softmax: the config's sigmoid is RouterSinkhorn's; dropless is read by neither style.
                self.assertIn("model.moe.router_activation (only NxD's RouterSinkhorn reads it", p.stderr)
                self.assertIn("model.moe.dropless (NxDT's HF Mixtral does not read it, nor does its Megatron-style model", p.stderr)
                self.assertEqual(shapes(self.model_file(name, 2)), shapes(full))
                tp2 = name + "_tp2"
                self.trained(self.argv(name, tp2, "distributed_strategy.tensor_model_parallel_size=2", devices=2), ranks=2)
                for t in (0, 1):
                    self.assertEqual(shapes(self.model_file(tp2, 2, t)), shapes(nxd[t]), t)
        # Token dropping: capacity_factor 2.0 of 4 experts, top 2 (capacity T) drops nothing here, so the two configs
        # (the dropless one's capacity_factor is 0) train alike; capacity_factor 1.0 (capacity T / 2) drops tokens.
        a, b = (losses(os.path.join(self.dir, n)) for n in CONFIGS)
        self.assertEqual(a, b)
        self.trained(self.argv(CONFIGS[0], "cf1", "model.moe.capacity_factor=1.0"))
        self.assertNotEqual(losses(os.path.join(self.dir, "cf1"))[1], a[1])

    def test_moe_layers_are_the_megatron_models_1_based_ones(self):
        self.trained(self.argv(CONFIGS[1], "freq2", "model.moe.frequency=2"))
        nxd = torch.load(os.path.join(NXD, "megatron_freq2_ep1_full_state.pt"), map_location="cpu")["model"]
        self.assertEqual(shapes(self.model_file("freq2", 2)), shapes(nxd))  # layer 1 (layer_number 2) is MoE, layer 0 dense
        self.assertIn("language_model.encoder.layers.1.mlp.moe.router.linear_router.weight", nxd)
        # One expert: NxDT builds ParallelMLP in every layer (num_moe_experts > 1 builds NeuronSwitchMLP).
        self.trained(self.argv(CONFIGS[1], "dense", "model.moe.num_experts=1", "model.moe.top_k=1"))
        names = list(self.model_file("dense", 2))
        self.assertFalse([n for n in names if ".moe." in n])
        self.assertIn("language_model.encoder.layers.0.mlp.dense_h_to_4h.weight", names)

    def test_every_layout_trains_the_one_process_model(self):
        fp32 = ["precision.type=fp32", "model.moe.capacity_factor=1.0", "model.moe.router_aux_loss_coef=0.1", "model.optim.lr=0.01"]
        tp = "distributed_strategy.tensor_model_parallel_size"
        self.trained(self.argv(CONFIGS[0], "one", *fp32, devices=2, steps=3) + ["trainer.devices=1"])
        a = losses(os.path.join(self.dir, "one"))
        self.assertEqual(sorted(a), [1, 2, 3])
        layouts = {"dp2": [f"{tp}=1"], "tp2": [f"{tp}=2", "distributed_strategy.sequence_parallel=False"], "tp2_sp": [f"{tp}=2"]}
        for name, extra in layouts.items():
            with self.subTest(name):
                self.trained(self.argv(CONFIGS[0], name, *fp32, *extra, devices=2, steps=3), ranks=2)
                b = losses(os.path.join(self.dir, name))
                self.assertEqual(sorted(b), sorted(a))
                for step in a:
                    self.assertAlmostEqual(a[step], b[step], delta=1e-5, msg=step)
        # The auxiliary loss is in the loss: without it, another loss at step 1 (the same weights).
        self.trained(self.argv(CONFIGS[0], "no_aux", *fp32, "model.moe.output_router_logits=False", devices=2, steps=1) +
                     ["trainer.devices=1"])
        self.assertNotAlmostEqual(losses(os.path.join(self.dir, "no_aux"))[1], a[1], delta=1e-5)

    def test_pipeline_stages_train_the_one_process_model(self):
        # The auxiliary loss (coefficient 0.1) joins the MoE layers of both stages; with it on one stage's layers
        # alone, or each stage's gradient from its own layers' counts, pp 2 would train another model.
        fp32 = ["precision.type=fp32", "model.moe.router_aux_loss_coef=0.1", "model.optim.lr=0.01", "model.moe.output_router_logits=True"]
        pp = "distributed_strategy.pipeline_model_parallel_size"
        self.mixtral = os.path.join(self.dir, "mixtral.json")
        with open(self.mixtral, "w") as f:
            json.dump(train_moe.MIXTRAL, f)
        styles = {  # each run: 2 devices' global batch, on 1 rank (pp 1) or 2 (pp 2)
            "megatron": lambda run_dir, *extra: self.argv(CONFIGS[0], run_dir, *fp32, *extra, devices=2, pp=2, steps=3),
            "hf": lambda run_dir, *extra: train_moe.TrainMoe.argv(self, train_moe.CONFIGS[0], run_dir, *fp32, *extra, devices=2, steps=3),
        }
        for style, argv in styles.items():
            with self.subTest(style):
                self.trained(argv(style + "_pp1", f"{pp}=1", "trainer.devices=1"))
                self.trained(argv(style + "_pp2", f"{pp}=2", "trainer.devices=2"), ranks=2)
                a, b = (losses(os.path.join(self.dir, f"{style}_pp{n}")) for n in (1, 2))
                self.assertEqual(sorted(a), [1, 2, 3])
                self.assertEqual(sorted(b), sorted(a))
                for step in a:
                    self.assertAlmostEqual(a[step], b[step], delta=1e-5, msg=step)
                (tag,) = glob.glob(os.path.join(self.dir, style + "_pp2", "checkpoints", "*.ckpt"))
                self.assertEqual(sorted(os.listdir(os.path.join(tag, "model"))),
                                 [f"dp_rank_00_tp_rank_00_pp_rank_{s:02d}.pt" for s in (0, 1)])
                run(VERIFY, tag)

    def test_killed_run_resumes_exactly(self):
        train_moe.assert_resumes_exactly(self, lambda run_dir, *extra: self.argv(CONFIGS[0], run_dir, *extra, steps=8),
                                         self.model_file)

    def test_killed_run_resumes_exactly_at_ep2(self):
        """dp 2 ep 2 (two ranks): the Megatron style saves NxD's ep layout (NeuronEPZero1Optimizer files; NxD's
        load_checkpoint reads such a tag: nxd_mixtral/load_check_train_megatron_ep2.out.txt) and resumes exactly."""
        ep2 = ["precision.type=fp32", "distributed_strategy.expert_model_parallel_size=2",
               "exp_manager.create_checkpoint_callback=True", "exp_manager.save_xser=True"]
        train_moe_ep_ckpt.assert_killed_run_resumes_exactly(
            self, lambda run_dir, *extra, steps: self.argv(CONFIGS[0], run_dir, *ep2, *extra, devices=2, steps=steps), 2)

    def test_what_is_not_built_is_refused_by_name(self):
        cases = [
            (["model.moe.routing_algorithm=sinkhorn", "model.moe.top_k=1", "model.moe.normalize_top_k_affinities=False"],
             "model.moe.routing_algorithm: 'sinkhorn': Sinkhorn routing (NxD's RouterSinkhorn); shardkit does not implement it"),
            (["model.moe.routing_algorithm=expert_choice"], "model.moe.routing_algorithm: 'expert_choice' is neither top_k nor sinkhorn"),
            (["model.moe.top_k=1"], "model.moe.normalize_top_k_affinities: needs top_k > 1"),
        ]
        for i, (overrides, message) in enumerate(cases):
            with self.subTest(message):
                p = self.train(self.argv(CONFIGS[0], f"bad{i}", *overrides))
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertFalse(os.path.exists(os.path.join(self.dir, f"bad{i}")))


if __name__ == "__main__":
    unittest.main()

"""shardkit-train with interleaved (virtual) pipeline stages
(distributed_strategy.virtual_pipeline_model_parallel_size, #37).

- At pp 2 with 2 virtual stages (4 layers: pp rank 0 holds layers 0 and 2,
  pp rank 1 layers 1 and 3, as NxD's NxDPPModel places stages p, p + pp) the
  losses equal one process's within 1e-5, Megatron-style (Llama, and GPT with
  its embedding tied across the first and last virtual stage), at tp 1 and
  tp 2, and HF-style.
- The tag lays out NxD's virtual-stage layout: each pp rank's model file holds
  its chunks' layers under their global names, chunk after chunk (NxD
  pipeline/model.py local_state_dict), the optimizer state in that order, and
  the manifest records the stage map.
- Killed after a checkpoint, the run resumes exactly; a run at another layout
  refuses the tag naming both stage maps.
- The config is refused, naming the key and why, when the interleaved schedule
  cannot run it.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import unittest

import torch

from canon import TOKENIZE, TRAIN, TempDirTest, run
from megatron_partition import is_buffer, nxdt_order
from train_parallel import mpirun
from train_resume import CONF, CONF_DIR, GPT_CONF, TEXT, losses, start_until

VPP = "distributed_strategy.virtual_pipeline_model_parallel_size"
LOSS_RTOL = 1e-5
STEPS = 8
HF_CONF = os.path.join(CONF_DIR, "hf_llama.yaml")


class VirtualPipeline(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))

    def command(self, log_dir, world, extra=(), conf=CONF, steps=STEPS, tp=1, pp=1, vpp=1, every=4):
        # 16 samples of 4 per step: 4 micro-batches per data-parallel rank, two groups of pp 2.
        return [*mpirun(world), TRAIN, conf, f"exp_manager.explicit_log_dir={log_dir}", f"trainer.devices={world}",
                f"distributed_strategy.tensor_model_parallel_size={tp}", f"distributed_strategy.pipeline_model_parallel_size={pp}",
                f"++{VPP}={vpp}", f"trainer.max_steps={steps}", "++model.optim.sched.max_steps=40", "data.global_batch_size=16",
                "model.num_layers=4", f"exp_manager.checkpoint_callback_params.every_n_train_steps={every}",
                "exp_manager.checkpoint_callback_params.save_top_k=-1", "exp_manager.async_checkpointing=False", *extra]

    def train(self, log_dir, world, extra=(), conf=CONF, check=True, **kw):
        p = subprocess.run(self.command(log_dir, world, extra, conf, **kw), cwd=self.dir, capture_output=True, text=True,
                           timeout=300)
        if check:
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def tag(self, log_dir, step=STEPS):
        (t,) = glob.glob(os.path.join(self.dir, log_dir, "checkpoints", f"*--step={step}-*.ckpt"))
        return t

    def assert_same_losses(self, one, many):
        a, b = losses(os.path.join(self.dir, one)), losses(os.path.join(self.dir, many))
        self.assertEqual(sorted(b), list(range(1, STEPS + 1)))
        worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in b)
        print(f"\n  {self.id().split('.')[-1]}: worst relative loss difference {worst:.2e}", file=sys.stderr)
        self.assertLess(worst, LOSS_RTOL)
        self.assertGreater(a[1] - a[STEPS], 0.05)  # the losses move

    def model_file(self, log_dir, pp_rank, tp_rank=0):
        return torch.load(os.path.join(self.tag(log_dir), "model", f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"))

    def layers_in_order(self, names):
        """The layer numbers of `names` in the order they first appear."""
        out = []
        for n in names:
            if ".layers." in n:
                layer = int(n.split(".layers.")[1].split(".")[0])
                if layer not in out:
                    out.append(layer)
        return out

    def check_vpp(self, conf, extra=(), tp=1):
        # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp: one process pads as tp does.
        self.train("one", 1, [*extra, f"model.make_vocab_size_divisible_by={8 * tp}"], conf)
        self.train("vpp", 2 * tp, extra, conf, tp=tp, pp=2, vpp=2)
        self.assert_same_losses("one", "vpp")
        one = self.model_file("one", 0)
        ranks = [self.model_file("vpp", p) for p in (0, 1)]
        # NxD's virtual-stage layout: chunk after chunk, global layer names.
        self.assertEqual([self.layers_in_order(r) for r in ranks], [[0, 2], [1, 3]])
        if tp == 1:  # every tensor of one process on one of the ranks, close to it
            merged = {**ranks[0], **ranks[1]}
            self.assertEqual(sorted(merged), sorted(one))
            for k, v in one.items():
                self.assertTrue(torch.allclose(merged[k].float(), v.float(), rtol=1e-3, atol=1e-5), k)
        with open(os.path.join(self.tag("vpp"), "manifest.json")) as f:
            self.assertEqual(json.load(f)["layout"]["stages"], [[[0, 1], [2, 3]], [[1, 2], [3, 4]]])
        return ranks

    def test_llama_pp2_vpp2_matches_one_process(self):
        ranks = self.check_vpp(CONF, extra=["distributed_strategy.zero1=True"])
        # The first virtual stage's embedding on pp rank 0, the last's final norm and output layer on pp rank 1.
        self.assertEqual(list(ranks[0])[0], "language_model.embedding.word_embeddings.weight")
        self.assertEqual(list(ranks[1])[-2:], ["language_model.encoder.final_layernorm.weight", "language_model.output_layer.weight"])
        # The optimizer ids follow the rank's parameters chunk after chunk (NxD's local_named_parameters,
        # grouped as NxDT's get_param_groups does: nxdt_order): each rank's moments are one process's.
        def moments(log_dir, p, names):
            f = torch.load(os.path.join(self.tag(log_dir), "optim", f"dp_rank_00_tp_rank_00_pp_rank_{p:02d}.pt"))
            ids = nxdt_order([n for n in names if not is_buffer(n)], False)
            self.assertEqual(len(f["base_state"]), len(ids))
            return {n: f["base_state"][i]["exp_avg"] for i, (n, _) in enumerate(ids)}
        one = moments("one", 0, list(self.model_file("one", 0)))
        for p in (0, 1):
            for n, m in moments("vpp", p, list(ranks[p])).items():
                self.assertTrue(torch.allclose(m, one[n], rtol=1e-3, atol=1e-6), f"pp rank {p}: {n}")

    def test_llama_tp2_pp2_vpp2_matches_one_process(self):
        self.check_vpp(CONF, extra=["distributed_strategy.zero1=False", "model.hidden_dropout=0.1"], tp=2)

    def test_gpt_pp2_vpp2_tied_embedding_matches_one_process(self):
        # The embedding on the first virtual stage (pp rank 0, chunk 0) and its output copy on the last (pp rank 1,
        # chunk 1): their gradients are summed between the two ranks, so the copies stay equal.
        ranks = self.check_vpp(GPT_CONF)
        emb, out = "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"
        self.assertIn(emb, ranks[0])
        self.assertNotIn(out, ranks[0])
        self.assertIn(out, ranks[1])
        self.assertNotIn(emb, ranks[1])
        self.assertTrue(torch.equal(ranks[0][emb], ranks[1][out]))

    def test_hf_llama_pp2_vpp2_matches_one_process(self):
        with open(os.path.join(CONF_DIR, "hf_llama_config.json")) as f:
            config = json.load(f)
        config["num_hidden_layers"] = 4
        path = os.path.join(self.dir, "four_layers.json")
        with open(path, "w") as f:
            json.dump(config, f)
        hf = [f"model.model_config={path}", "distributed_strategy.kv_replicator=1", "distributed_strategy.sequence_parallel=False",
              "++exp_manager.save_xser=False"]
        self.train("one", 1, hf, HF_CONF)
        self.train("vpp", 2, hf, HF_CONF, pp=2, vpp=2)
        self.assert_same_losses("one", "vpp")
        self.assertEqual([self.layers_in_order(self.model_file("vpp", p)) for p in (0, 1)], [[0, 2], [1, 3]])

    def test_killed_run_resumes_exactly(self):
        extra, steps = ["distributed_strategy.zero1=True"], 24
        self.train("straight", 2, extra, steps=steps, pp=2, vpp=2)
        killed = os.path.join(self.dir, "killed")
        p = start_until(self, self.command(killed, 2, extra, steps=steps, pp=2, vpp=2), self.dir,
                        os.path.join(killed, "checkpoints", "*step=8-*", "done"), 120)
        ranks = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "shardkit-train"], capture_output=True, text=True).stdout.split()
        self.assertEqual(len(ranks), 2)
        os.kill(int(ranks[-1]), signal.SIGKILL)
        self.assertNotEqual(p.wait(timeout=60), 0)
        r = self.train("killed", 2, extra, steps=steps, pp=2, vpp=2)
        self.assertRegex(r.stderr, r"resumed from \S*step=(8|12|16|20)-")
        self.assertEqual(losses(os.path.join(self.dir, "straight")), losses(killed))
        for sub in ("model", "optim"):
            for f in sorted(os.listdir(os.path.join(self.tag("straight", steps), sub))):
                with open(os.path.join(self.tag("straight", steps), sub, f), "rb") as f1, \
                     open(os.path.join(self.tag("killed", steps), sub, f), "rb") as f2:
                    self.assertEqual(f1.read(), f2.read(), f"{sub}/{f} differs")

    def test_a_tag_of_other_stages_is_refused_naming_both(self):
        self.train("vpp", 2, pp=2, vpp=2, steps=4)
        plain = self.train("plain", 2, [f"exp_manager.resume_from_checkpoint={self.tag('vpp', 4)}"], check=False, pp=2, steps=4)
        self.assertNotEqual(plain.returncode, 0, plain.stderr)
        self.assertIn("its pipeline ranks hold layers 0..0 2..2 | 1..1 3..3, but this run's hold 0..1 | 2..3", plain.stderr)
        # And the other way: resume_reshard does not write virtual stages (ckpt-reshard --virtual_pipeline_size does).
        self.train("plain2", 2, pp=2, steps=4)
        vpp = self.train("vpp2", 2, [f"exp_manager.resume_from_checkpoint={self.tag('plain2', 4)}", "++exp_manager.resume_reshard=True"],
                         check=False, pp=2, vpp=2, steps=4)
        self.assertNotEqual(vpp.returncode, 0, vpp.stderr)
        self.assertIn("resume_reshard does not write interleaved (virtual) pipeline stages", vpp.stderr)

    def test_resume_reshard_moves_a_virtual_stage_tag_to_one_process(self):
        # Trained at pp 2 with 2 virtual stages to step 4, then resumed by one process: the trainer's
        # resume_reshard re-lays the virtual-stage tag (ckpt-reshard's reader learns the stage map), and
        # steps 5-8 equal one process's straight run.
        extra = ["distributed_strategy.zero1=True"]
        self.train("straight", 1, extra)
        self.train("moved", 2, extra, pp=2, vpp=2, steps=4)
        r = self.train("moved", 1, [*extra, "++exp_manager.resume_reshard=True"])
        new_tag = os.path.join(self.dir, "moved", "checkpoints-tp1pp1dp1", os.path.basename(self.tag("moved", 4)))
        self.assertIn("resumed from " + new_tag, r.stderr)
        with open(os.path.join(new_tag, "manifest.json")) as f:
            self.assertEqual(json.load(f)["layout"]["stages"], [[[0, 4]]])
        a, b = losses(os.path.join(self.dir, "straight")), losses(os.path.join(self.dir, "moved"))
        self.assertEqual(sorted(s for s in b if s > 4), [5, 6, 7, 8])
        worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in range(5, STEPS + 1))
        print(f"\n  resumed at pp 1 from pp 2 x 2 virtual stages: worst relative loss difference {worst:.2e}", file=sys.stderr)
        self.assertLess(worst, LOSS_RTOL)

    def test_configs_the_interleaved_schedule_cannot_run_are_refused(self):
        cases = [
            # 12 samples of 4: 3 micro-batches, not a multiple of pp 2 (NxD's TrainInterleavedSchedule refuses it too).
            (2, ["data.global_batch_size=12"], dict(pp=2, vpp=2),
             "data.global_batch_size: the interleaved schedule runs micro-batches in groups of pp: 3 micro-batches per data-parallel "
             "rank are not a multiple of pp 2"),
            # 3 layers cannot fill pp * V = 4 stages.
            (2, ["model.num_layers=3"], dict(pp=2, vpp=2), f"{VPP}: pipeline parallel degree 4 exceeds the 3 layers"),
            (1, [], dict(vpp=2), f"{VPP}: 2: interleaved (virtual) pipeline stages; shardkit does not implement it without "
                                 "distributed_strategy.pipeline_model_parallel_size above 1"),
            (2, ["+model.virtual_pipeline_model_parallel_size=4"], dict(pp=2, vpp=2),
             "model.virtual_pipeline_model_parallel_size: 4 disagrees with " + VPP + " (2)"),
        ]
        for i, (world, extra, kw, message) in enumerate(cases):
            with self.subTest(message):
                p = self.train(f"bad{i}", world, extra, check=False, **kw)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertFalse(os.path.exists(os.path.join(self.dir, f"bad{i}")))


if __name__ == "__main__":
    unittest.main()

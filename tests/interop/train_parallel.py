"""shardkit-train under mpirun: tensor, pipeline and data parallelism,
with and without ZeRO-1.

Every layout must compute what one process computes: the same losses at every
step (relative 1e-5, fp32) and, at the checkpoint, the same state within a
tolerance (ckpt-verify --against --rtol/--atol). The files are NxD's: torch
reads the ZeRO-1 shards of every dp rank and they join into one process's
moments. A rank SIGKILLed ends the job, and the restart resumes every rank
from the last complete tag. A tag written at other degrees is refused with the
ckpt-reshard command, which run as printed makes a tag the new layout resumes
from, continuing the one-process run.

The worst relative loss difference seen is printed to stderr for the record.
"""
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import unittest

import torch

from canon import BIN, RESHARD, TOKENIZE, TRAIN, TempDirTest, VERIFY, run
from megatron_partition import is_buffer, merge, merge_tag
from train_reference import forward
from train_resume import CONF, GPT_CONF, TEXT, losses, start_until

STEPS = 20
# Dropout everywhere Megatron puts it: masks are keyed on global sample positions, so a rank
# drawing them for its share of the batch draws what one process does.
# (tiny_gpt.yaml has them already.)
DROPOUT = ["model.hidden_dropout=0.1", "+model.attention_dropout=0.1", "+model.ffn_dropout=0.1"]
LOSS_RTOL = 1e-5
MASTER_ATOL = 3e-5  # below a tenth of one AdamW step at the LR's floor (3e-4)
GRAD_NORM_RTOL = 1e-4  # ZeRO-1 dp 3 with the ranks' sums of squares not all-reduced: 4.3e-1 (measured once)


def mpirun(n):
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n)] if n > 1 else []


class DataParallel(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))

    def command(self, log_dir, world, extra=(), conf=CONF, steps=STEPS, tp=1, pp=1):
        # 16 samples of 4 per step: 4 micro-batches, 2 per rank at dp 2, so accumulation is exercised too.
        return [*mpirun(world), TRAIN, conf, f"exp_manager.explicit_log_dir={log_dir}", f"trainer.devices={world}",
                f"distributed_strategy.tensor_model_parallel_size={tp}", f"distributed_strategy.pipeline_model_parallel_size={pp}",
                f"trainer.max_steps={steps}", "+model.optim.sched.max_steps=40", "data.global_batch_size=16",
                "exp_manager.checkpoint_callback_params.every_n_train_steps=10",
                "exp_manager.checkpoint_callback_params.save_top_k=-1", *extra]

    def train(self, log_dir, world, extra=(), conf=CONF, steps=STEPS, check=True, tp=1, pp=1):
        p = subprocess.run(self.command(log_dir, world, extra, conf, steps, tp, pp), cwd=self.dir, capture_output=True, text=True)
        if check:
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def tag(self, log_dir, step, name="tiny_llama"):
        return os.path.join(self.dir, log_dir, "checkpoints", f"{name}--step={step}-consumed_samples={16.0 * step}.ckpt")

    def assert_same_losses(self, one, two, steps=range(1, STEPS + 1)):
        a, b = losses(os.path.join(self.dir, one)), losses(os.path.join(self.dir, two))
        self.assertEqual(sorted(b), sorted(set(b) | set(steps)))
        worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in steps)
        print(f"\n  {self.id().split('.')[-1]}: {two} vs {one}, worst relative loss difference {worst:.2e} "
              f"over steps {steps.start}-{steps.stop - 1}", file=sys.stderr)
        self.assertLess(worst, LOSS_RTOL)
        # The losses move: equal losses would prove nothing if they did not.
        self.assertGreater(a[steps.start] - a[steps.stop - 1], 0.1)
        # The gradient norm, all-reduced over every layout's ranks and clipped against, as well: a rank
        # left out of its reduction (tp, dp or pp) changes it long before the loss shows it.
        ga, gb = losses(os.path.join(self.dir, one), "grad_norm"), losses(os.path.join(self.dir, two), "grad_norm")
        worst = max(abs(ga[s] - gb[s]) / abs(ga[s]) for s in steps)
        self.assertLess(worst, GRAD_NORM_RTOL, f"worst relative grad_norm difference {worst:.2e}")

    def assert_same_state(self, a, b, rtol, atol, exact=False):
        """With `exact`, bit for bit (a pipeline alone changes no summation order); otherwise within
        the tolerance, and then not bit for bit (reductions over ranks sum in other orders), so the
        tolerance is what makes them the same."""
        tolerance = [] if exact else ["--rtol", str(rtol), "--atol", str(atol)]
        v = subprocess.run([VERIFY, a, "--against", b, *tolerance, "--json"], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        report = json.loads(v.stdout)
        self.assertTrue(report["same"])
        self.assertGreaterEqual(report["tensors_compared"], 3 * 10)  # parameters, exp_avg, exp_avg_sq
        if not exact:
            bitwise = subprocess.run([VERIFY, a, "--against", b], capture_output=True, text=True)
            self.assertEqual(bitwise.returncode, 1, bitwise.stdout)
        return report

    def check_equivalence(self, conf, extra, name, rtol):
        self.train("one", 1, extra, conf)
        self.train("two", 2, extra, conf)
        self.assert_same_losses("one", "two")
        self.assert_same_state(self.tag("one", STEPS, name), self.tag("two", STEPS, name), rtol, 1e-5)

    def test_llama_plain_data_parallel_matches_one_process(self):
        self.check_equivalence(CONF, ["distributed_strategy.zero1=False", *DROPOUT], "tiny_llama", 1e-3)
        # Without ZeRO-1 only dp rank 0 writes the (whole) optimizer state.
        self.assertEqual(os.listdir(os.path.join(self.tag("two", STEPS), "optim")), ["dp_rank_00_tp_rank_00_pp_rank_00.pt"])

    def test_llama_zero1_dp3_with_rows_dp_does_not_divide_matches_one_process(self):
        # dp 3: 24 samples of 4 per step are 6 micro-batches, 2 per rank; hidden 64 and the other
        # row counts are not multiples of 3, so ZeRO-1 pads every shard set (torch_xla's _shard_tensor).
        extra = ["distributed_strategy.zero1=True", "data.global_batch_size=24", *DROPOUT]
        self.train("one", 1, extra)
        self.train("three", 3, extra)
        self.assert_same_losses("one", "three")
        tag = lambda d: os.path.join(self.dir, d, "checkpoints", f"tiny_llama--step={STEPS}-consumed_samples={24.0 * STEPS}.ckpt")
        self.assert_same_state(tag("one"), tag("three"), 1e-3, 1e-5)
        shards = [torch.load(os.path.join(tag("three"), "optim", f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt")) for d in range(3)]
        padded = 0
        for i, shape in shards[0]["shape_info"].items():
            rows = shape[0]
            chunk = -(-rows // 3)
            self.assertEqual([s["base_state"][i]["exp_avg"].shape[0] for s in shards], [chunk] * 3)
            if rows % 3:
                pad = 3 * chunk - rows  # the last shard's last rows are padding, kept zero
                self.assertEqual(torch.count_nonzero(shards[2]["base_state"][i]["exp_avg"][chunk - pad:]).item(), 0)
                padded += 1
        self.assertGreater(padded, 0)

    def test_llama_zero1_data_parallel_matches_one_process_and_writes_nxd_shards(self):
        self.check_equivalence(CONF, ["distributed_strategy.zero1=True", *DROPOUT], "tiny_llama", 1e-3)
        one = torch.load(os.path.join(self.tag("one", STEPS), "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        shards = [torch.load(os.path.join(self.tag("two", STEPS), "optim", f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt"))
                  for d in range(2)]
        model = torch.load(os.path.join(self.tag("two", STEPS), "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        self.assertEqual(sorted(os.listdir(os.path.join(self.tag("two", STEPS), "model"))), ["dp_rank_00_tp_rank_00_pp_rank_00.pt"])
        for s in shards:  # torch-xla ZeRO-1's layout, as NxD saves it
            self.assertEqual(set(s), {"state", "param_groups", "base_state", "shape_info"})
            self.assertEqual(s["state"], {})
            self.assertEqual(s["param_groups"], one["param_groups"])
        n = len(one["base_state"])
        self.assertEqual(n, len([k for k in model if not k.endswith(".inv_freq")]))  # parameters, not RoPE's buffers
        joined = 0
        for i in range(n):
            full_shape = one["shape_info"][i]
            rows = full_shape[0]
            chunk = (rows + 1) // 2  # padded on dim 0 to a multiple of dp, cut in dp chunks
            for key in ("exp_avg", "exp_avg_sq"):
                parts = [s["base_state"][i][key] for s in shards]
                for p in parts:
                    self.assertEqual(tuple(p.shape), (chunk, *full_shape[1:]))
                    self.assertEqual(p.dtype, torch.float32)
                    self.assertEqual(tuple(shards[0]["shape_info"][i]), tuple(full_shape))
                whole = torch.cat(parts)[:rows]
                if rows % 2:
                    self.assertEqual(torch.count_nonzero(parts[1][-1]).item(), 0)  # the padding row
                want = one["base_state"][i][key]
                self.assertTrue(torch.allclose(whole, want, rtol=1e-3, atol=1e-7),
                                f"{key} of {i}: {(whole - want).abs().max().item()}")
                joined += 1
            self.assertEqual(float(shards[1]["base_state"][i]["step"]), float(STEPS))
        self.assertEqual(joined, 2 * n)

    def test_gpt_mixed_precision_zero1_matches_one_process(self):
        # bfloat16 parameters with fp32 master weights sharded over dp (use_master_weights_in_ckpt):
        # a parameter may round to the neighbouring bfloat16 (2^-8 relative), masters stay close.
        self.check_equivalence(GPT_CONF, ["exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True"], "tiny_gpt", 1e-2)
        s = torch.load(os.path.join(self.tag("two", STEPS, "tiny_gpt"), "optim", "dp_rank_01_tp_rank_00_pp_rank_00.pt"))
        self.assertIn("sharded_master_weights", s)
        self.assertEqual(s["sharded_master_weights"][0].dtype, torch.float32)
        # The masters per field, tighter than one step's update: AdamW moves a weight by about the LR
        # (3e-4 at the schedule's floor), so a missed update of any tensor (a LayerNorm weight's, say)
        # is 10x past MASTER_ATOL, which the dp all-reduce's other summation order stays far below.
        one = torch.load(os.path.join(self.tag("one", STEPS, "tiny_gpt"), "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        two = [torch.load(os.path.join(self.tag("two", STEPS, "tiny_gpt"), "optim", f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt"))
               for d in range(2)]
        worst = 0.0
        for i, shape in one["shape_info"].items():
            whole = torch.cat([t["sharded_master_weights"][i] for t in two])[: shape[0]]
            d = (whole - one["sharded_master_weights"][i]).abs().max().item()
            worst = max(worst, d)
            self.assertLess(d, MASTER_ATOL, f"master weight {i} {list(shape)} differs by {d:.2e}")
        print(f"\n  worst master weight difference {worst:.2e} (tolerance {MASTER_ATOL:.0e})", file=sys.stderr)

    def test_gpt_fp32_plain_matches_one_process(self):
        self.check_equivalence(GPT_CONF, ["precision.type=fp32", "distributed_strategy.zero1=False"], "tiny_gpt", 1e-3)

    def check_tensor_parallel(self, conf, name, extra, tp, dp, rtol, pp=1, many_extra=()):
        """One process against tp * pp * dp ranks. Megatron pads the vocabulary to a multiple of
        make_vocab_size_divisible_by * tp, so the one process pads to the same rows (8 * tp)."""
        self.train("one", 1, [*extra, f"model.make_vocab_size_divisible_by={8 * tp}"], conf)
        self.train("many", tp * pp * dp, [*extra, *many_extra], conf, tp=tp, pp=pp)
        self.assert_same_losses("one", "many")
        # A pipeline alone sums nothing in another order: GPT's tied embedding and output copy sum their
        # gradients as one sum of two parts on one stage as on two.
        exact = tp * dp == 1
        self.assert_same_state(self.tag("one", STEPS, name), self.tag("many", STEPS, name), rtol, 1e-5, exact=exact)
        model = os.path.join(self.tag("many", STEPS, name), "model")
        self.assertEqual(sorted(os.listdir(model)), sorted(f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for p in range(pp) for t in range(tp)))
        return [torch.load(os.path.join(model, f)) for f in sorted(os.listdir(model))]

    def assert_merges_to_one_process(self, name, tp, dp, zero1, rtol, pp=1):
        """The tag merged into one rank by an independent Python statement of Megatron's partition
        rules (megatron_partition.py) holds the one process's weights and moments."""
        merged = os.path.join(self.dir, "merged")
        merge_tag(self.tag("many", STEPS, name), merged, {"gpt": name == "tiny_gpt"}, tp, pp, dp, zero1)
        mine = torch.load(os.path.join(merged, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        one = torch.load(os.path.join(self.tag("one", STEPS, name), "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        self.assertEqual(list(mine), list(one))
        for n in one:
            self.assertEqual(mine[n].shape, one[n].shape, n)
            self.assertTrue(torch.allclose(mine[n].float(), one[n].float(), rtol=rtol, atol=1e-5), n)
        mo = torch.load(os.path.join(merged, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))["state"]
        oo = torch.load(os.path.join(self.tag("one", STEPS, name), "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        oo = oo["base_state"] if "base_state" in oo else oo["state"]
        self.assertEqual(len(mo), len(oo))
        for i in oo:
            for k in ("exp_avg", "exp_avg_sq"):
                d = (mo[i][k] - oo[i][k]).abs().max().item()
                self.assertTrue(torch.allclose(mo[i][k], oo[i][k], rtol=rtol, atol=1e-7), f"{k} of {i}: {d}")

    def test_llama_tp2_matches_one_process(self):
        self.check_tensor_parallel(CONF, "tiny_llama", ["distributed_strategy.zero1=False", *DROPOUT], 2, 1, 1e-3)
        self.assert_merges_to_one_process("tiny_llama", 2, 1, False, 1e-3)

    def test_llama_tp2_dp2_zero1_matches_one_process(self):
        self.check_tensor_parallel(CONF, "tiny_llama", ["distributed_strategy.zero1=True", *DROPOUT], 2, 2, 1e-3)
        optim = sorted(os.listdir(os.path.join(self.tag("many", STEPS), "optim")))
        self.assertEqual(optim, [f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for d in range(2) for t in range(2)])
        self.assert_merges_to_one_process("tiny_llama", 2, 2, True, 1e-3)

    def test_llama_gqa_tp4_with_replicated_kv_groups_matches_one_process(self):
        # 2 KV groups over 4 ranks: ranks 0-1 hold group 0, ranks 2-3 group 1 (ckpt/spec/partition.h).
        parts = self.check_tensor_parallel(CONF, "tiny_llama", ["model.num_kv_heads=2", "distributed_strategy.zero1=True", *DROPOUT],
                                           4, 1, 1e-3)
        kv = "language_model.encoder.layers.1.self_attention.key_value.weight"
        self.assertTrue(torch.equal(parts[0][kv], parts[1][kv]))  # the replicas stayed in step
        self.assertTrue(torch.equal(parts[2][kv], parts[3][kv]))
        self.assertFalse(torch.equal(parts[0][kv], parts[2][kv]))
        one = torch.load(os.path.join(self.tag("one", STEPS), "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))[kv]
        self.assertTrue(torch.allclose(torch.cat([parts[0][kv], parts[2][kv]]), one, rtol=1e-3, atol=1e-5))

    def test_gpt_tp2_mixed_precision_matches_one_process(self):
        # Biases (row-parallel ones whole), learned positions, the output layer tied to the vocab-parallel embedding.
        self.check_tensor_parallel(GPT_CONF, "tiny_gpt", [], 2, 1, 1e-2)
        self.assert_merges_to_one_process("tiny_gpt", 2, 1, True, 1e-2)

    def test_llama_tp2_sequence_parallel_matches_one_process(self):
        # Norms, dropout and the residual stream split along the sequence (masks keyed on global positions).
        self.check_tensor_parallel(CONF, "tiny_llama", ["distributed_strategy.zero1=True", *DROPOUT], 2, 1, 1e-3,
                                   many_extra=["+distributed_strategy.sequence_parallel=True"])
        self.assert_merges_to_one_process("tiny_llama", 2, 1, True, 1e-3)

    def test_gpt_tp2_pp2_sequence_parallel_matches_one_process(self):
        # LayerNorm biases, learned positions for each rank's positions, the tied embedding across stages.
        self.check_tensor_parallel(GPT_CONF, "tiny_gpt", [], 2, 1, 1e-2, pp=2,
                                   many_extra=["+distributed_strategy.sequence_parallel=True"])

    def stage_layers(self, log_dir, pp, name="tiny_llama"):
        out = []
        for p in range(pp):
            m = torch.load(os.path.join(self.tag(log_dir, STEPS, name), "model", f"dp_rank_00_tp_rank_00_pp_rank_{p:02d}.pt"))
            out.append(sorted({int(k.split(".")[3]) for k in m if ".layers." in k}))
        return out

    def test_llama_pp2_matches_one_process(self):
        # 3 layers on 2 stages: NxD's even split puts the remainder last (1, 2).
        self.check_tensor_parallel(CONF, "tiny_llama", ["model.num_layers=3", "distributed_strategy.zero1=True", *DROPOUT],
                                   1, 1, 1e-3, pp=2)
        self.assertEqual(self.stage_layers("many", 2), [[0], [1, 2]])
        self.assert_merges_to_one_process("tiny_llama", 1, 1, True, 1e-3, pp=2)

    def test_llama_pp2_with_pipeline_cuts_matches_one_process(self):
        self.check_tensor_parallel(CONF, "tiny_llama", ["model.num_layers=3", *DROPOUT], 1, 1, 1e-3, pp=2,
                                   many_extra=["+model.pipeline_cuts=[2]"])
        self.assertEqual(self.stage_layers("many", 2), [[0, 1], [2]])

    def test_llama_tp2_pp2_matches_one_process(self):
        self.check_tensor_parallel(CONF, "tiny_llama", ["distributed_strategy.zero1=False", *DROPOUT], 2, 1, 1e-3, pp=2)
        self.assert_merges_to_one_process("tiny_llama", 2, 1, False, 1e-3, pp=2)

    def test_recompute_under_tp2_pp2_matches_one_process(self):
        # Full recompute reruns each layer's forward, collectives included, inside backward.
        for granularity in ("full", "selective"):
            with self.subTest(granularity):
                extra = [f"+model.activations_checkpoint_granularity={granularity}", "distributed_strategy.zero1=False", *DROPOUT]
                self.check_tensor_parallel(CONF, "tiny_llama", extra, 2, 1, 1e-3, pp=2,
                                           many_extra=["+distributed_strategy.sequence_parallel=True"])
                shutil.rmtree(os.path.join(self.dir, "one"))
                shutil.rmtree(os.path.join(self.dir, "many"))

    def test_llama_tp2_pp2_dp2_zero1_matches_one_process(self):
        # 8 ranks on this machine's 2 cores: oversubscribed, one compute thread each.
        self.check_tensor_parallel(CONF, "tiny_llama", ["distributed_strategy.zero1=True", *DROPOUT], 2, 2, 1e-3, pp=2)
        optim = os.listdir(os.path.join(self.tag("many", STEPS), "optim"))
        self.assertEqual(len(optim), 8)
        self.assert_merges_to_one_process("tiny_llama", 2, 2, True, 1e-3, pp=2)

    def test_resume_after_a_tp_change_that_pads_the_vocabulary_further(self):
        """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp (Megatron-LM's
        _vocab_size_with_padding, as NxDT's data module computes padded_vocab_size), and the padding
        rows take part in the softmax. The byte tokenizer's 264 tokens: 264 rows at tp 1, 272 at tp 2.
        ckpt-reshard keeps the real rows and writes the rows a larger padding adds as zeros (weights and
        optimizer state; rows a smaller padding has no place for are dropped). The first step at tp 2
        then has the loss Megatron's cross-entropy gives over all 272 logits of the resharded weights
        (torch, below), not the loss over the 264 real ones."""
        extra = ["distributed_strategy.zero1=False"]
        self.train("one", 1, extra, steps=10)
        checkpoints = os.path.join(self.dir, "two", "checkpoints")
        run(RESHARD, self.tag("one", 10), "--checkpoint_dir", checkpoints, "--tp", 2, "--pp", 1)
        tag = self.tag("two", 10)
        shards = [torch.load(os.path.join(tag, "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")) for t in range(2)]
        optim = [torch.load(os.path.join(tag, "optim", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")) for t in range(2)]
        c = dict(hidden=64, ffn=172, heads=4, kv_heads=4, layers=2, vocab=272, seq=64, gpt=False)
        full = {n: merge(n, [s[n] for s in shards], c) for n in shards[0] if not is_buffer(n)}
        emb, out = "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"
        for n in (emb, out):
            self.assertEqual(full[n].shape, (272, 64))
            self.assertTrue(full[n][:264].abs().sum() > 0)
            self.assertFalse(full[n][264:].any(), n)  # the added padding rows
        names = [n for n in shards[0] if not is_buffer(n)]  # optimizer ids: module order, one group
        for n in (emb, out):  # their moments too: tp rank 1's last 8 rows are rows 264..271
            self.assertTrue(optim[1]["state"][names.index(n)]["exp_avg"][:-8].any(), n)
            self.assertFalse(optim[1]["state"][names.index(n)]["exp_avg"][-8:].any(), n)
        r = self.train("two", 2, [*extra, f"exp_manager.resume_from_checkpoint={tag}"], steps=11, tp=2)
        self.assertIn("resumed from " + tag, r.stderr)
        got = losses(os.path.join(self.dir, "two"))[11]
        # Step 11's batch: samples 160..175 of the run's order.
        out_text = run(TOKENIZE, "--samples", os.path.join(self.dir, "data", "text_document"), 64, 1234, 160, 16).stdout
        batch = torch.tensor([[int(x) for x in line.split()] for line in out_text.strip().split("\n")])
        with torch.no_grad():
            logits = forward(full, dict(c, rotary_dim=16), batch[:, :-1])
            targets = batch[:, 1:].reshape(-1)
            padded = torch.nn.functional.cross_entropy(logits.reshape(-1, 272), targets).item()
            real_only = torch.nn.functional.cross_entropy(logits.reshape(-1, 272)[:, :264], targets).item()
        self.assertLess(abs(got - padded), 1e-5 * padded, (got, padded))
        self.assertGreater(abs(real_only - padded), 100 * 1e-5 * padded, "the padding rows' effect is below the tolerance")

    def test_gpt_pp2_tied_embedding_matches_one_process(self):
        # The last stage's output layer is `language_model.output_layer.weight`, a copy of the first stage's
        # embedding, as NxDT's pipeline names it (NxD pipeline/model.py local_state_dict); their gradients are
        # summed, so the copies stay equal.
        parts = self.check_tensor_parallel(GPT_CONF, "tiny_gpt", [], 1, 1, 1e-2, pp=2)
        emb, out = "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"
        self.assertIn(emb, parts[0])
        self.assertNotIn(out, parts[0])
        self.assertIn(out, parts[1])
        self.assertNotIn("word_embeddings.weight", parts[1])
        self.assertTrue(torch.equal(parts[0][emb], parts[1][out]))
        # One process holds both names, equal, as NxDT's state_dict has them.
        one = torch.load(os.path.join(self.tag("one", STEPS, "tiny_gpt"), "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        self.assertEqual(list(one)[-1], out)
        self.assertTrue(torch.equal(one[emb], one[out]))

    def test_a_tag_with_other_pipeline_cuts_is_refused_with_the_reshard_command(self):
        extra = ["model.num_layers=3", "distributed_strategy.zero1=False"]
        self.train("straight", 1, extra)
        self.train("a", 2, extra, steps=10, pp=2)  # stages hold layers 0 and 1-2
        cut = [*extra, "+model.pipeline_cuts=[2]"]
        refused = self.train("b", 2, [*cut, f"exp_manager.resume_from_checkpoint={self.tag('a', 10)}"], check=False, pp=2)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("its pipeline stages hold layers 0..0, 1..2, but this run's hold 0..1, 2..2 (other pipeline cuts)", refused.stderr)
        self.assertIn("--pipeline_cuts 2", refused.stderr)
        new_tag = self.reshard_as_told(refused.stderr)
        r = self.train("b", 2, [*cut, f"exp_manager.resume_from_checkpoint={new_tag}"], pp=2)
        self.assertIn("resumed from " + new_tag, r.stderr)
        self.assert_same_losses("straight", "b", range(11, STEPS + 1))

    def test_sigkill_of_one_rank_ends_the_job_and_the_restart_resumes_every_rank(self):
        extra = ["distributed_strategy.zero1=True", "exp_manager.async_checkpointing=True"]
        steps = 100
        self.train("straight", 2, extra, steps=steps)
        killed = os.path.join(self.dir, "killed")
        p = start_until(self, self.command(killed, 2, extra, steps=steps), self.dir,
                        os.path.join(killed, "checkpoints", "*step=40-*", "done"), 120)
        ranks = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "shardkit-train"], capture_output=True, text=True).stdout.split()
        self.assertEqual(len(ranks), 2)
        os.kill(int(ranks[-1]), signal.SIGKILL)
        self.assertNotEqual(p.wait(timeout=60), 0)  # mpirun ends the job: no rank is left waiting
        r = self.train("killed", 2, extra, steps=steps)
        self.assertRegex(r.stderr, r"resumed from \S*step=(40|50|60|70|80|90)-")
        self.assertEqual(losses(os.path.join(self.dir, "straight")), losses(killed))
        for sub in ("model/dp_rank_00", "optim/dp_rank_00", "optim/dp_rank_01"):
            a = glob.glob(os.path.join(self.tag("straight", steps), sub + "*"))[0]
            b = glob.glob(os.path.join(self.tag("killed", steps), sub + "*"))[0]
            with open(a, "rb") as f1, open(b, "rb") as f2:
                self.assertEqual(f1.read(), f2.read(), f"{sub} differs")

    def reshard_as_told(self, stderr):
        """Runs the ckpt-reshard command a refused resume printed; returns the new tag."""
        m = re.search(r"Reshard it with: ckpt-reshard (.*?) and resume from it with exp_manager.resume_from_checkpoint=(\S+)", stderr)
        self.assertIsNotNone(m, stderr)
        r = subprocess.run([RESHARD, *shlex.split(m.group(1))], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        return m.group(2)

    def check_resume_across_layouts(self, world_a, world_b, extra):
        self.train("straight", 1, extra)
        self.train("a", world_a, extra, steps=10)
        refused = self.train("b", world_b, [*extra, f"exp_manager.resume_from_checkpoint={self.tag('a', 10)}"], check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn(f"written at tp 1, pp 1, dp {world_a} (ZeRO-1), but this run is tp 1, pp 1, dp {world_b} (ZeRO-1)",
                      refused.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "b", "checkpoints")))
        new_tag = self.reshard_as_told(refused.stderr)
        r = self.train("b", world_b, [*extra, f"exp_manager.resume_from_checkpoint={new_tag}"])
        self.assertIn("resumed from " + new_tag, r.stderr)
        self.assert_same_losses("straight", "b", range(11, STEPS + 1))

    def test_a_zero1_tag_from_dp2_resumes_in_one_process_through_ckpt_reshard(self):
        self.check_resume_across_layouts(2, 1, ["distributed_strategy.zero1=True"])

    def test_a_zero1_tag_from_one_process_resumes_at_dp2_through_ckpt_reshard(self):
        self.check_resume_across_layouts(1, 2, ["distributed_strategy.zero1=True"])

    def test_resume_reshard_reshards_with_every_rank_and_continues_the_run(self):
        # exp_manager.resume_reshard (shardkit's own): one process's ZeRO-1 tag, resumed at tp1 pp2 dp2 by 4 ranks.
        extra = ["model.num_layers=3", "distributed_strategy.zero1=True", *DROPOUT]
        self.train("straight", 1, extra)
        self.train("a", 1, extra, steps=10)
        r = self.train("a", 4, [*extra, "+exp_manager.resume_reshard=True"], pp=2)
        new_tag = os.path.join(self.dir, "a", "checkpoints-tp1pp2dp2", os.path.basename(self.tag("a", 10)))
        self.assertIn(f"written at tp 1, pp 1, dp 1 (ZeRO-1), but this run is tp 1, pp 2, dp 2 (ZeRO-1); resharding it into {new_tag}",
                      r.stderr)
        self.assertIn("resumed from " + new_tag, r.stderr)
        self.assertEqual(len(os.listdir(os.path.join(new_tag, "optim"))), 4)
        subprocess.run([VERIFY, new_tag], check=True, capture_output=True)
        self.assert_same_losses("straight", "a", range(11, STEPS + 1))
        # The source is untouched and still the one process's.
        v = subprocess.run([VERIFY, self.tag("a", 10), "--against", self.tag("straight", 10)], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout)

    def test_a_tp2_tag_resumes_at_pp2_through_ckpt_reshard(self):
        # #12's proof with a sharded trainer: trained at layout A (tp 2), resharded to B (pp 2), resumed at B,
        # continuing one process's losses. A vocabulary of 320 pads to the same rows at tp 1 and tp 2.
        extra = ["+model.vocab_size=320", "model.num_layers=3", "distributed_strategy.zero1=True", *DROPOUT]
        self.train("straight", 1, extra)
        self.train("a", 2, extra, steps=10, tp=2)
        refused = self.train("b", 2, [*extra, f"exp_manager.resume_from_checkpoint={self.tag('a', 10)}"], check=False, pp=2)
        self.assertIn("written at tp 2, pp 1, dp 1 (ZeRO-1), but this run is tp 1, pp 2, dp 1 (ZeRO-1)", refused.stderr)
        new_tag = self.reshard_as_told(refused.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(new_tag, "model"))),
                         ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_00_pp_rank_01.pt"])
        r = self.train("b", 2, [*extra, f"exp_manager.resume_from_checkpoint={new_tag}"], pp=2)
        self.assertIn("resumed from " + new_tag, r.stderr)
        self.assert_same_losses("straight", "b", range(11, STEPS + 1))

    def test_a_plain_tag_resumes_at_any_dp(self):
        # Without ZeRO-1 the files do not depend on dp: nothing to reshard.
        extra = ["distributed_strategy.zero1=False"]
        self.train("straight", 1, extra)
        self.train("a", 1, extra, steps=10)
        r = self.train("a", 2, extra)
        self.assertRegex(r.stderr, r"resumed from \S*step=10-")
        self.assert_same_losses("straight", "a", range(11, STEPS + 1))

    def test_a_missing_rank_file_is_named_and_the_previous_tag_resumed(self):
        extra = ["distributed_strategy.zero1=True"]
        self.train("run", 2, extra)
        os.remove(os.path.join(self.tag("run", 20), "optim", "dp_rank_01_tp_rank_00_pp_rank_00.pt"))
        r = self.train("run", 2, extra, steps=30)
        self.assertRegex(r.stderr, r"skipping \S*step=20-\S*: optim/dp_rank_01_tp_rank_00_pp_rank_00.pt")
        self.assertRegex(r.stderr, r"resumed from \S*step=10-")

    def test_world_size_other_than_the_config_is_refused(self):
        p = self.train("bad", 1, check=False)  # sanity: one process, one device works
        self.assertEqual(p.returncode, 0)
        cmd = [*mpirun(2), TRAIN, CONF, "exp_manager.explicit_log_dir=bad2", "trainer.devices=1"]
        p = subprocess.run(cmd, cwd=self.dir, capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("tp 1, pp 1, dp 1 needs 1 processes (tp * pp * dp), but 2 were started by mpirun", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "bad2", "checkpoints")))
        p = subprocess.run([TRAIN, CONF, "exp_manager.explicit_log_dir=bad3", "trainer.devices=2"], cwd=self.dir,
                           capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("tp 1, pp 1, dp 2 needs 2 processes (tp * pp * dp), but 1 was started (run it under mpirun -np 2, "
                      "or use train.sh)", p.stderr)

    def test_world_size_flag_tells_train_sh_how_many_ranks(self):
        out = subprocess.run([TRAIN, "--world_size", CONF, "trainer.devices=2", "trainer.num_nodes=2", "data.global_batch_size=16"],
                             capture_output=True, text=True, check=True).stdout
        self.assertEqual(out.strip(), "4")


if __name__ == "__main__":
    unittest.main()

"""shardkit-train end to end: it learns, and a run SIGKILLed after a checkpoint
resumes by itself to exactly the run that was never interrupted."""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import time
import unittest

import torch

from canon import TOKENIZE, TRAIN, VERIFY, TempDirTest, run
from megatron_partition import nxdt_order

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf")
CONF = os.path.join(CONF_DIR, "tiny_llama.yaml")
GPT_CONF = os.path.join(CONF_DIR, "tiny_gpt.yaml")
TEXT = "/usr/share/common-licenses/GPL-3"  # in every Debian (base-files)
STEPS = 120


MIXED = ["precision.type=mixed_precision", "distributed_strategy.zero1=True"]
RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def args(log_dir, async_save, extra=(), conf=CONF):
    return [TRAIN, conf, f"exp_manager.explicit_log_dir={log_dir}", f"trainer.max_steps={STEPS}",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=20",
            "exp_manager.checkpoint_callback_params.save_top_k=3",
            f"exp_manager.async_checkpointing={async_save}", "+model.optim.sched.max_steps=120", *extra]


def losses(log_dir, key="loss"):
    """The last logged loss (or `key`: grad_norm, lr) of every step (a resumed run logs some steps twice)."""
    out = {}
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            out[m["step"]] = m[key]
    return out


def start_until(test, cmd, cwd, marker, timeout):
    """Starts `cmd` and returns its Popen once a file matching the glob `marker` exists (the
    test fails if the run ends first, or after `timeout` seconds)."""
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not glob.glob(marker):
        test.assertIsNone(p.poll(), "the run finished before it could be killed")
        test.assertLess(time.time(), deadline)
        time.sleep(0.002)
    return p


class TrainAndResume(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))

    def train(self, log_dir, async_save, extra=(), conf=CONF):
        return subprocess.run(args(log_dir, async_save, extra, conf), cwd=self.dir, capture_output=True, text=True,
                              check=True)

    def test_loss_falls(self):
        self.train("straight", "True")
        l = losses(os.path.join(self.dir, "straight"))
        first, last = sum(l[s] for s in range(1, 6)) / 5, sum(l[s] for s in range(STEPS - 4, STEPS + 1)) / 5
        self.assertLess(last, 0.6 * first, f"loss {first:.3f} -> {last:.3f}")

    def kill_and_resume(self, async_save, extra=(), conf=CONF):
        """Trains to STEPS straight, and again SIGKILLed after the step-40 checkpoint and rerun;
        returns both runs' losses by step and the rerun's stderr."""
        self.train("straight", async_save, extra, conf)
        killed = os.path.join(self.dir, "killed")
        p = start_until(self, args(killed, async_save, extra, conf), self.dir, os.path.join(killed, "checkpoints", "*step=40*", "done"), 60)
        p.send_signal(signal.SIGKILL)
        p.wait()
        r = self.train("killed", async_save, extra, conf)
        self.assertRegex(r.stderr, r"resumed from .*step=(40|60|80|100)")
        a, b = losses(os.path.join(self.dir, "straight")), losses(killed)
        self.assertEqual(sorted(a), list(range(1, STEPS + 1)))
        return a, b, r.stderr

    def final_file(self, run, sub, name="tiny_llama"):
        rel = f"checkpoints/{name}--step={STEPS}-consumed_samples={8.0 * STEPS}.ckpt"
        return os.path.join(self.dir, run, rel, sub, RANK_FILE)

    def check_exact_resume(self, async_save, extra=(), conf=CONF, name="tiny_llama"):
        a, b, _ = self.kill_and_resume(async_save, extra, conf)
        self.assertEqual(a, b)  # identical loss at every step
        for sub in ("model", "optim"):
            with open(self.final_file("straight", sub, name), "rb") as f1, \
                 open(self.final_file("killed", sub, name), "rb") as f2:
                self.assertEqual(f1.read(), f2.read(), f"{sub} files differ")

    def test_exact_resume_after_sigkill_async_saves(self):
        self.check_exact_resume("True")

    def test_exact_resume_after_sigkill_sync_saves(self):
        self.check_exact_resume("False")

    def test_exact_resume_after_sigkill_xser_saves(self):
        # exp_manager.save_xser as NxDT's: X.pt, X.pt.tensors/, X.pt.info.pt; resume reads them.
        xser = ["+exp_manager.save_xser=True"]
        a, b, _ = self.kill_and_resume("True", xser)
        self.assertEqual(a, b)
        final = lambda run: os.path.dirname(os.path.dirname(self.final_file(run, "model")))
        for sub in ("model", "optim"):
            self.assertTrue(os.path.isdir(os.path.join(final("killed"), sub, RANK_FILE + ".tensors")))
            for dirpath, _, names in os.walk(os.path.join(final("straight"), sub)):
                for n in names:
                    rel = os.path.relpath(os.path.join(dirpath, n), final("straight"))
                    with open(os.path.join(final("straight"), rel), "rb") as f1, open(os.path.join(final("killed"), rel), "rb") as f2:
                        self.assertEqual(f1.read(), f2.read(), f"{rel} differs")
        self.assertEqual(run(VERIFY, final("killed")).returncode, 0)

    def test_resumes_a_tag_with_nxdts_user_content(self):
        # NxDT's user content (tests/data/upstream/nxd_tags): no consumed_samples (the tag name has
        # it), the step in Lightning's loops, the schedule in lr_schedulers; no scheduler.pt, no manifest.
        self.train("straight", "False", ["exp_manager.checkpoint_callback_params.save_top_k=-1"])  # keep step 40
        src = self.tag("straight", 40)
        resumed = os.path.join(self.dir, "nxdt")
        dst = os.path.join(resumed, "checkpoints", os.path.basename(src))
        shutil.copytree(src, dst)
        for f in ("manifest.json", "scheduler.pt"):
            os.remove(os.path.join(dst, f))
        shutil.rmtree(os.path.join(dst, ".shardkit"))
        ours = torch.load(os.path.join(dst, "user_content.pt"))
        self.assertEqual(ours["lr_schedulers"][0]["last_epoch"], 40)  # what we write NxDT reads
        self.assertEqual(sorted(ours["lr_schedulers"][0]), sorted(["base_lrs", "last_epoch", "verbose", "_step_count",
                                                                    "_get_lr_called_within_step", "_last_lr"]))
        progress = {"optimizer": {"step": {"total": {"ready": 40, "completed": 40}, "current": {"ready": 40, "completed": 40}}}}
        nxdt = {"epoch": 0, "global_step": 39,  # Lightning's loops override it, as in NxDT
                "pytorch-lightning_version": "2.5.0",
                "loops": {"fit_loop": {"epoch_loop.automatic_optimization.optim_progress": progress}},
                "callbacks": {}, "lr_schedulers": ours["lr_schedulers"], "hparams_name": "kwargs", "hyper_parameters": {"cfg": {}}}
        torch.save(nxdt, os.path.join(dst, "user_content.pt"))
        r = self.train("nxdt", "False")
        self.assertRegex(r.stderr, r"resumed from .*step=40.* at step 40, 320 samples consumed")
        a, b = losses(os.path.join(self.dir, "straight")), losses(resumed)
        self.assertEqual(sorted(b), list(range(41, STEPS + 1)))
        self.assertEqual({s: a[s] for s in b}, b)
        for sub in ("model", "optim"):
            with open(self.final_file("straight", sub), "rb") as f1, open(self.final_file("nxdt", sub), "rb") as f2:
                self.assertEqual(f1.read(), f2.read(), f"{sub} files differ")
        # Without lr_schedulers (and no scheduler.pt) NxDT restarts the schedule from warmup; so does this, and says so.
        del nxdt["lr_schedulers"]
        again = os.path.join(self.dir, "nowarm", "checkpoints", os.path.basename(src))
        shutil.copytree(dst, again)
        torch.save(nxdt, os.path.join(again, "user_content.pt"))
        r = self.train("nowarm", "False", ["trainer.max_steps=42"])
        self.assertIn("restarts from warmup", r.stderr)
        nowarm = losses(os.path.join(self.dir, "nowarm"))
        self.assertEqual(nowarm[41], a[41])  # the loss before the first update
        self.assertNotEqual(nowarm[42], a[42])  # after an update at warmup LR

    def tag(self, run, step, name="tiny_llama"):
        return os.path.join(self.dir, run, "checkpoints", f"{name}--step={step}-consumed_samples={8.0 * step}.ckpt")

    def corrupt(self, tag):
        """Overwrites 4 KiB inside the tag's model file in place: same size, other bytes."""
        path = os.path.join(tag, "model", RANK_FILE)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(bytes(range(256)) * 16)
        with open(path, "rb") as f:
            return f.read()

    def check_resume_skips_a_damaged_tag(self, async_save, explicit=False):
        """The newest tag is corrupted in place: the restarted run resumes from
        the previous one, ends byte-identical to a run never interrupted, and
        the corrupted tag is still on disk (set aside when its step is saved again)."""
        self.train("straight", async_save)
        self.train("damaged", async_save, ["trainer.max_steps=60"])
        bad = self.corrupt(self.tag("damaged", 60))
        extra = [f"exp_manager.resume_from_checkpoint={self.tag('damaged', 40)}"] if explicit else []
        r = self.train("damaged", async_save, extra)
        if not explicit:
            self.assertRegex(r.stderr, r"resume: skipping \S*step=60\S*: model/" + RANK_FILE + r": checksum \w+ differs from the manifest's")
        self.assertRegex(r.stderr, r"resumed from \S*step=40-")
        for sub in ("model", "optim"):
            with open(self.final_file("straight", sub), "rb") as f1, open(self.final_file("damaged", sub), "rb") as f2:
                self.assertEqual(f1.read(), f2.read(), f"{sub} files differ")
        aside = self.tag("damaged", 60) + (".superseded" if explicit else ".damaged")
        with open(os.path.join(aside, "model", RANK_FILE), "rb") as f:
            self.assertEqual(f.read(), bad)  # the evidence, untouched
        self.assertEqual(losses(os.path.join(self.dir, "straight")), losses(os.path.join(self.dir, "damaged")))

    def test_resume_skips_a_damaged_newest_tag_sync_saves(self):
        self.check_resume_skips_a_damaged_tag("False")

    def test_resume_skips_a_damaged_newest_tag_async_saves(self):
        self.check_resume_skips_a_damaged_tag("True")

    def test_resume_from_checkpoint_naming_a_damaged_tag_is_an_error(self):
        self.train("damaged", "False", ["trainer.max_steps=60"])
        self.corrupt(self.tag("damaged", 60))
        p = subprocess.run(args(os.path.join(self.dir, "damaged"), "False") +
                           [f"exp_manager.resume_from_checkpoint={self.tag('damaged', 60)}"],
                           cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("is not a complete, intact checkpoint", p.stderr)
        self.assertIn("model/" + RANK_FILE, p.stderr)
        self.assertFalse(os.path.exists(self.tag("damaged", 80)))

    def test_resume_from_an_earlier_tag_by_name_ends_as_the_straight_run(self):
        # The later (damaged) step-60 tag is set aside when step 60 is saved again, not deleted.
        self.check_resume_skips_a_damaged_tag("True", explicit=True)

    def test_every_tag_damaged_stops_with_exit_2_and_touches_nothing(self):
        self.train("damaged", "False", ["trainer.max_steps=60"])
        tags = [self.tag("damaged", s) for s in (20, 40, 60)]
        before = {}
        for tag in tags:
            self.corrupt(tag)
        for root, _, files in os.walk(os.path.join(self.dir, "damaged")):
            for f in files:
                with open(os.path.join(root, f), "rb") as fh:
                    before[os.path.join(root, f)] = fh.read()
        p = subprocess.run(args(os.path.join(self.dir, "damaged"), "False"), cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 2, p.stderr)
        for tag in tags:
            self.assertIn(tag + ": model/" + RANK_FILE, p.stderr)
        self.assertIn("resume_past_damaged_checkpoints", p.stderr)
        after = {}
        for root, _, files in os.walk(os.path.join(self.dir, "damaged")):
            for f in files:
                if f != "metrics.jsonl":
                    with open(os.path.join(root, f), "rb") as fh:
                        after[os.path.join(root, f)] = fh.read()
        before.pop(os.path.join(self.dir, "damaged", "metrics.jsonl"), None)
        self.assertEqual(before, after)
        # Asked explicitly, it starts over beside them; the damaged tags are set aside as their steps are saved again.
        p = subprocess.run(args(os.path.join(self.dir, "damaged"), "False") +
                           ["+exp_manager.resume_past_damaged_checkpoints=True", "trainer.max_steps=40"],
                           cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("starting from scratch as asked", p.stderr)
        for s in (20, 40):
            self.assertTrue(os.path.exists(self.tag("damaged", s) + ".damaged"))
        self.assertTrue(os.path.exists(os.path.join(self.tag("damaged", 60), "done")))  # not re-saved: left where it was

    def test_mixed_precision_resumes_exactly_with_master_weights_in_the_checkpoint(self):
        self.check_exact_resume("True", MIXED + ["+exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True"])
        model = torch.load(self.final_file("killed", "model"))
        optim = torch.load(self.final_file("killed", "optim"))
        self.assertEqual({v.dtype for v in model.values()}, {torch.bfloat16})
        # NxDT's Megatron Llama keeps RoPE's inv_freq as a persistent buffer of every layer, right after
        # the layer's query_key_value (NxD's strict load_checkpoint asks for it): the values its RotaryEmbedding computes.
        keys = list(model)
        buffers = [k for k in keys if k.endswith(".self_attention.core_attention.rotary_emb.inv_freq")]
        self.assertEqual(len(buffers), len([k for k in keys if k.endswith("input_layernorm.weight")]))
        heads = int(re.search(r"num_attention_heads: (\d+)", open(CONF).read()).group(1))
        rot = model["language_model.embedding.word_embeddings.weight"].shape[1] // heads
        for b in buffers:
            self.assertTrue(keys[keys.index(b) - 1].endswith(".self_attention.query_key_value.weight"), b)
            self.assertTrue(torch.equal(model[b], (1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))).bfloat16()), b)
        model = {k: v for k, v in model.items() if k not in buffers}
        self.assertEqual(sorted(optim), ["base_state", "param_groups", "shape_info", "sharded_master_weights", "state"])
        ids = [i for g in optim["param_groups"] for i in g["params"]]
        self.assertEqual(sorted(optim["sharded_master_weights"]), sorted(ids))
        # Every parameter is the bfloat16 rounding of its float32 master weight; not all masters are bf16 values.
        pids = {n: i for i, (n, _) in enumerate(nxdt_order(list(model), False))}
        exact = 0
        for name, w in model.items():
            master = optim["sharded_master_weights"][pids[name]]
            self.assertEqual(master.dtype, torch.float32)
            self.assertTrue(torch.equal(master.bfloat16(), w), name)
            exact += int(torch.equal(master, w.float()))
        self.assertLess(exact, len(model) // 2)

    def test_gpt_style_learns_and_resumes_exactly(self):
        """conf/tiny_gpt.yaml: LayerNorm, GeLU, biases, learned positions, tied output, dropout 0.1,
        mixed precision. The resumed run draws the same dropout masks."""
        self.check_exact_resume("True", conf=GPT_CONF, name="tiny_gpt")
        l = losses(os.path.join(self.dir, "straight"))
        first, last = sum(l[s] for s in range(1, 6)) / 5, sum(l[s] for s in range(STEPS - 4, STEPS + 1)) / 5
        self.assertLess(last, 0.6 * first, f"loss {first:.3f} -> {last:.3f}")
        model = torch.load(self.final_file("killed", "model", "tiny_gpt"))
        self.assertIn("language_model.embedding.position_embeddings.weight", model)
        self.assertIn("language_model.encoder.layers.1.mlp.dense_4h_to_h.bias", model)
        # NxDT's tied output layer: both names, equal (NxDT gpt_model.py; torch's state_dict keeps both).
        self.assertEqual(list(model)[-1], "language_model.output_layer.weight")
        self.assertTrue(torch.equal(model["language_model.output_layer.weight"], model["language_model.embedding.word_embeddings.weight"]))
        # NeMo's groups list it under both names: group 0 ends with it, group 1 holds the biases.
        optim = torch.load(self.final_file("killed", "optim", "tiny_gpt"))
        names = [n for n in model if not n.endswith("inv_freq")]
        self.assertEqual([g["params"] for g in optim["param_groups"]],
                         [[i for i, (_, g) in enumerate(nxdt_order(names, False)) if g == gi] for gi in range(2)])
        self.assertEqual(nxdt_order(names, False)[len(optim["param_groups"][0]["params"]) - 1][0], "language_model.output_layer.weight")

    def test_mixed_precision_without_master_weights_restarts_them_from_bf16_as_nxdt_does(self):
        a, b, stderr = self.kill_and_resume("False", MIXED)
        self.assertIn("holds no master weights", stderr)
        resumed = int(re.search(r"resumed from \S*step=(\d+)-", stderr).group(1))
        self.assertEqual([a[s] for s in range(1, resumed + 2)], [b[s] for s in range(1, resumed + 2)])  # same bf16 weights
        self.assertNotEqual(a, b)  # the master weights lost their low bits, so later steps differ

    def test_hdf5_data_trains_identically_to_the_same_tokens_in_mmap(self):
        run(TOKENIZE, "--format", "hdf5", TEXT, os.path.join(self.dir, "data", "text"))
        common = [TRAIN, CONF, "trainer.max_steps=15", "exp_manager.create_checkpoint_callback=False"]
        subprocess.run(common + ["exp_manager.explicit_log_dir=mmap"], cwd=self.dir, check=True, capture_output=True)
        subprocess.run(common + ["exp_manager.explicit_log_dir=h5", "data.data_impl=hdf5", "data.data_prefix=[1.0,data/text.h5]"],
                       cwd=self.dir, check=True, capture_output=True)
        a, b = losses(os.path.join(self.dir, "mmap")), losses(os.path.join(self.dir, "h5"))
        self.assertEqual(len(a), 15)
        self.assertEqual(a, b)

    def test_vocabulary_comes_from_a_hugging_face_tokenizer_folder(self):
        tok = os.path.join(self.dir, "tok")
        os.makedirs(tok)
        with open(os.path.join(tok, "tokenizer.json"), "w") as f:
            json.dump({"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(290)}},
                       "added_tokens": [{"id": 299, "content": "<|end|>"}]}, f)
        subprocess.run([TRAIN, CONF, "exp_manager.explicit_log_dir=hf", "trainer.max_steps=1",
                        "data.tokenizer.library=huggingface", f"+data.tokenizer.type={tok}"],
                       cwd=self.dir, check=True, capture_output=True)
        tag = glob.glob(os.path.join(self.dir, "hf", "checkpoints", "*step=1-*"))[0]
        model = torch.load(os.path.join(tag, "model", RANK_FILE))
        self.assertEqual(model["language_model.embedding.word_embeddings.weight"].shape, (304, 64))  # 300 padded to 8

    def test_precise_errors_before_any_work(self):
        cases = [
            (["data.data_prefix=[1.0,missing/prefix]"], "missing/prefix.idx: missing"),
            (["data.global_batch_size=6"], "data.global_batch_size: 6 is not a multiple of data.micro_batch_size (4)"),
            (["distributed_strategy.tensor_model_parallel_size=2"],
             "distributed_strategy: tensor_model_parallel_size (2) * pipeline_model_parallel_size (1) = 2 does not divide "
             "trainer.devices * trainer.num_nodes (1)"),
            (["distributed_strategy.pipeline_model_parallel_size=3", "trainer.devices=3", "data.global_batch_size=12"],
             "distributed_strategy.pipeline_model_parallel_size: pipeline parallel degree 3 exceeds the 2 layers: every stage "
             "needs at least one layer"),
            (["distributed_strategy.pipeline_model_parallel_size=2", "trainer.devices=2", "+model.pipeline_cuts=[2]"],
             "model.pipeline_cuts: pipeline cuts must be ascending layer numbers between 1 and 1"),
            (["+model.pipeline_cuts=[1]"], "model.pipeline_cuts: the pipeline cuts list 1 cuts; 1 stages need 0"),
            (["distributed_strategy.tensor_model_parallel_size=3", "trainer.devices=3", "data.global_batch_size=12"],
             "distributed_strategy.tensor_model_parallel_size: tensor parallel degree 3 does not divide the attention heads (4)"),
            (["distributed_strategy.tensor_model_parallel_size=4", "trainer.devices=4", "model.num_kv_heads=2",
              "model.ffn_hidden_size=174"],
             "distributed_strategy.tensor_model_parallel_size: tensor parallel degree 4 does not divide the FFN width (174)"),
            (["distributed_strategy.tensor_model_parallel_size=2", "trainer.devices=2", "+distributed_strategy.sequence_parallel=True",
              "model.encoder_seq_length=63"],
             "distributed_strategy.sequence_parallel: splits data.seq_length (63) over tensor_model_parallel_size (2): it must "
             "divide evenly"),
            (["+model.virtual_pipeline_model_parallel_size=2"],
             "model.virtual_pipeline_model_parallel_size: 2: interleaved (virtual) pipeline stages; shardkit does not implement it"),
            (["+distributed_strategy.virtual_pipeline_model_parallel_size=2"],
             "distributed_strategy.virtual_pipeline_model_parallel_size: 2: interleaved (virtual) pipeline stages; shardkit does not "
             "implement it"),
            (["trainer.devices=2", "data.global_batch_size=4"],
             "data.global_batch_size: 4 is not a multiple of data.micro_batch_size (4) * data-parallel size (2)"),
            (["model.num_kv_heads=3"], "model.num_kv_heads: must divide num_attention_heads (4)"),
            (["precision.type=mixed_precision"],
             "precision.type: mixed_precision keeps float32 master weights only with distributed_strategy.zero1: True"),
            (["precision.type=bf16SR"], "precision.type: 'bf16SR': a precision other than fp32 and mixed_precision"),
            (["data.data_impl=hdf5", "data.data_prefix=[1.0,data/none.h5]"], "data/none.h5: missing"),
            (["model.hidden=1"], "override 'model.hidden=1': key 'model.hidden' is not in the config"),
            (["model.normalization=batchnorm"], "model.normalization: 'batchnorm' is not supported (supported: rmsnorm, layernorm)"),
            (["+model.transformer_block_type=post_ln"], "model.transformer_block_type: 'post_ln' is not supported (supported: pre_ln)"),
            (["data.tokenizer.library=huggingface", "+data.tokenizer.type=no/such/dir"],
             "data.tokenizer: no/such/dir: no tokenizer.json or vocab.json there"),
            (["model.hidden_dropout=1.0"], "model.hidden_dropout: 1.000000 is not a probability in [0, 1)"),
            (["model.position_embedding_type=learned_absolute", "model.max_position_embeddings=32"],
             "model.max_position_embeddings: 32 is shorter than data.seq_length (64)"),
        ]
        for overrides, message in cases:
            with self.subTest(message):
                p = subprocess.run([TRAIN, CONF, "exp_manager.explicit_log_dir=bad", *overrides], cwd=self.dir,
                                   capture_output=True, text=True)
                self.assertEqual(p.returncode, 2, p.stderr)  # bad input, the data the config names included
                self.assertIn(message, p.stderr)
                self.assertFalse(os.path.exists(os.path.join(self.dir, "bad", "checkpoints")))

    def test_checkpoint_that_does_not_fit_the_config_is_an_error(self):
        self.train("run", "False")
        p = subprocess.run(args(os.path.join(self.dir, "run"), "False") + ["model.hidden_size=32", "trainer.max_steps=130"],
                           cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 1)
        self.assertIn("cannot resume", p.stderr)
        self.assertIn("wrong shape for this config", p.stderr)


if __name__ == "__main__":
    unittest.main()

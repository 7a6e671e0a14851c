"""shardkit-train with NxDT's model_source: hf (conf/hf_llama.yaml).

- Every HF-style layout trains the same model: tp 1, NxD's Trn1 and Trn2 KV
  replication (kv_replicator 2 at tp 4), separate q/k/v: the same losses and
  gradient norms step for step, and tags that compare equal.
- It is the model the Megatron-style family trains (whose forward and backward
  are checked against torch in train_reference.py): weights carried from a
  Megatron-style run to the HF-style family by ckpt-reshard give the same
  losses in both trainers.
- The tag it writes has NxD's layout: replicated KV rows on the ranks NxD's
  Trn1 rule names, and exports the HF model it trained.
- Killed after a checkpoint, it resumes to exactly the uninterrupted run;
  resume_reshard continues it at another tp.
"""
import glob
import json
import os
import signal
import subprocess
import unittest

import torch

from canon import RESHARD, TOKENIZE, TRAIN, VERIFY, TempDirTest, run
from train_resume import losses, start_until

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf")
CONF = os.path.join(CONF_DIR, "hf_llama.yaml")
TEXT = "/usr/share/common-licenses/GPL-3"
# The same sizes in the Megatron-style family (the config's model_source switched, its sizes given as keys).
AS_MEGATRON = ["model_source=megatron", "+model.ffn_hidden_size=128", "+model.num_attention_heads=4", "+model.num_kv_heads=1",
               "+model.vocab_size=260", "+model.make_vocab_size_divisible_by=1", "model.do_layer_norm_weight_decay=False",
               # NxDT's megatron models default to a GPT (tied, LayerNorm, GeLU, learned positions, biases, dropout 0.1).
               "+model.share_embeddings_and_output_weights=False", "+model.normalization=rmsnorm", "+model.activation=swiglu",
               "+model.position_embedding_type=rope", "+model.has_bias=False", "+model.hidden_dropout=0.0"]


def mpirun(n):
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n)]


class TrainHfLlama(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))
        with open(os.path.join(CONF_DIR, "hf_llama_config.json")) as f:
            config = json.load(f)
        config["num_key_value_heads"] = 2
        self.kv2 = os.path.join(self.dir, "kv2.json")
        with open(self.kv2, "w") as f:
            json.dump(config, f)

    def train(self, log_dir, ranks, *overrides, steps=10, tp=None):
        """`ranks` processes at tensor-parallel degree `tp` (default: all of them)."""
        tp = tp or ranks
        cmd = mpirun(ranks) + [TRAIN, CONF, f"exp_manager.explicit_log_dir={log_dir}", f"trainer.devices={ranks}",
                               f"distributed_strategy.tensor_model_parallel_size={tp}", f"trainer.max_steps={steps}",
                               "trainer.log_every_n_steps=1", *overrides]
        p = subprocess.run(cmd, cwd=self.dir, capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return os.path.join(self.dir, log_dir)

    def tags(self, run_dir):
        return sorted(glob.glob(os.path.join(run_dir, "checkpoints", "*.ckpt")), key=lambda t: int(t.split("step=")[1].split("-")[0]))

    def assert_same_run(self, a, b, rel=2e-5):
        for key in ("loss", "grad_norm"):
            la, lb = losses(a, key), losses(b, key)
            self.assertEqual(sorted(la), sorted(lb))
            for step in la:
                self.assertAlmostEqual(la[step], lb[step], delta=rel * abs(la[step]) + 1e-7, msg=(key, step, a, b))

    def test_every_layout_trains_the_same_model(self):
        fp32 = ["precision.type=fp32", "distributed_strategy.zero1=False", f"model.model_config={self.kv2}", "exp_manager.save_xser=False"]
        one = self.train("tp1", 1, "distributed_strategy.kv_replicator=1", *fp32)
        runs = {
            "trn1": self.train("trn1", 4, "distributed_strategy.kv_replicator=2", *fp32),
            "trn2": self.train("trn2", 4, "distributed_strategy.kv_replicator=2", "+shardkit.hw_backend=trn2", *fp32),
            "split": self.train("split", 4, "distributed_strategy.kv_replicator=2", "model.fuse_qkv=False", *fp32),
            "plain": self.train("plain", 2, "distributed_strategy.kv_replicator=1", "model.qkv_linear=False", *fp32),
            # Pipeline stages (global layer numbers, the embedding first and lm_head last), and ZeRO-1 over 2 dp ranks.
            "pp2": self.train("pp2", 4, "distributed_strategy.kv_replicator=1", "distributed_strategy.pipeline_model_parallel_size=2", *fp32,
                              tp=2),
            "dp2": self.train("dp2", 4, "distributed_strategy.kv_replicator=1", *fp32[:1], *fp32[2:], "distributed_strategy.zero1=True", tp=2),
        }
        for name, r in runs.items():
            self.assert_same_run(one, r)
            p = run(VERIFY, self.tags(r)[-1], "--against", self.tags(one)[-1], "--rtol", "1e-4", "--atol", "1e-6")
            self.assertIn("same", p.stdout, name)
        # NxD's Trn1 placement: KV head r % 2 on rank r, so ranks 0 and 2 hold equal K and V rows, ranks 0 and 1 do not.
        model = {t: torch.load(os.path.join(self.tags(runs["split"])[-1], "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"))
                 for t in range(4)}
        k = "model.layers.1.self_attn.qkv_proj.weight_k"
        self.assertTrue(torch.equal(model[0][k], model[2][k]))
        self.assertFalse(torch.equal(model[0][k], model[1][k]))
        # Trn2: consecutive ranks share.
        trn2 = {t: torch.load(os.path.join(self.tags(runs["trn2"])[-1], "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"))
                for t in range(4)}
        qkv = "model.layers.0.self_attn.qkv_proj.weight_qkv"
        self.assertTrue(torch.equal(trn2[0][qkv][16:], trn2[1][qkv][16:]))  # 1 query head of 16 rows, then K and V
        self.assertFalse(torch.equal(trn2[0][qkv][16:], trn2[2][qkv][16:]))

    def test_same_model_as_the_megatron_family(self):
        mega = self.train("mega", 1, *AS_MEGATRON, "exp_manager.checkpoint_callback_params.every_n_train_steps=5", steps=5)
        tag = self.tags(mega)[-1]
        hf_tag = os.path.join(self.dir, "hf_tags", os.path.basename(tag))
        run(RESHARD, tag, hf_tag, "--tp", "2", "--pp", "1", "--out_model_family", "hf_llama", "--out_qkv_linear", "true",
            "--out_kv_size_multiplier", "2", "--out_hw_backend", "trn1", "--weights_only")
        # Both continue from the same weights with a fresh optimizer (model.weight_init_only).
        a = self.train("mega_more", 1, *AS_MEGATRON, f"exp_manager.resume_from_checkpoint={tag}", "+model.weight_init_only=True")
        b = self.train("hf_more", 2, f"exp_manager.resume_from_checkpoint={hf_tag}", "+model.weight_init_only=True")
        self.assertEqual(sorted(losses(a)), list(range(6, 11)))
        self.assert_same_run(a, b)

    def test_killed_run_resumes_exactly_and_reshards(self):
        # The fp32 masters are saved (use_master_weights_in_ckpt), so a resumed run continues exactly.
        masters = "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True"
        full = self.train("full", 2, "exp_manager.checkpoint_callback_params.save_top_k=-1", masters, steps=20)
        cmd = mpirun(2) + [TRAIN, CONF, "exp_manager.explicit_log_dir=killed", "trainer.max_steps=20", "trainer.log_every_n_steps=1", masters]
        p = start_until(self, cmd, self.dir, os.path.join(self.dir, "killed", "checkpoints", "*", "done"), 300)
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.assertLess(max(losses(os.path.join(self.dir, "killed"))), 20)
        again = self.train("killed", 2, masters, steps=20)
        self.assertEqual(losses(again)[20], losses(full)[20])
        p = run(VERIFY, self.tags(again)[-1], "--against", self.tags(full)[-1])
        self.assertIn("same", p.stdout)
        # The step-10 tag continued at tp 1 (kv_replicator 1): resume_reshard re-lays it, and training goes on as at tp 2.
        os.makedirs(os.path.join(self.dir, "tp1", "checkpoints"))
        step10 = [t for t in self.tags(full) if "step=10-" in t]
        subprocess.run(["cp", "-r", step10[0], os.path.join(self.dir, "tp1", "checkpoints")], check=True)
        one = self.train("tp1", 1, "distributed_strategy.kv_replicator=1", "+exp_manager.resume_reshard=True", masters, steps=20)
        l1, l2 = losses(one), losses(full)
        self.assertEqual(min(l1), 11)
        for step in range(11, 21):
            self.assertAlmostEqual(l1[step], l2[step], delta=2e-3 * l2[step])


if __name__ == "__main__":
    unittest.main()

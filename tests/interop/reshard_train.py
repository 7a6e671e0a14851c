"""Training continues across a reshard: shardkit-train saves at tp1 pp1, the
checkpoint is resharded to tp2 pp2 and back with ckpt-reshard, and the run
resumed from it gives the losses and final files of a run never interrupted.
(Once the trainer runs sharded, the same test resumes at the target layout.)"""
import glob
import json
import os
import subprocess
import unittest

from canon import BIN, RESHARD, TOKENIZE, TempDirTest, VERIFY, run
from train_resume import CONF, GPT_CONF, MIXED, RANK_FILE, TEXT, args, losses



class TrainAcrossReshard(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))

    def train(self, log_dir, extra=(), conf=CONF):
        return subprocess.run(args(log_dir, "False", extra, conf), cwd=self.dir, capture_output=True, text=True, check=True)

    def reshard(self, *argv):
        r = subprocess.run([RESHARD, *argv, "--json"], cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def check(self, conf, name, extra, tp, pp):
        self.train("straight", extra, conf)
        src = glob.glob(os.path.join(self.dir, "straight", "checkpoints", f"{name}--step=80-*.ckpt"))[0]
        mid = os.path.join(self.dir, "mid.ckpt")
        s = self.reshard(src, mid, "--tp", str(tp), "--pp", str(pp))
        self.assertEqual((s["to"]["tp"], s["to"]["pp"]), (tp, pp))
        # The manifest records the target degrees, and the tag verifies.
        with open(os.path.join(mid, "manifest.json")) as f:
            grid = json.load(f)["grid"]
        self.assertEqual((grid["tp"], grid["pp"]), (tp, pp))
        self.assertEqual(len(os.listdir(os.path.join(mid, "model"))), tp * pp)
        subprocess.run([VERIFY, mid], check=True, capture_output=True)
        # ckpt-verify --against compares logical tensors across layouts: the same state, and then a different one.
        v = subprocess.run([VERIFY, src, "--against", mid], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        self.assertRegex(v.stdout, r"^same ")
        later = glob.glob(os.path.join(self.dir, "straight", "checkpoints", f"{name}--step=100-*.ckpt"))[0]
        v = subprocess.run([VERIFY, later, "--against", mid, "--json"], capture_output=True, text=True)
        self.assertEqual(v.returncode, 1, v.stdout + v.stderr)
        report = json.loads(v.stdout)
        differ = {(d["tensor"], d["difference"].split()[0]) for d in report["differences"]}
        self.assertIn((f"language_model.encoder.layers.0.self_attention.dense.weight", "param"), differ)
        self.assertIn((f"language_model.encoder.final_layernorm.weight", "exp_avg_sq"), differ)
        self.assertIn((f"language_model.embedding.word_embeddings.weight", "optimizer"), differ)  # its step
        back = os.path.join(self.dir, "resharded", "checkpoints")
        self.reshard(mid, "--checkpoint_dir", back, "--tp", "1", "--pp", "1")
        # Back at the source layout every file is the one the trainer wrote.
        for sub in ("model", "optim"):
            with open(os.path.join(src, sub, RANK_FILE), "rb") as f1, \
                 open(glob.glob(os.path.join(back, "*step=80*", sub, RANK_FILE))[0], "rb") as f2:
                self.assertEqual(f1.read(), f2.read(), f"{sub} differs after tp{tp}pp{pp} and back")
        r = self.train("resharded", extra, conf)
        self.assertRegex(r.stderr, r"resumed from \S*step=80-")
        a, b = losses(os.path.join(self.dir, "straight")), losses(os.path.join(self.dir, "resharded"))
        self.assertEqual(sorted(b), list(range(81, 121)))
        self.assertEqual({s: a[s] for s in b}, b)  # identical loss at every step after the resume
        for sub in ("model", "optim"):
            final = f"{name}--step=120-consumed_samples=960.0.ckpt"
            with open(os.path.join(self.dir, "straight", "checkpoints", final, sub, RANK_FILE), "rb") as f1, \
                 open(os.path.join(back, final, sub, RANK_FILE), "rb") as f2:
                self.assertEqual(f1.read(), f2.read(), f"final {sub} files differ")

    def test_llama_through_tp2_pp2(self):
        self.check(CONF, "tiny_llama", [], 2, 2)

    def test_gpt_bf16_zero1_master_weights_through_tp4_pp2(self):
        # GPT: tied embeddings (the copy on the last stage), biases, layernorm, learned positions.
        self.check(GPT_CONF, "tiny_gpt", MIXED, 4, 2)


if __name__ == "__main__":
    unittest.main()

"""The README's walkthrough, run exactly as written, so it cannot rot.

Every ```sh block from "## Move a run from NNM to NxDT" up to "## Command
reference" runs, in order, in one bash (set -euo pipefail) from a folder that
stands for the repository's root: `build` is the build under test
(SHARDKIT_BIN), `tests` and `train.sh` are the repository's. Then the results
are checked: the migrated config, the converted tag resumed at NNM's step,
samples and learning rate, the resharded tag equal to the trained one, and the
exports' contents."""
import json
import os
import re
import subprocess
import tempfile
import unittest

import h5py

import train_reference
from canon import BIN

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
FIRST, LAST = "## Move a run from NNM to NxDT", "## Command reference"


def walkthrough_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start, end = text.index(FIRST), text.index(LAST)
    return re.findall(r"```sh\n(.*?)```", text[start:end], re.S)


class ReadmeWalkthrough(unittest.TestCase):
    def test_the_walkthrough_runs_as_written(self):
        blocks = walkthrough_commands()
        # The three steps, the one-pass conversion to other degrees, the reshard and the export:
        # a README edit that drops a block fails here.
        self.assertEqual(len(blocks), 7, blocks)
        script = "".join(blocks)
        for command in ("nnm2nxdt-config", "nnm2nxdt-ckpt", "train.sh", "ckpt-reshard", "ckpt-verify", "ckpt-export"):
            self.assertIn(command, script)
        with tempfile.TemporaryDirectory() as root:
            os.symlink(os.path.abspath(BIN), os.path.join(root, "build"))
            os.symlink(os.path.join(ROOT, "tests"), os.path.join(root, "tests"))
            os.symlink(os.path.join(ROOT, "train.sh"), os.path.join(root, "train.sh"))
            p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, capture_output=True, text=True,
                               timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
            walk = os.path.join(root, "walk")

            # 1. The config: fp32 as the sample trained, every check passed, data_prefix as NNM's config set it.
            with open(os.path.join(walk, "nxdt_tiny_llama.report.json")) as f:
                report = json.load(f)
            self.assertEqual(report["check"], [])
            self.assertEqual(report["at_launch"], [])
            with open(os.path.join(walk, "nxdt_tiny_llama.yaml")) as f:
                config = f.read()
            self.assertIn("precision:\n  type: 'fp32'", config)
            self.assertIn("tensor_model_parallel_size: 2", config)

            # 2 and 3. The converted tag resumed at NNM's step and samples, on NNM's schedule.
            self.assertIn("resumed from run/checkpoints/megatron_llama--step=3-consumed_samples=24.0-last.ckpt "
                          "at step 3, 24 samples consumed", p.stderr)
            with open(os.path.join(walk, "run", "metrics.jsonl")) as f:
                metrics = [json.loads(line) for line in f]
            self.assertEqual([m["step"] for m in metrics], list(range(4, 41)))
            self.assertEqual(metrics[0]["consumed_samples"], 32)
            # NeMo's CosineAnnealing of the sample's config at 0-based step 3 (lr 3e-3, warmup 2, 40 steps, min 3e-4).
            self.assertAlmostEqual(metrics[0]["lr"], train_reference.nemo_cosine(3, 3e-3, 2, 0, 40, 3e-4), delta=1e-12)
            tags = sorted(os.listdir(os.path.join(walk, "run", "checkpoints")))
            self.assertIn("tiny_llama--step=40-consumed_samples=320.0.ckpt", tags)

            # The one-pass conversion to tp 1 pp 1 (ckpt-verify --against above proved it holds what the
            # tp 2 pp 2 conversion holds) records its degrees and the sample's model.
            with open(os.path.join(walk, "tp1_from_nnm", "manifest.json")) as f:
                manifest = json.load(f)
            self.assertEqual((manifest["grid"]["tp"], manifest["grid"]["pp"], manifest["step"]), (1, 1, 3))
            self.assertEqual((manifest["model"]["num_attention_heads"], manifest["model"]["hidden_size"]), (4, 64))

            # The reshard's manifest records tp 1 pp 1 (ckpt-verify --against above proved the tensors equal).
            with open(os.path.join(walk, "tp1", "manifest.json")) as f:
                grid = json.load(f)["grid"]
            self.assertEqual((grid["tp"], grid["pp"]), (1, 1))

            # Get your model out: an HF Llama of the sample's sizes, and the whole state in HDF5.
            with open(os.path.join(walk, "hf_llama", "config.json")) as f:
                hf = json.load(f)
            self.assertEqual((hf["architectures"], hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]),
                             (["LlamaForCausalLM"], 2, 64, 4))
            self.assertTrue(os.path.getsize(os.path.join(walk, "hf_llama", "model.safetensors")) > 0)
            with h5py.File(os.path.join(walk, "state.h5"), "r") as h:
                embedding = h["model/language_model.embedding.word_embeddings.weight"]
                self.assertEqual(embedding.shape[1], 64)
                self.assertIn("exp_avg", h["optim/language_model.embedding.word_embeddings.weight"])


if __name__ == "__main__":
    unittest.main()

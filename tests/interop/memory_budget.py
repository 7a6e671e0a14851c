"""--memory_budget holds at any thread count (issue #40 item 3): ckpt-import,
ckpt-reshard, nnm2nxdt-ckpt and ckpt-export --format hf (whose threads read
the next chunks while one writes) each run with --threads 1, 4 and 16, at a
small budget on a small tag whose column-split tensors (o_proj, down_proj) are
large: a chunk of a target tp rank's down_proj reads a piece of every row of
the source's, so its source pages span the whole source tensor (11 MiB here),
and sixteen threads holding such spans overrun the budget by far (before the
fix, ckpt-import peaked at 908 MiB of a 512 MiB budget on 16 cores).

The bound is the issue's: peak RSS <= budget + one chunk of the largest
tensor, the program itself included. The peak is measured from outside
(os.wait4's ru_maxrss of the command, run from a small forked Python: a child
of this torch-holding process would inherit its size), and the figure the
command prints must be that peak (VmHWM), not an estimate."""
import json
import os
import re
import subprocess
import unittest

from bad_input import hf_tensors, write_safetensors
from canon import CONVERT, EXPORT, IMPORT, RESHARD, TempDirTest
from reshard import run_measured

MiB = 1 << 20
THREADS = (1, 4, 16)
BUDGET = 112 * MiB
# Llama with 32 heads and 8 KV heads (tp 32 with kv_size_multiplier 4, as NxD
# lays Trn1 out), float32: o_proj 4 MiB, down_proj 11 MiB, 4 layers, 244 MiB in all.
BIG = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=4, vocab_size=8000)
NNM_BIG = dict(hidden=1024, ffn=2816, heads=32, kv_heads=8, layers=2, vocab=8000, seq=8, gpt=False)


def hf_folder(root, cfg):
    """A LlamaForCausalLM folder of `cfg`'s sizes (float32), and its largest tensor's bytes."""
    tensors = hf_tensors(cfg)
    os.makedirs(root)
    write_safetensors(os.path.join(root, "model.safetensors"), tensors)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama"), f)
    return root, max(t.numel() * 4 for t in tensors.values())


class MemoryBudget(TempDirTest):
    def setUp(self):
        super().setUp()
        for b in (IMPORT, RESHARD, EXPORT, CONVERT):  # a missing binary is a failure, never a skip
            self.assertTrue(os.path.exists(b), f"{b} is not built")

    def measured(self, *args):
        p = run_measured(*args)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p

    def commands(self, tag, hf, nnm, budget, threads):
        """name -> the command line of each tool at `budget` and `threads`, on the sources given;
        the outputs are named after the thread count."""
        out = f"{tag}.t{threads}"
        engine = ["--memory_budget", f"{budget >> 10}K", "--threads", threads]
        return {
            "ckpt-import": [IMPORT, "--format", "hf", "--model_source", "hf", "--fuse_qkv", "true", "--qkv_linear", "true",
                            "--kv_size_multiplier", "4", hf, out + ".import", "--tp", 32, "--pp", 1, "--save_xser", *engine],
            "ckpt-reshard": [RESHARD, tag, out + ".reshard", "--tp", 8, "--pp", 4, "--out_kv_size_multiplier", 1, *engine],
            "ckpt-export": [EXPORT, tag, out + ".export", "--format", "hf", *engine],
            "nnm2nxdt-ckpt": [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out + ".convert", "--tp", 8, "--weights_only", "--heads", 32, "--kv_heads", 8, *engine],
        }

    def sources(self, name, cfg, nnm_cfg):
        """An HF folder, the Trn1 tp 32 m 4 xser tag imported from it, and an NNM checkpoint."""
        from nnm_fixture import make_nnm
        hf, largest = hf_folder(os.path.join(self.dir, name + "_hf"), cfg)
        tag = os.path.join(self.dir, name)
        p = subprocess.run([IMPORT, "--format", "hf", "--model_source", "hf", "--fuse_qkv", "true", "--qkv_linear", "true",
                            "--kv_size_multiplier", "4", hf, tag, "--tp", "32", "--pp", "1", "--save_xser"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        nnm = os.path.join(self.dir, name + "_nnm")
        make_nnm(nnm, nnm_cfg, steps=0)
        return tag, hf, nnm, largest

    def chunk(self, name, largest, threads):
        """One chunk of the largest tensor: under a stream's share of the budget (ckpt/shard/stream_budget.h);
        the engine's streams are its threads, the export's its threads and the one writing."""
        return min(largest, BUDGET // (threads + 1) if name == "ckpt-export" else BUDGET // threads)

    def test_peak_rss_within_the_budget_at_1_4_and_16_threads(self):
        tag, hf, nnm, largest = self.sources("big", BIG, NNM_BIG)
        rows = []
        for threads in THREADS:
            for name, argv in self.commands(tag, hf, nnm, BUDGET, threads).items():
                p = self.measured(*argv)
                m = re.search(r"peak memory ([\d.]+) (KiB|MiB|GiB)", p.stderr)
                said = float(m.group(1)) * {"KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30}[m.group(2)] if m else None
                rows.append((name, threads, p.peak, said, BUDGET + self.chunk(name, largest, threads), p.stderr))
        report = "\n".join(f"{n} --threads {t}: peak {peak / MiB:.1f} MiB (prints {said / MiB if said else float('nan'):.1f}), "
                           f"bound {bound / MiB:.1f} MiB" for n, t, peak, said, bound, _ in rows)
        print("\n" + report)
        self.assertEqual(len(rows), 4 * len(THREADS))
        for name, _, peak, said, bound, stderr in rows:
            self.assertLessEqual(peak, bound, f"{name} over its bound:\n{report}")
            # The printed figure is the real peak (VmHWM), not an estimate: within 2 MiB of what wait4 saw.
            self.assertIsNotNone(said, f"{name} prints no peak memory: {stderr}")
            self.assertAlmostEqual(said / MiB, peak / MiB, delta=2, msg=f"{name}: {stderr}")

if __name__ == "__main__":
    unittest.main()

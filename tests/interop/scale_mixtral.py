"""ckpt-export --format hf's pipeline on Mixtral tags, whose expert matrices
it transposes whole, one at a time (tools/hf_export.cc WholeTurns): at 16
threads and the smallest budget they take, many pieces per matrix, the bytes
are the 1-thread export's and it ends (a turn taken out of file order hung it).

And benchmarks/scale_mixtral.py at its small size (issue #38, the last "Done
when" line): a MixtralForCausalLM folder imported into an HF-style tag at tp
8 ep 1, resharded to tp 4 ep 2 and back, and exported to HF, at --threads 4
and a small budget; the benchmark asserts each job's peak RSS (os.wait4)
against the budget plus one chunk (the export: plus one expert matrix, which
it holds whole to transpose) and exits 1 when one is over."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import unittest

from canon import BIN, EXPORT, IMPORT, RESHARD, TempDirTest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
# tests/interop/reshard.py's run_measured, under another name: the benchmarks' reshard.py (which scale.py imports) is "reshard".
_spec = importlib.util.spec_from_file_location("interop_reshard", os.path.join(os.path.dirname(os.path.abspath(__file__)), "reshard.py"))
interop_reshard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(interop_reshard)
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "scale_mixtral.py")


def tensors(path):
    """name -> raw bytes of a safetensors file's tensors."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {k: raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in header.items() if k != "__metadata__"}


class ScaleMixtral(TempDirTest):
    def test_export_at_16_threads_is_the_1_thread_export(self):
        sys.path.insert(0, BENCHMARKS)
        from scale import GEN_HF, PY
        hf, tag = os.path.join(self.dir, "hf"), os.path.join(self.dir, "tag")
        # hidden 512, FFN 1024, 2 layers, 32 heads, 8 KV heads, vocab 1000, 8 experts, top 2: an expert matrix is 1 MiB
        subprocess.run([PY, "-c", GEN_HF, hf, "512", "1024", "2", "32", "8", "1000", "8", "2"], check=True)
        p = subprocess.run([IMPORT, hf, tag, "--format", "hf", "--model_source", "hf", "--tp", "4", "--pp", "1", "--save_xser"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        outs = {}
        for threads, budget in ((1, "256M"), (16, "100M")):  # 100M: 17 streams of about 4.5 MiB, chunks of 256-512 KiB
            outs[threads] = os.path.join(self.dir, f"out{threads}")
            p = subprocess.run([EXPORT, tag, outs[threads], "--format", "hf", "--threads", str(threads), "--memory_budget", budget],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr)
        for name in ("model.safetensors", "config.json"):
            with open(os.path.join(outs[1], name), "rb") as a, open(os.path.join(outs[16], name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        # And they are the source folder's tensors, bit for bit (import then export is exact).
        source, exported = tensors(os.path.join(hf, "model.safetensors")), tensors(os.path.join(outs[16], "model.safetensors"))
        self.assertEqual(sorted(source), sorted(exported))
        for name, data in source.items():
            self.assertEqual(data, exported[name], name)

    def test_import_streams_the_expert_transposes_within_the_budget(self):
        """Issue #40 item 3 at Mixtral's shapes: the import used to hold each transposed expert matrix whole
        and leave every expert's mapped pages resident (1.06 GB of a 512 MiB budget at 8x7B's shapes). Here
        the experts are 96 MiB (8 x 3 matrices of 4 MiB), twice the budget: streamed, the peak stays within
        the budget plus one chunk, and the tag is the folder's bit for bit (exported back)."""
        sys.path.insert(0, BENCHMARKS)
        from scale import GEN_HF, PY
        hf, tag, out = (os.path.join(self.dir, n) for n in ("hf", "tag", "out"))
        # hidden 512, FFN 4096, 1 layer, 32 heads, 8 KV heads, vocab 1000, 8 experts, top 2: an expert matrix is 4 MiB
        subprocess.run([PY, "-c", GEN_HF, hf, "512", "4096", "1", "32", "8", "1000", "8", "2"], check=True)
        budget, threads = 48 << 20, 4
        p = interop_reshard.run_measured(IMPORT, hf, tag, "--format", "hf", "--model_source", "hf", "--tp", "8", "--pp", "1", "--save_xser",
                         "--threads", threads, "--memory_budget", f"{budget >> 20}M")
        self.assertEqual(p.returncode, 0, p.stderr)
        largest = 2 * 8 * 512 * 2 * 4096  # gate_up_proj, E x H x 2F bf16: 64 MiB; a chunk is under a thread's share of the budget
        bound = budget + min(largest, budget // threads)
        self.assertLessEqual(p.peak, bound, f"import peak {p.peak / 2**20:.1f} MiB over {bound / 2**20:.1f} MiB")
        p = subprocess.run([EXPORT, tag, out, "--format", "hf"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        source, exported = tensors(os.path.join(hf, "model.safetensors")), tensors(os.path.join(out, "model.safetensors"))
        self.assertEqual(sorted(source), sorted(exported))
        for name, data in source.items():
            self.assertEqual(data, exported[name], name)

    def test_small_mixtral_jobs_stay_within_the_budget(self):
        for b in (IMPORT, RESHARD, EXPORT, BENCH):  # a missing binary is a failure, never a skip
            self.assertTrue(os.path.exists(b), f"{b} is missing")
        p = subprocess.run([sys.executable, BENCH, "--small", "--layers", "2", "--build", BIN, "--dir", self.dir, "--threads", "4",
                            "--memory_budget", "64M"], capture_output=True, text=True, cwd=os.path.dirname(BENCH))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        jobs = re.findall(r"^\s*mixtral hf\s+(ckpt-\w+)\s", p.stdout, re.M)
        self.assertEqual(jobs, ["ckpt-import", "ckpt-reshard", "ckpt-reshard", "ckpt-export"], p.stdout)
        bounds = re.findall(r"peak RSS (\d+) MiB, bound (\d+) MiB \(budget 64 \+ (one chunk|one expert matrix) ([\d.]+)\): within", p.stdout)
        self.assertEqual([b[2] for b in bounds], ["one chunk"] * 3 + ["one expert matrix"], p.stdout)
        for peak, bound, _, extra in bounds:
            self.assertLessEqual(int(peak), int(bound), p.stdout)
        # The small model's largest tensor (gate_up_proj, 8 x 256 x 1024 bf16) is one chunk; an expert matrix 256 x 512.
        self.assertEqual([float(b[3]) for b in bounds], [4, 4, 4, 0.25], p.stdout)
        self.assertIn("every job's peak RSS within its bound", p.stdout)


if __name__ == "__main__":
    unittest.main()

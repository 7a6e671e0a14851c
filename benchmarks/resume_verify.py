"""What checking every byte of a checkpoint costs at resume.

shardkit-train now verifies a tag against its manifest CRC-32s before it
loads it (a damaged tag is skipped, never trained on). This measures, on one
checkpoint of a ~100M-parameter Llama (fp32 model and AdamW state, ~1.6 GB),
in the same run and from a cold page cache each time:
  - ckpt-verify TAG: exactly the check resume runs (sizes and every CRC-32);
  - cat of the same files to /dev/null: reading the bytes once, the physical limit;
  - torch.load of the model and optimizer files: what loading them costs torch;
  - shardkit-train resuming from the tag and stopping at once (check + load).
Usage: python3 benchmarks/resume_verify.py [--build build] [--runs 3]
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

from bench_util import settle

HERE = os.path.dirname(os.path.abspath(__file__))
CONF = os.path.join(HERE, "..", "conf", "tiny_llama.yaml")
MODEL = ["model.num_layers=12", "model.hidden_size=768", "model.ffn_hidden_size=2048", "model.num_attention_heads=12",
         "model.num_kv_heads=12", "+model.vocab_size=32000", "model.encoder_seq_length=128", "data.micro_batch_size=1",
         "data.global_batch_size=1"]


def timed(argv, **kw):
    t0 = time.time()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    return time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    train, verify = os.path.join(a.build, "bin", "shardkit-train"), os.path.join(a.build, "bin", "ckpt-verify")
    work = tempfile.mkdtemp(prefix="resume_verify.", dir=os.environ.get("TMPDIR", "/tmp"))
    os.makedirs(os.path.join(work, "data"))
    subprocess.run([os.path.join(a.build, "bin", "shardkit-tokenize"), "/usr/share/common-licenses/GPL-3",
                    os.path.join(work, "data", "text_document")], check=True, capture_output=True)
    base = [train, CONF, "exp_manager.explicit_log_dir=run", "exp_manager.async_checkpointing=False", *MODEL]
    subprocess.run(base + ["trainer.max_steps=1"], cwd=work, check=True, capture_output=True)
    tag = glob.glob(os.path.join(work, "run", "checkpoints", "*.ckpt"))[0]
    files = [f for f in glob.glob(os.path.join(tag, "**", "*"), recursive=True) if os.path.isfile(f)]
    size = sum(os.path.getsize(f) for f in files)
    loader = ("import sys, torch\n"
              "for p in sys.argv[1:]: torch.load(p)\n")
    pt = [f for f in files if f.endswith(".pt")]
    results = {k: [] for k in ("ckpt-verify", "cat", "torch.load", "shardkit-train resume")}
    for _ in range(a.runs):
        settle()
        results["ckpt-verify"].append(timed([verify, tag]))
        settle()
        results["cat"].append(timed(["sh", "-c", 'cat "$@" >/dev/null', "cat", *files]))
        settle()
        results["torch.load"].append(timed(["/usr/bin/python3", "-c", loader, *pt]))
        settle()
        results["shardkit-train resume"].append(timed(base + ["trainer.max_steps=1"], cwd=work))
    best = {k: min(v) for k, v in results.items()}
    print(f"checkpoint: {len(files)} files, {size / 2**30:.2f} GiB; best of {a.runs}, cold page cache each")
    print(f"{'job':<24} {'seconds':>8} {'GiB/s':>7} {'vs cat':>7}")
    for k, v in best.items():
        print(f"{k:<24} {v:>8.2f} {size / 2**30 / v:>7.2f} {v / best['cat']:>7.2f}")
    print(f"resume check / torch.load of the same files: {best['ckpt-verify'] / best['torch.load']:.2f}")
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    sys.exit(main())

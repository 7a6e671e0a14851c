"""Distributed training on this machine: for a few layouts, each step's time
split into compute, communication and pipeline bubble; the bytes each rank
hands to collectives and sends, against the analytic count for the layout;
and the time a checkpoint save blocks each rank, sync and async.

  python3 benchmarks/train_parallel.py [--build build] [--steps 8] [--bubble-only]

It ends with the pipeline bubble at pp 2 with and without interleaved
(virtual) pipeline stages, measured beside the analytic fraction.

Every rank writes its totals to <run>/timing.json (libtrain/trainer.cc):
collective seconds (inside all-reduce, reduce-scatter, all-gather), seconds
blocked receiving from a pipeline neighbour (the bubble, and the transfer),
and compute as the rest of the step. Payload is counted as the floats handed
over: an all-reduce's n, a reduce-scatter's whole input, an all-gather's own
block, each message sent. The analytic count below states, independently,
what Megatron's layout moves: per micro-batch tensor parallelism all-reduces
N*H floats for the embedding, 4*N*H per layer (two forward, two backward),
N*H at the output layer and 5*N for vocab-parallel cross-entropy; pipeline
stages send N*H each way; data parallelism all-reduces every gradient once
per step, or with ZeRO-1 reduce-scatters the dp-padded gradients and
all-gathers each rank's chunk; plus the scalar norm and loss sums.

On 2 cores a layout of more ranks than cores is oversubscribed: its times say
where time goes, not how fast a cluster would be.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
CONF = os.path.join(ROOT, "conf", "tiny_llama.yaml")
TEXT = "/usr/share/common-licenses/GPL-3"

MODEL = dict(hidden=256, ffn=688, heads=8, layers=4, seq=128, micro=2, global_batch=16, vocab=257, divisible=8)
LAYOUTS = [  # tp, pp, dp, zero1
    (1, 1, 1, False), (1, 1, 2, False), (1, 1, 2, True), (2, 1, 1, False), (1, 2, 1, False), (2, 2, 1, False),
]


def overrides(m, tp, pp, dp, zero1, steps, log_dir, async_save=False, save_every=0, vpp=1):
    return [f"++distributed_strategy.virtual_pipeline_model_parallel_size={vpp}",
            f"exp_manager.explicit_log_dir={log_dir}", f"trainer.devices={tp * pp * dp}", f"trainer.max_steps={steps}",
            f"distributed_strategy.tensor_model_parallel_size={tp}", f"distributed_strategy.pipeline_model_parallel_size={pp}",
            f"distributed_strategy.zero1={zero1}", f"model.hidden_size={m['hidden']}", f"model.ffn_hidden_size={m['ffn']}",
            f"model.num_attention_heads={m['heads']}", f"model.num_kv_heads={m['heads']}", f"model.num_layers={m['layers']}",
            f"model.encoder_seq_length={m['seq']}", f"data.micro_batch_size={m['micro']}", f"data.global_batch_size={m['global_batch']}",
            f"model.make_vocab_size_divisible_by={m['divisible']}", "+model.optim.sched.max_steps=100",
            f"exp_manager.async_checkpointing={async_save}", f"exp_manager.checkpoint_callback_params.every_n_train_steps={save_every}",
            f"exp_manager.create_checkpoint_callback={save_every > 0}", "exp_manager.resume_if_exists=False",
            "exp_manager.log_parameter_norm=False"]


def run(build, work, tp, pp, dp, zero1, steps, name, model=MODEL, **kw):
    log_dir = os.path.join(work, name)
    shutil.rmtree(log_dir, ignore_errors=True)
    world = tp * pp * dp
    mpi = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world)] if world > 1 else []
    cmd = [*mpi, os.path.join(build, "bin", "shardkit-train"), CONF, *overrides(model, tp, pp, dp, zero1, steps, log_dir, **kw)]
    subprocess.run(cmd, cwd=work, check=True, capture_output=True, text=True)
    with open(os.path.join(log_dir, "timing.json")) as f:
        return json.load(f)["ranks"]


def stage_layers(layers, pp, stage):
    base, rem = divmod(layers, pp)
    return base + (1 if stage >= pp - rem else 0)


def analytic_bytes(m, tp, pp, dp, zero1, rank):
    """Floats rank `rank` hands to collectives and sends in one step, times 4."""
    stage = rank // (tp * dp)
    first, last = stage == 0, stage == pp - 1
    H, F, T, B = m["hidden"], m["ffn"], m["seq"], m["micro"]
    N = B * T
    V = math.ceil(m["vocab"] / (m["divisible"] * tp)) * m["divisible"] * tp
    L = stage_layers(m["layers"], pp, stage)
    micro = m["global_batch"] // (B * dp)
    floats = 0
    if tp > 1:
        per_micro = 4 * N * H * L + (N * H if first else 0) + (N * H + 5 * N if last else 0)
        floats += micro * per_micro
    if pp > 1:
        floats += micro * ((N * H if not last else 0) + (N * H if not first else 0))
    # This rank's parameters as (rows, elements per row).
    params = []
    if first:
        params.append((V // tp, H))
    for _ in range(L):
        params += [(H, 1), (3 * H // tp, H), (H, H // tp), (H, 1), (2 * F // tp, H), (H, F // tp)]
    if last:
        params += [(H, 1), (V // tp, H)]
    if dp > 1 and not zero1:
        floats += sum(r * e for r, e in params)
    if dp > 1 and zero1:
        for r, e in params:
            shard = math.ceil(r / dp)
            floats += shard * dp * e + shard * e
    # Scalar sums (2 floats' worth each): the gradient norm over dp (ZeRO-1), tp and pp; the loss over pp and dp.
    floats += 2 * ((dp > 1 and zero1) + (tp > 1) + (pp > 1) + (pp > 1) + (dp > 1))
    return 4 * floats


def bubble(build, work, steps):
    """The pipeline bubble at pp 2 with and without interleaved (virtual) stages, at the same
    micro-batch count m: measured as the time each rank waits on its pipeline neighbour (Recv)
    over the rest of its step, beside Megatron's analytic bubble fraction (pp - 1) / (V * m),
    which is the same ratio: the bubble over the ideal step time (Narayanan et al. 2021, 2.2)."""
    pp, model = 2, dict(MODEL, layers=8)
    print(f"\nPipeline bubble at pp {pp}, {model['layers']} layers, micro-batches of {model['micro']} "
          "(mean over the ranks; wait = time blocked receiving from a pipeline neighbour):\n")
    print("| micro-batches m | virtual stages V | step ms | wait ms/step (rank 0, rank 1) | measured wait/(step-wait) | "
          "analytic (pp-1)/(V*m) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m in (2, 4, 8):
        for vpp in (1, 2, 4):
            ranks = run(build, work, 1, pp, 1, False, steps, "bubble", model=dict(model, global_batch=m * model["micro"]), vpp=vpp)
            step = sum(r["step_seconds"] / r["steps"] for r in ranks) / len(ranks)
            waits = [r["recv_wait_seconds"] / r["steps"] for r in ranks]
            wait = sum(waits) / len(waits)
            print(f"| {m} | {vpp} | {1e3 * step:.1f} | {', '.join(f'{1e3 * w:.1f}' for w in waits)} | "
                  f"{100 * wait / (step - wait):.0f}% | {100 * (pp - 1) / (vpp * m):.0f}% |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip-tokens", action="store_true", help="skip benchmarks/train_tokens.py")
    ap.add_argument("--bubble-only", action="store_true", help="only the pipeline bubble table")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="train_parallel_")
    os.makedirs(os.path.join(work, "data"))
    subprocess.run([os.path.join(args.build, "bin", "shardkit-tokenize"), TEXT, os.path.join(work, "data", "text_document")],
                   check=True, capture_output=True)
    if args.bubble_only:
        bubble(args.build, work, args.steps)
        shutil.rmtree(work, ignore_errors=True)
        return
    print(f"model: hidden {MODEL['hidden']}, {MODEL['layers']} layers, {MODEL['heads']} heads, seq {MODEL['seq']}, "
          f"{MODEL['global_batch']} sequences per step in micro-batches of {MODEL['micro']}; {args.steps} steps, mean per step\n")
    print("| layout (tp, pp, dp) | ranks | step ms | compute | collectives | pipeline wait | bytes/step/rank measured | analytic | measured/analytic |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tp, pp, dp, zero1 in LAYOUTS:
        ranks = run(args.build, work, tp, pp, dp, zero1, args.steps, "layout")
        n = len(ranks)
        step = sum(r["step_seconds"] / r["steps"] for r in ranks) / n
        coll = sum(r["collective_seconds"] / r["steps"] for r in ranks) / n
        wait = sum(r["recv_wait_seconds"] / r["steps"] for r in ranks) / n
        measured = [(r["collective_bytes"] + r["sent_bytes"]) / r["steps"] for r in ranks]
        expect = [analytic_bytes(MODEL, tp, pp, dp, zero1, r["rank"]) for r in ranks]
        ratio = [m / e if e else (1.0 if m == 0 else float("inf")) for m, e in zip(measured, expect)]
        name = f"({tp}, {pp}, {dp}){' ZeRO-1' if zero1 else ''}"
        print(f"| {name} | {n} | {1e3 * step:.1f} | {100 * (step - coll - wait) / step:.0f}% | {100 * coll / step:.0f}% | "
              f"{100 * wait / step:.0f}% | {sum(measured) / n / 1e6:.2f} MB | {sum(expect) / n / 1e6:.2f} MB | "
              f"{min(ratio):.3f}-{max(ratio):.3f} |")
    print("\nSave time blocking each rank (tp 1, pp 2, dp 2, ZeRO-1; a save every 2 steps):\n")
    print("| saves | per save, mean over ranks | slowest rank |")
    print("| --- | --- | --- |")
    for async_save in (False, True):
        ranks = run(args.build, work, 1, 2, 2, True, args.steps, "saves", async_save=async_save, save_every=2)
        saves = args.steps // 2
        per = [r["save_seconds"] / saves for r in ranks]
        print(f"| {'async' if async_save else 'sync'} | {1e3 * sum(per) / len(per):.1f} ms | {1e3 * max(per):.1f} ms |")
    bubble(args.build, work, args.steps)
    shutil.rmtree(work, ignore_errors=True)
    if not args.skip_tokens:
        print("\nOne process against torch eager (benchmarks/train_tokens.py):\n", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, "train_tokens.py"), "--build", args.build], check=True)


if __name__ == "__main__":
    main()

"""Writer trials: two writers of one output, and MPI jobs with one rank given
another job, each run many times and checked for what must hold (#35 item 3).

  python3 tests/writer_trials.py [--trials 200] [--jobs race,mismatch] [--build build] [--seed 1]

Jobs:
  race      two ckpt-reshard runs (one process each, --overwrite) of one
            source to one output, the second started after a random delay
            within one run's time (0 to 1.2 of it). Each must exit 0, or exit
            2 saying that the other one (named by its pid) is writing; at
            least one exits 0; the output then has `done`, verifies
            (ckpt-verify) and equals a lone run's output file for file; no
            staging folder or lock file is left.
  mismatch  mpirun -np 2 ckpt-reshard (an MPMD launch, `-np 1 A : -np 1 B`)
            where a random rank is given another source, --tp, --pp or
            output. It must exit 2 naming that option; nothing may be
            written: no output, no staging folder, no `done` but the sources'.
Prints one line per trial and a table of trials and outcomes per job; exits 1
on any failure.
"""
import argparse
import collections
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kill_trials import MPI, PY, tree  # noqa: E402

# The source: an NxD tag at tp 2 (tests/interop/nxd_fixture.py), about 11 MB with its optimizer state.
WIDE = "dict(gpt=False, hidden=128, ffn=256, heads=4, kv_heads=4, layers=4, vocab=512, divisible=8, seq=16)"
HINTS = ["--heads", "4", "--kv_heads", "4", "--vocab_size", "512", "--make_vocab_size_divisible_by", "8"]


def make_source(parent, seed):
    code = (f"import sys; sys.path.insert(0, {os.path.join(HERE, 'interop')!r}); from nxd_fixture import make_full, write_tag; "
            f"print(write_tag({parent!r}, make_full({WIDE}, tp=2, seed={seed}), 2, 1, 1, False, None))")
    return subprocess.run([PY, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


class Trials:
    def __init__(self, build, work):
        self.build, self.work = build, work

    def bin(self, name):
        return os.path.join(self.build, "bin", name)

    def reshard(self, src, out, tp=1, pp=1, *extra):
        return [self.bin("ckpt-reshard"), src, out, "--tp", str(tp), "--pp", str(pp), "--no_verify", "--threads", "1", *HINTS, *extra]

    def verifies(self, tag):
        return subprocess.run([self.bin("ckpt-verify"), tag], capture_output=True).returncode == 0

    def leftovers(self, folder, keep):
        return sorted(n for n in os.listdir(folder) if n not in keep)


class Race(Trials):
    def prepare(self):
        self.src = make_source(os.path.join(self.work, "src"), 0)
        ref = os.path.join(self.work, "ref", "tag")
        t0 = time.time()
        subprocess.run(self.reshard(self.src, ref), check=True, capture_output=True)
        self.seconds = time.time() - t0
        self.ref = tree(ref)

    def trial(self, n, rng):
        folder = os.path.join(self.work, f"t{n}")
        os.makedirs(folder)
        out = os.path.join(folder, "tag")
        delay = rng.uniform(0, 1.2 * self.seconds)
        logs = [open(os.path.join(folder, f"w{i}.log"), "w+") for i in range(2)]
        first = subprocess.Popen(self.reshard(self.src, out, 1, 1, "--overwrite"), stdout=logs[0], stderr=subprocess.STDOUT)
        time.sleep(delay)
        second = subprocess.Popen(self.reshard(self.src, out, 1, 1, "--overwrite"), stdout=logs[1], stderr=subprocess.STDOUT)
        procs = [first, second]
        codes = [p.wait(timeout=300) for p in procs]
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
        outcome = {(0, 0): "both wrote (one after the other)", (0, 2): "the second was refused", (2, 0): "the first was refused"}.get(tuple(codes))
        why = ""
        if outcome is None:
            outcome = f"exit codes {codes}"
            why = f"exit codes {codes}: {[t[-600:] for t in texts]}"
        for i, code in enumerate(codes):
            other = procs[1 - i].pid
            if code == 2 and f"another writer is writing this tag (pid {other} on " not in texts[i]:
                why = why or f"writer {i} exited 2 without naming the other's pid {other}: {texts[i][-600:]}"
        if not os.path.exists(os.path.join(out, "done")):
            why = why or f"{out} has no `done` though a writer exited 0"
        elif not self.verifies(out):
            why = why or f"{out} has `done` but does not verify"
        elif tree(out) != self.ref:
            why = why or f"{out} has `done` but differs from a lone run's output"
        if not why and self.leftovers(folder, {"tag", "w0.log", "w1.log"}):
            why = f"left behind: {self.leftovers(folder, {'tag', 'w0.log', 'w1.log'})}"
        if not why:
            shutil.rmtree(folder)
        return f"second after {delay:.2f} s: {outcome}", why


class Mismatch(Trials):
    FIELDS = ("src", "--tp", "--pp", "dst")

    def prepare(self):
        self.src = make_source(os.path.join(self.work, "src"), 0)
        self.other_src = make_source(os.path.join(self.work, "other_src"), 1)

    def trial(self, n, rng):
        folder = os.path.join(self.work, f"t{n}")
        os.makedirs(folder)
        out = os.path.join(folder, "tag")
        field = rng.choice(self.FIELDS)
        odd = rng.randrange(2)  # the rank given another job
        jobs = []
        for rank in range(2):
            src, dst, tp, pp = self.src, out, 1, 1
            if rank == odd:
                if field == "src":
                    src = self.other_src
                elif field == "--tp":
                    tp = 2
                elif field == "--pp":
                    pp = 2
                else:
                    dst = os.path.join(folder, "other")
            jobs.append(self.reshard(src, dst, tp, pp))
        p = subprocess.run([*MPI, "-np", "1", *jobs[0], ":", "-np", "1", *jobs[1]], capture_output=True, text=True, timeout=300)
        why = ""
        named = f"the ranks of this mpirun were not given the same job, so none of them writes anything: {field} is '"
        if p.returncode != 2:
            why = f"exit {p.returncode}, not 2: {p.stderr[-600:]}"
        elif named not in p.stderr:
            why = f"the message does not name {field}: {p.stderr[-600:]}"
        written = [os.path.join(d, "done") for d, _, names in os.walk(folder) if "done" in names]
        bad = [d for d in written if not self.verifies(os.path.dirname(d))]
        if bad:
            why = f"`done` tags that fail ckpt-verify: {bad}"  # the failure, above all others
        elif written:
            why = why or f"written though the ranks differ: {written}"
        elif os.listdir(folder):
            why = why or f"left behind: {sorted(os.listdir(folder))}"
        if not why:
            shutil.rmtree(folder)
        return f"exit {p.returncode}: rank {odd} given another {field}", why


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--jobs", default="race,mismatch")
    ap.add_argument("--build", default=os.path.join(os.path.dirname(HERE), "build"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default="/tmp")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    kinds = {"race": Race, "mismatch": Mismatch}
    table, failed = [], False
    for name in a.jobs.split(","):
        work = tempfile.mkdtemp(dir=a.dir, prefix=f"writer_{name}_")
        try:
            job = kinds[name](os.path.abspath(a.build), work)
            job.prepare()
            outcomes, failures = collections.Counter(), 0
            for n in range(a.trials):
                what, why = job.trial(n, rng)
                failures += bool(why)
                outcomes[what.split(": ", 1)[1]] += 1
                print(f"{name} trial {n + 1}/{a.trials}: {what}: {why or 'ok'}", flush=True)
            table.append((name, a.trials, failures, outcomes))
            failed |= failures > 0
        finally:
            if not failed:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"{name}: kept {work} for inspection", flush=True)
    print(f"\n{'job':10s} {'trials':>7s} {'failures':>9s}  outcomes")
    for name, trials, failures, outcomes in table:
        print(f"{name:10s} {trials:7d} {failures:9d}  " + "; ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

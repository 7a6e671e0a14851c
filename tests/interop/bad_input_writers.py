"""One job, one writer (#35 item 3).

- The ranks of one mpirun must run one job: a rank given another source,
  --tp or output (an MPMD launch, `mpirun -np 1 A : -np 1 B`, is how the
  sweep gave them) ends the group with exit 2 before anything is written,
  naming what differs with rank 0's value and its own
  (ckpt/store/job_agreement.h). Before, rank 0 committed a tag mixing two
  checkpoints, or a `done` tag that failed ckpt-verify, with exit 0.
- One output, one writer: a second ckpt-reshard writing the output another
  live one is writing exits 2 naming the first one's pid and touches nothing
  (the writer lock, ckpt/store/tag_writer.h); a lock left by a SIGKILLed
  writer blocks nobody; `ckpt-verify --gc` leaves a live writer's staging
  folder alone. Before, two writers shared the staging folder and the result
  could carry `done` and fail ckpt-verify.
tests/writer_trials.py runs both cases many times (the 200-trial figures are
in docs/reliability.md).
"""
import fcntl
import os
import signal
import socket
import subprocess
import time
import unittest

from canon import CONVERT, RESHARD, VERIFY, TempDirTest
from nnm_fixture import make_nnm
from nxd_fixture import make_full, write_tag
from reshard import LLAMA, format_args

MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
# Big enough that a write lasts long enough to be caught holding its lock.
WIDE = dict(LLAMA, hidden=128, ffn=256, layers=4, vocab=512)


def run(args, timeout=120, **kw):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)


def described(tag):
    """A source as the job check describes it: resolved path, files and bytes."""
    files = [os.path.join(d, f) for d, _, names in os.walk(tag) for f in names]
    return f"{os.path.realpath(tag)} ({len(files)} files, {sum(os.path.getsize(f) for f in files)} bytes)"


def dones(root):
    return sorted(os.path.join(d, "done") for d, _, names in os.walk(root) if "done" in names)


class MismatchedRanks(TempDirTest):
    """mpirun -np 2 with one rank given another job: exit 2, nothing written."""

    def setUp(self):
        super().setUp()
        for b in (RESHARD, VERIFY, CONVERT):  # a missing binary is a failure, not a skip
            self.assertTrue(os.access(b, os.X_OK), f"{b} is not built")
        self.src_a = write_tag(os.path.join(self.dir, "a"), make_full(LLAMA, tp=2, seed=0), 2, 1, 1, False, None)
        self.src_b = write_tag(os.path.join(self.dir, "b"), make_full(LLAMA, tp=2, seed=1), 2, 1, 1, False, None)
        self.out = os.path.join(self.dir, "out", "tag")
        os.makedirs(os.path.dirname(self.out))

    def reshard(self, src, out, tp):
        return [RESHARD, src, out, "--tp", tp, "--pp", 1, "--no_verify", *format_args(LLAMA)]

    def mpmd(self, rank0, rank1):
        return run([*MPI, "-np", 1, *rank0, ":", "-np", 1, *rank1])

    def assert_refused(self, p, field, rank0_value, rank1_value):
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("rank 1: error: the ranks of this mpirun were not given the same job, so none of them writes anything: "
                      f"{field} is '{rank0_value}' on rank 0 but '{rank1_value}' on rank 1", p.stderr)
        self.assertEqual([d for d in dones(self.dir) if not d.startswith((self.src_a, self.src_b))], [])  # the sources' only
        self.assertEqual(os.listdir(os.path.dirname(self.out)), [])  # no target, staging folder or lock file

    def test_a_rank_given_another_source_is_refused(self):
        p = self.mpmd(self.reshard(self.src_a, self.out, 1), self.reshard(self.src_b, self.out, 1))
        self.assert_refused(p, "src", described(self.src_a), described(self.src_b))

    def test_a_rank_given_another_tp_is_refused(self):
        p = self.mpmd(self.reshard(self.src_a, self.out, 1), self.reshard(self.src_a, self.out, 2))
        self.assert_refused(p, "--tp", "1", "2")

    def test_a_rank_given_another_output_is_refused(self):
        other = os.path.join(os.path.dirname(self.out), "other")
        p = self.mpmd(self.reshard(self.src_a, self.out, 1), self.reshard(self.src_a, other, 1))
        self.assert_refused(p, "dst", os.path.realpath(self.out), os.path.realpath(other))

    def test_the_same_job_on_every_rank_is_written(self):
        p = run([*MPI, "-np", 2, *self.reshard(self.src_a, self.out, 1)])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(run([VERIFY, self.out]).returncode, 0)
        self.assertEqual(os.listdir(os.path.dirname(self.out)), ["tag"])  # the writer lock went with the writer

    def test_nnm2nxdt_ckpt_ranks_given_another_tp_are_refused(self):
        nnm = os.path.join(self.dir, "nnm")
        make_nnm(nnm, LLAMA, tp=2, pp=1)
        cmd = lambda tp: [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", self.out, "--tp", tp]
        p = self.mpmd(cmd(2), cmd(1))
        self.assert_refused(p, "--tp", "2", "1")


class OneWriter(TempDirTest):
    """Two ckpt-reshard runs writing one output."""

    def setUp(self):
        super().setUp()
        for b in (RESHARD, VERIFY):
            self.assertTrue(os.access(b, os.X_OK), f"{b} is not built")
        self.src = write_tag(os.path.join(self.dir, "src"), make_full(WIDE, tp=2), 2, 1, 1, False, None)
        self.out = os.path.join(self.dir, "out", "tag")
        self.lock = os.path.join(self.dir, "out", ".tag.writer-lock")
        os.makedirs(os.path.dirname(self.out))

    def command(self, *extra):
        return [str(a) for a in (RESHARD, self.src, self.out, "--tp", 1, "--pp", 1, "--no_verify", "--threads", 1, *format_args(WIDE), *extra)]

    def test_a_second_writer_is_refused_naming_the_first_ones_pid(self):
        """The first writer is stopped while it holds the lock; the second
        runs to its end meanwhile; then the first finishes."""
        for attempt in range(5):  # a first writer that ends before it is caught is tried again
            first = subprocess.Popen(self.command("--overwrite"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            holder = ""
            while first.poll() is None and not holder:
                try:
                    with open(self.lock) as f:
                        holder = f.read()
                except FileNotFoundError:
                    pass
            if holder:
                first.send_signal(signal.SIGSTOP)
                if first.poll() is not None or not os.path.exists(self.lock):  # it ended between the read and the stop
                    holder = ""
            if not holder:
                first.send_signal(signal.SIGCONT)
                first.communicate()
                continue
            self.assertEqual(holder, f"pid {first.pid} on {socket.gethostname()}")
            second = run(self.command("--overwrite"))
            first.send_signal(signal.SIGCONT)
            _, err = first.communicate(timeout=120)
            self.assertEqual(second.returncode, 2, second.stderr)
            self.assertIn(f"error: {self.out}: another writer is writing this tag (pid {first.pid} on {socket.gethostname()}, "
                          f"holding {self.lock}); nothing was written", second.stderr)
            self.assertEqual(first.returncode, 0, err)  # the second touched none of its staging folder
            v = run([VERIFY, self.out])
            self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
            self.assertEqual(sorted(os.listdir(os.path.dirname(self.out))), ["tag"])
            return
        self.fail("no first writer was caught holding its lock in 5 runs")

    def test_two_writers_started_together_one_succeeds_and_the_result_verifies(self):
        for trial in range(3):
            if os.path.exists(self.out):
                subprocess.run(["rm", "-rf", self.out], check=True)
            procs = [subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
            results = [(p.pid, p.wait(timeout=120), p.communicate()[1]) for p in procs]
            codes = sorted(rc for _, rc, _ in results)
            self.assertEqual(codes, [0, 2], results)  # without --overwrite the later one is refused whenever it comes
            (winner,) = [pid for pid, rc, _ in results if rc == 0]
            (loser_err,) = [err for _, rc, err in results if rc == 2]
            self.assertTrue(f"another writer is writing this tag (pid {winner} on " in loser_err or
                            f"{self.out}: exists and is not empty" in loser_err, loser_err)
            v = run([VERIFY, self.out])
            self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
            self.assertEqual(sorted(os.listdir(os.path.dirname(self.out))), ["tag"])

    def test_a_lock_left_by_a_killed_writer_blocks_nobody(self):
        holder = subprocess.Popen(["python3", "-c", "import fcntl, os, sys, time\n"
                                   f"f = open({self.lock!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX); f.write('pid %d on x' % os.getpid()); f.flush()\n"
                                   "print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        self.assertEqual(holder.stdout.readline(), "held\n")
        refused = run(self.command())
        self.assertEqual(refused.returncode, 2, refused.stderr)
        self.assertIn(f"another writer is writing this tag (pid {holder.pid} on x, holding {self.lock})", refused.stderr)
        self.assertFalse(os.path.exists(self.out))
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
        self.assertTrue(os.path.exists(self.lock))  # left behind with the dead writer's pid
        p = run(self.command())
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(run([VERIFY, self.out]).returncode, 0)
        self.assertEqual(sorted(os.listdir(os.path.dirname(self.out))), ["tag"])

    def test_gc_leaves_a_live_writer_s_staging_folder_alone(self):
        staging = os.path.join(self.dir, "out", ".tag.reshard-partial")
        os.makedirs(os.path.join(staging, ".shardkit"))
        with open(os.path.join(staging, "checkpoint"), "w") as f:  # BeginTag's marker: gc counts it as an incomplete tag
            f.write("1")
        with open(self.lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            held.write("pid 4242 on x")
            held.flush()
            g = run([VERIFY, "--gc", os.path.dirname(self.out)])
            self.assertEqual(g.returncode, 0, g.stderr)
            self.assertIn(f"left alone {staging}: not ours to remove (a live writer is writing it (pid 4242 on x))", g.stdout)
            self.assertTrue(os.path.isdir(staging))
        g = run([VERIFY, "--gc", os.path.dirname(self.out)])  # its writer gone, it is debris
        self.assertEqual(g.returncode, 0, g.stderr)
        self.assertIn(f"removed {staging} (incomplete: no done marker)", g.stdout)
        self.assertEqual(os.listdir(os.path.dirname(self.out)), [".shardkit.lock"])  # gc's own store lock; no writer lock


if __name__ == "__main__":
    unittest.main()

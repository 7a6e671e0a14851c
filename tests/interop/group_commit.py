"""A failing rank ends the whole multi-process job fast, and nothing looks complete.

The tools that write a tag from several processes (ckpt-reshard, ckpt-import,
nnm2nxdt-ckpt under mpirun; ckpt/util/writer_group.h) agree through MPI
collectives: rank 0 broadcasts the save id, gathers every rank's completion
record and broadcasts its decision to commit or abort. A rank that fails
aborts the group. These tests run that protocol (tests/tools/group_commit_check.cc)
and the tools themselves with one rank failing, and time how fast its peers end.

mpirun here is told not to end the job when a process exits non-zero
(orte_abort_on_non_zero_status 0): the guarantee must come from the tools, not
from the launcher. (A rank SIGKILLed is tests/kill_trials.py's case.)
"""
import json
import os
import subprocess
import time
import unittest
import zlib

import torch

from canon import BIN, RESHARD, VERIFY, TempDirTest
from nxd_fixture import make_full, write_tag
from reshard import GPT, format_args

CHECK = os.path.join(BIN, "bin", "group_commit_check")
# Not the launcher's doing: mpirun keeps the job when one process exits non-zero.
MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "orte_abort_on_non_zero_status", "0"]
END_WITHIN = 10.0  # seconds, the bound for peers of a failed rank


def run(*args, timeout=120):
    t0 = time.monotonic()
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


class GroupCommit(TempDirTest):
    def setUp(self):
        super().setUp()
        self.out = os.path.join(self.dir, "jobs")
        os.makedirs(self.out)
        for b in (CHECK, RESHARD, VERIFY):  # a missing binary is a failure, not a skip
            self.assertTrue(os.access(b, os.X_OK), f"{b} is not built")

    def check(self, scenario, np=3):
        out = os.path.join(self.out, scenario)
        p, secs = run(*MPI, "-np", np, CHECK, out, scenario)
        return out, p, secs

    def assert_nothing_complete(self, out):
        """No target, and no `done` anywhere beside it."""
        self.assertFalse(os.path.exists(out), out)
        for d, _, names in os.walk(os.path.dirname(out)):
            self.assertNotIn("done", names, d)

    def test_every_rank_writes_and_rank_0_commits(self):
        out, p, _ = self.check("ok")
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(os.path.join(out, "manifest.json")) as f:
            recorded = json.load(f)["files"]
        self.assertEqual(sorted(recorded), [f"model/rank_{r:02d}.pt" for r in range(3)])  # every rank's record gathered
        for r in range(3):
            path = os.path.join(out, "model", f"rank_{r:02d}.pt")
            self.assertEqual(torch.load(path).tolist(), [r * 10.0 + i for i in range(4)])
            with open(path, "rb") as f:
                data = f.read()
            self.assertEqual(recorded[f"model/rank_{r:02d}.pt"], {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"})
        self.assertTrue(os.path.exists(os.path.join(out, "done")))
        self.assertEqual(sorted(os.listdir(os.path.dirname(out))), ["ok"])  # no staging folder left

    def test_a_rank_failing_ends_its_writing_peers_within_10_s(self):
        """The other ranks are in a 60 s write when the last rank fails."""
        out, p, secs = self.check("fail_while_writing")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("rank 2: error: rank 2 failed on purpose", p.stderr)
        self.assertLess(secs, END_WITHIN, p.stderr)
        self.assert_nothing_complete(out)

    def test_a_rank_failing_ends_peers_waiting_in_the_commit(self):
        out, p, secs = self.check("fail_before_commit")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertLess(secs, END_WITHIN, p.stderr)
        self.assert_nothing_complete(out)

    def test_a_refused_commit_is_every_rank_s_error_and_leaves_nothing(self):
        out, p, secs = self.check("commit_refused")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("rank 0: error: the commit check refused on purpose", p.stderr)
        for r in (1, 2):  # told, not left waiting (unless rank 0's abort ended them first)
            if f"rank {r}: error" in p.stderr:
                self.assertIn(f"rank {r}: error: {out}: rank 0 did not commit the tag (the commit check refused on purpose)", p.stderr)
        self.assertLess(secs, END_WITHIN, p.stderr)
        self.assertEqual(os.listdir(os.path.dirname(out)), [])  # the staging folder went too

    def test_ckpt_reshard_rank_0_refusing_ends_rank_1_at_once(self):
        """Rank 0 refuses the target before the save begins; rank 1 waits for
        the save id in a broadcast, not by polling the file system for minutes."""
        parent = os.path.join(self.dir, "src")
        os.makedirs(parent)
        src = write_tag(parent, make_full(GPT, tp=2), 2, 1, 1, False, None)
        target = os.path.join(self.out, "taken")
        os.makedirs(target)
        with open(os.path.join(target, "notes.txt"), "w") as f:
            f.write("the user's\n")
        p, secs = run(*MPI, "-np", 2, RESHARD, src, target, "--tp", 1, "--pp", 1, *format_args(GPT))
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("rank 0: error: ", p.stderr)
        self.assertLess(secs, END_WITHIN, p.stderr)
        self.assertEqual(os.listdir(target), ["notes.txt"])


if __name__ == "__main__":
    unittest.main()

"""Resume reads the files each rank loads, and nothing of the other ranks'
(#36 step 3: a recorded parallel layout).

A multi-rank shardkit-train job is resumed with every rank under
`strace -e trace=openat`, and the files of the resumed tag each rank opened
are counted. The tag's manifest records its parallel layout and every file's
CRC-32, so choosing the tag and checking that it fits needs no rank file: each
rank opens only its own model and optimizer files, plus the tag's manifest
and its shared small files (scheduler.pt, user_content.pt). Resumed at another
layout (exp_manager.resume_reshard), the source is checked once, a share by
each rank, and not again by the reshard: each source file is read for its
checksum by one rank only. Before step 3, rank 0 read every rank file of the
tag (its checksums, then its layout) before any rank trained, and with
resume_reshard checked every byte of the source twice.
"""
import collections
import json
import os
import re
import shutil
import subprocess
import unittest

from canon import TOKENIZE, TRAIN, TempDirTest, run
from train_resume import CONF, TEXT

SHARED = {"manifest.json", "scheduler.pt", "user_content.pt"}
OPENAT = re.compile(r'openat\(AT_FDCWD, "([^"]+)", ([A-Z_|]+)[^)]*\) = \d+')


def rank_file(kind, dp, tp, pp):
    return f"{kind}/dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


class ResumeOpens(TempDirTest):
    def setUp(self):
        super().setUp()
        self.assertIsNotNone(shutil.which("strace"), "strace is missing (scripts/setup.sh installs it)")
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))

    def train(self, world, extra, steps, traced=None, tp=1, pp=1):
        cmd = [TRAIN, CONF, "exp_manager.explicit_log_dir=run", f"trainer.devices={world}",
               f"distributed_strategy.tensor_model_parallel_size={tp}", f"distributed_strategy.pipeline_model_parallel_size={pp}",
               f"trainer.max_steps={steps}", "+model.optim.sched.max_steps=40", "data.global_batch_size=16",
               "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
               "exp_manager.checkpoint_callback_params.save_top_k=-1", *extra]
        if traced:  # each rank under its own strace, its calls in traced.<rank>
            cmd = ["sh", "-c", 'exec strace -f -qq -e trace=openat -o "$0.$OMPI_COMM_WORLD_RANK" "$@"', traced, *cmd]
        if world > 1:
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world), *cmd]
        p = subprocess.run(cmd, cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def tag(self, step=2):
        return os.path.join(self.dir, "run", "checkpoints", f"tiny_llama--step={step}-consumed_samples={16.0 * step}.ckpt")

    def opens(self, traced, world, tag):
        """Per rank, a Counter of the regular files under `tag` it opened (relative paths)."""
        out = []
        for r in range(world):
            got = collections.Counter()
            with open(f"{traced}.{r}") as f:
                for line in f:
                    m = OPENAT.search(line)
                    path = m and os.path.normpath(os.path.join(self.dir, m.group(1)))  # relative to the job's folder
                    if m and path.startswith(tag + "/") and "O_DIRECTORY" not in m.group(2):
                        got[path[len(tag) + 1:]] += 1
            out.append(got)
        return out

    def test_each_rank_opens_only_its_own_files_of_the_tag_it_resumes(self):
        # tp 2, dp 2 with ZeRO-1: two model files (one per tp rank, shared by the dp ranks), four optimizer files.
        extra = ["distributed_strategy.zero1=True"]
        self.train(4, extra, 2, tp=2)
        tag = self.tag()
        # The manifest records the layout resume decides from: the grid, each pp rank's layers, no master
        # weights (fp32 training), plain .pt files.
        with open(os.path.join(tag, "manifest.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["grid"], {"tp": 2, "pp": 1, "dp": 2, "zero1": True})
        self.assertEqual(manifest["layout"], {"stages": [[[0, 2]]], "master_weights": False, "container": "pt"})
        traced = os.path.join(self.dir, "opens")
        r = self.train(4, extra, 2, traced=traced, tp=2)
        self.assertIn("resumed from " + os.path.relpath(tag, self.dir), r.stderr)
        opens = self.opens(traced, 4, tag)
        for rank, got in enumerate(opens):
            dp, tp = rank // 2, rank % 2  # NxD's order: tp fastest
            own = {rank_file("model", 0, tp, 0), rank_file("optim", dp, tp, 0)}
            # Its own files are read (loaded and checked), and nothing else but the shared ones.
            self.assertEqual(set(got) - SHARED, own, f"rank {rank} opened {sorted(got)}")
            self.assertIn("manifest.json", got)
        # The two files each rank loads are checked against the manifest by it: every rank file of the tag is read.
        every = {f for got in opens for f in got} - SHARED
        self.assertEqual(len(every), 6)

    def test_resume_at_another_layout_checks_each_source_file_once(self):
        # One process's ZeRO-1 tag, resumed at pp 2 by two ranks with resume_reshard.
        extra = ["model.num_layers=3", "distributed_strategy.zero1=True"]
        self.train(1, extra, 2)
        tag = self.tag()
        with open(os.path.join(tag, "manifest.json")) as f:
            self.assertEqual(json.load(f)["layout"]["stages"], [[[0, 3]]])
        traced = os.path.join(self.dir, "opens")
        r = self.train(2, [*extra, "+exp_manager.resume_reshard=True"], 2, traced=traced, pp=2)
        self.assertIn("resharding it into", r.stderr)
        # The resharded copy records its own layout: 3 layers over 2 stages, as StageBounds cuts them.
        with open(os.path.join(self.dir, "run", "checkpoints-tp1pp2dp1", os.path.basename(tag), "manifest.json")) as f:
            self.assertEqual(json.load(f)["layout"], {"stages": [[[0, 1]], [[1, 3]]], "master_weights": False, "container": "pt"})
        opens = self.opens(traced, 2, tag)
        for rel in [rank_file("model", 0, 0, 0), rank_file("optim", 0, 0, 0)]:
            per_rank = [got[rel] for got in opens]
            # The reshard's own reading opens it on every rank for its index, and once more on a rank that
            # copies from it (the pread descriptor of ckpt/util/open_file_cache.h; the index maps it); one
            # rank, and only one, opens it twice more to check it against the manifest: its checksum, then
            # that it loads. So the ranks differ by 2, or 3 when only the checking rank copies. (Before,
            # rank 0 did the check twice, and read its layout besides: 5 more.)
            low, high = sorted(per_rank)
            self.assertGreaterEqual(low, 1, f"{rel}: opened {per_rank} times by ranks 0, 1")
            self.assertIn(high - low, (2, 3), f"{rel}: opened {per_rank} times by ranks 0, 1")

if __name__ == "__main__":
    unittest.main()

"""Bad input to resume and to the optimizer's structure (issue #35, items 4
and 5): resume trusts what a tag records, not its name, and refuses values no
run reaches; ckpt-verify and ckpt-reshard tell a ZeRO-1 tag that lost half
its shards to a context-parallel save.

  - a tag named step=999999999999999999 whose content says step 4 is resumed
    at step 4 with a warning, and the run advances: the next restart resumes
    from the tag it saved, not the lying one again;
  - a user_content.pt step of 2^62, an infinite, NaN or negative consumed
    samples value, a NaN LR: the tag is skipped as damaged, saying which value,
    and the run resumes from the one before it;
  - NxD's save under context parallelism (dp 2 x cp 2) built from a real NxD
    ZeRO-1 tag (tests/data/upstream/nxd_tags/nxd_pt/step_4): ckpt-verify
    FAILED (exit 1) naming the file, the parameter and dp x cp; ckpt-reshard
    exit 2 saying the same."""
import json
import os
import re
import shutil
import subprocess
import zlib
import unittest

import torch

from canon import RESHARD, TOKENIZE, TRAIN, VERIFY, TempDirTest, run

HERE = os.path.dirname(os.path.abspath(__file__))
CONF = os.path.join(HERE, "..", "..", "conf", "tiny_llama.yaml")
TEXT = "/usr/share/common-licenses/GPL-3"  # in every Debian (base-files)
NXD_PT = os.path.join(HERE, "..", "data", "upstream", "nxd_tags", "nxd_pt", "step_4")
LYING = "tiny_llama--step=999999999999999999-consumed_samples=32.0.ckpt"


def tag_name(step):
    return f"tiny_llama--step={step}-consumed_samples={8.0 * step}.ckpt"


def rewrite(tag, rel, value):
    """Saves `value` as tag/rel with torch and records its bytes in the manifest, so that the
    value, not a checksum, is all that is wrong with the tag."""
    path = os.path.join(tag, rel)
    torch.save(value, path)
    with open(path, "rb") as f:
        data = f.read()
    mpath = os.path.join(tag, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m["files"][rel] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    with open(mpath, "w") as f:
        json.dump(m, f)


class ResumeTrustsContent(TempDirTest):
    @classmethod
    def setUpClass(cls):
        # One 4-step run (a tag at steps 2 and 4) that every test copies.
        import tempfile
        cls.base = tempfile.mkdtemp(prefix="bad_input_resume")
        os.makedirs(os.path.join(cls.base, "data"))
        run(TOKENIZE, TEXT, os.path.join(cls.base, "data", "text_document"))
        cls.train_in(cls.base, 4)
        cls.ckpts = os.path.join(cls.base, "run", "checkpoints")
        tags = sorted(n for n in os.listdir(cls.ckpts) if not n.startswith("."))
        assert tags == [tag_name(2), tag_name(4)], tags

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.base, ignore_errors=True)

    @staticmethod
    def train_in(cwd, max_steps, check=True):
        cmd = [TRAIN, CONF, "exp_manager.explicit_log_dir=run", f"trainer.max_steps={max_steps}",
               "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
               "exp_manager.checkpoint_callback_params.save_top_k=-1", "exp_manager.async_checkpointing=False",
               "+model.optim.sched.max_steps=20"]
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        if check and p.returncode != 0:
            raise AssertionError(f"shardkit-train exited {p.returncode}:\n{p.stderr[-3000:]}")
        return p

    def setUp(self):
        super().setUp()
        shutil.copytree(os.path.join(self.base, "data"), os.path.join(self.dir, "data"))
        shutil.copytree(self.ckpts, os.path.join(self.dir, "run", "checkpoints"))
        self.ckpt = os.path.join(self.dir, "run", "checkpoints")

    def test_a_lying_name_resumes_from_content_and_the_run_advances(self):
        os.rename(os.path.join(self.ckpt, tag_name(4)), os.path.join(self.ckpt, LYING))
        p = self.train_in(self.dir, 6)
        self.assertIn(f"warning: {LYING} is named for step 999999999999999999 but user_content.pt records step 4; "
                      "resuming at step 4, what the tag records", p.stderr)
        self.assertRegex(p.stderr, r"resumed from \S*" + re.escape(LYING) + r" at step 4, 32 samples consumed")
        self.assertTrue(os.path.exists(os.path.join(self.ckpt, tag_name(6), "done")), os.listdir(self.ckpt))
        # The next restart takes the tag it saved (step 6 > the content's 4), not the lying name again.
        p = self.train_in(self.dir, 8)
        self.assertRegex(p.stderr, r"resumed from \S*" + re.escape(tag_name(6)) + r" at step 6, 48 samples consumed")
        self.assertTrue(os.path.exists(os.path.join(self.ckpt, tag_name(8), "done")), os.listdir(self.ckpt))
        saved = torch.load(os.path.join(self.ckpt, tag_name(8), "user_content.pt"))
        self.assertEqual((saved["global_step"], saved["consumed_samples"]), (8, 64.0))

    def test_a_lying_name_does_not_pass_into_a_resharded_tag(self):
        """A tag without our manifest (as NxD writes them): ckpt-reshard takes the step its
        user_content.pt records, says the name disagrees, and names the new tag by the content."""
        os.rename(os.path.join(self.ckpt, tag_name(4)), os.path.join(self.ckpt, LYING))
        os.remove(os.path.join(self.ckpt, LYING, "manifest.json"))
        out = os.path.join(self.dir, "out")
        p = run(RESHARD, os.path.join(self.ckpt, LYING), "--checkpoint_dir", out, "--tp", "1", "--pp", "1", "--heads", "4")
        self.assertIn("name says step 999999999999999999 but its user_content.pt records step 4", p.stderr)
        self.assertEqual(os.listdir(out), [tag_name(4)])
        with open(os.path.join(out, tag_name(4), "manifest.json")) as f:
            self.assertEqual(json.load(f)["step"], 4)

    def damaged_is_skipped(self, rel, change, why):
        """Makes a tag named step=8 from step 4's, with `change` applied to its `rel`: resume skips it
        as damaged naming `why`, and resumes from step 4; ckpt-verify fails it naming the same."""
        bad = os.path.join(self.ckpt, tag_name(8))
        shutil.copytree(os.path.join(self.ckpt, tag_name(4)), bad)
        value = torch.load(os.path.join(bad, rel))
        change(value)
        rewrite(bad, rel, value)
        v = subprocess.run([VERIFY, bad], capture_output=True, text=True)
        self.assertEqual(v.returncode, 1, v.stdout + v.stderr)
        self.assertIn(f"FAILED  {bad}", v.stdout)
        self.assertIn(f"  {rel}: {why}", v.stdout)
        p = self.train_in(self.dir, 5)
        self.assertIn(f"resume: skipping {tag_name(8)}: {rel}: {why}", p.stderr)
        self.assertRegex(p.stderr, r"resumed from \S*" + re.escape(tag_name(4)) + r" at step 4, 32 samples consumed")
        self.assertTrue(os.path.exists(os.path.join(self.ckpt, tag_name(5), "done")))
        self.assertTrue(os.path.isdir(bad))  # kept as evidence

    def test_a_step_of_2_to_the_62_is_damage(self):
        self.damaged_is_skipped("user_content.pt", lambda u: u.update(global_step=1 << 62),
                                "global_step is 4611686018427387904, beyond 2^40 (1099511627776), more than any run takes")

    def test_infinite_consumed_samples_are_damage(self):
        self.damaged_is_skipped("user_content.pt", lambda u: u.update(consumed_samples=float("inf")),
                                "consumed_samples is inf, not a finite count")

    def test_nan_consumed_samples_are_damage(self):
        self.damaged_is_skipped("user_content.pt", lambda u: u.update(consumed_samples=float("nan")),
                                "consumed_samples is nan, not a finite count")

    def test_negative_consumed_samples_are_damage(self):
        self.damaged_is_skipped("user_content.pt", lambda u: u.update(consumed_samples=-64.0),
                                "consumed_samples is -64.000000, negative")

    def test_a_nan_learning_rate_is_damage(self):
        self.damaged_is_skipped("user_content.pt", lambda u: u["lr_schedulers"][0].update(base_lrs=[float("nan")]),
                                "lr_schedulers[0].base_lrs[0] is nan, not a learning rate (finite, not negative)")


def cp_lost(src, dst, cp=2, landed=1):
    """`src`, a ZeRO-1 tag NxD saved at dp 2, as NxD's save_checkpoint writes the same model under
    context parallelism cp, derived from NxD fbac349:
      - trainer/trainer.py initialize_optimizer_from_class shards ZeRO-1 over
        parallel_state.get_zero1_sharding_groups() when cp > 1: groups of dp * cp ranks, ordered
        dp-major (rank (d, c) is member d * cp + c; ascending_ring_PG_group's cp groups merged per dp);
        torch-xla's ZeroRedundancyOptimizer pads dim 0 to a multiple of the group and keeps chunk
        (member index) of it, so every shard has ceil(rows / (dp * cp)) rows;
      - trainer/checkpoint.py save_checkpoint names the file _get_path("optim", dp=True): dp, tp and
        pp ranks only (the cp argument is never passed), so the cp ranks of dp rank d write one name
        and one write lands (`landed`), the other cp ranks' chunks are lost.
    The full moments are reassembled from src's dp shards (rows padded to a multiple of dp, then cut)."""
    shutil.copytree(src, dst)
    optim = os.path.join(src, "optim")
    names = sorted(os.listdir(optim))
    dp = 1 + max(int(re.match(r"dp_rank_(\d+)", n).group(1)) for n in names)
    for n in names:
        d = int(re.match(r"dp_rank_(\d+)", n).group(1))
        shards = [torch.load(os.path.join(optim, re.sub(r"dp_rank_\d+", f"dp_rank_{e:02d}", n))) for e in range(dp)]
        out = torch.load(os.path.join(optim, n))
        group = dp * cp

        def regroup(parts, rows):
            full = torch.cat(parts)[:rows]
            pad = (-rows) % group
            full = torch.cat([full, full.new_zeros((pad,) + tuple(full.shape[1:]))])
            return full.chunk(group)[d * cp + landed].clone()

        for i, entry in out["base_state"].items():
            rows = out["shape_info"][i][0]
            for k in ("exp_avg", "exp_avg_sq"):
                entry[k] = regroup([s["base_state"][i][k] for s in shards], rows)
        for i in out.get("sharded_master_weights", {}):
            out["sharded_master_weights"][i] = regroup([s["sharded_master_weights"][i] for s in shards], out["shape_info"][i][0])
        torch.save(out, os.path.join(dst, "optim", n))
    return dp


class ContextParallelLostShards(TempDirTest):
    def test_verify_fails_and_reshard_refuses_naming_dp_times_cp(self):
        # The real dp-2 tag passes; its cp-2 counterpart does not.
        self.assertEqual(subprocess.run([VERIFY, NXD_PT], capture_output=True).returncode, 0)
        tag = os.path.join(self.dir, "step_4")
        self.assertEqual(cp_lost(NXD_PT, tag), 2)
        first = torch.load(os.path.join(tag, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        rows = first["shape_info"][0][0]
        self.assertEqual(first["base_state"][0]["exp_avg"].shape[0], -(-rows // 4))  # 1/(dp x cp) of the rows
        v = subprocess.run([VERIFY, tag], capture_output=True, text=True)
        self.assertEqual(v.returncode, 1, v.stdout + v.stderr)
        self.assertIn(f"FAILED  {tag}", v.stdout)
        for d in (0, 1):
            self.assertRegex(v.stdout, rf"optim/dp_rank_0{d}_tp_rank_00_pp_rank_00\.pt: parameter id \d+ exp_avg holds \d+ of its \d+ rows")
        self.assertIn("the rows are 1/(dp × cp) = 1/(2 × 2), a context-parallel save (cp=2)", v.stdout)
        # ckpt-reshard refuses it as its verification does; past that (--no_verify), its reader says the
        # same, naming the parameter.
        for extra, where in (([], rf"optim/dp_rank_00_tp_rank_00_pp_rank_00\.pt: parameter id 0 exp_avg holds {-(-rows // 4)} of its {rows} rows"),
                             (["--no_verify"], r"optim/dp_rank_00_tp_rank_00_pp_rank_00\.pt: parameter id 0 \(language_model\.[\w.]+\) "
                                               rf"exp_avg holds {-(-rows // 4)} of its {rows} rows")):
            r = subprocess.run([RESHARD, tag, os.path.join(self.dir, "out"), "--tp", "1", "--pp", "1", "--heads", "4", *extra],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertRegex(r.stderr, where)
            self.assertIn("the rows are 1/(dp × cp) = 1/(2 × 2), a context-parallel save (cp=2)", r.stderr)
            self.assertIn("1 of every 2 shards were lost", r.stderr)
            self.assertFalse(os.path.exists(os.path.join(self.dir, "out")))


if __name__ == "__main__":
    unittest.main()

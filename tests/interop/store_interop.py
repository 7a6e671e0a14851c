"""Checkpoints written by shardkit's store, read the way NxD reads them."""
import fcntl
import glob
import json
import os
import unittest

import torch

from canon import SAMPLE, STRESS, VERIFY, TempDirTest, run


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def nxd_latest_tag(checkpoint_dir):
    """NxD's list_completed_checkpoint_tags()[-1]: folders holding `done`, by the file's mtime."""
    done = sorted(glob.glob(os.path.join(checkpoint_dir, "*", "done")), key=os.path.getmtime)
    if not done:
        raise RuntimeError(f"no checkpoint under {checkpoint_dir}")
    return os.path.dirname(done[-1])


def nxd_load(tag, tp, pp, dp):
    """What NxD's load_checkpoint reads for every (dp, tp, pp) rank."""
    assert not glob.glob(os.path.join(tag, "*", "*.tensors")), "xser tag"
    zero1 = os.path.exists(os.path.join(tag, "optim", "dp_rank_01_tp_rank_00_pp_rank_00.pt"))
    out = {"model": {}, "optim": {}, "zero1": zero1}
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                name = "dp_rank_{:02d}_tp_rank_{:02d}_pp_rank_{:02d}.pt"
                out["model"][(t, p)] = torch.load(os.path.join(tag, "model", name.format(0, t, p)), map_location="cpu")
                od = d if zero1 else 0
                out["optim"][(od, t, p)] = torch.load(os.path.join(tag, "optim", name.format(od, t, p)), map_location="cpu")
    out["scheduler"] = torch.load(os.path.join(tag, "scheduler.pt"))
    out["user_content"] = torch.load(os.path.join(tag, "user_content.pt"))
    return out


class StoreInterop(TempDirTest):
    def test_nxd_rules_find_and_load_the_newest_tag(self):
        run(STRESS, self.dir, "1", "4", "3")  # async, steps 1..4, save_top_k=3, grid tp2 pp2 dp2 zero1
        tags = sorted(os.listdir(self.dir))
        self.assertEqual([t for t in tags if t.endswith(".ckpt")],
                         [f"stress--step={s}-consumed_samples={8 * s}.0.ckpt" for s in (2, 3, 4)])
        tag = nxd_latest_tag(self.dir)
        self.assertTrue(tag.endswith("stress--step=4-consumed_samples=32.0.ckpt"))
        loaded = nxd_load(tag, tp=2, pp=2, dp=2)
        self.assertTrue(loaded["zero1"])
        self.assertEqual(len(loaded["optim"]), 8)
        w = loaded["model"][(1, 1)]["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"]
        self.assertEqual((w.dtype, tuple(w.shape)), (torch.float32, (64 * 1024,)))
        self.assertTrue(torch.all(w.abs() <= 1.0))
        self.assertEqual(loaded["optim"][(1, 0, 1)]["state"][0]["step"], 4)
        self.assertEqual(loaded["user_content"], {"epoch": 0, "global_step": 4, "consumed_samples": 32.0})
        self.assertEqual(loaded["scheduler"], {"last_epoch": 4})
        # The model files are weights-only loadable (torch 1.13's restricted unpickler).
        torch.load(os.path.join(tag, "model", "dp_rank_00_tp_rank_01_pp_rank_01.pt"), weights_only=True)

    def test_torch_loads_every_file_the_store_writes(self):
        run(SAMPLE, self.dir, "--steps", "2")
        files = [f for f in glob.glob(os.path.join(self.dir, "**", "*.pt"), recursive=True)]
        self.assertEqual(len(files), 8)  # 2 tags x (model, optim, scheduler, user_content)
        for f in files:
            torch.load(f)
        with open(os.path.join(nxd_latest_tag(self.dir), "manifest.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["step"], 2)
        self.assertEqual(sorted(manifest["files"]), ["model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
                                                      "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt",
                                                      "scheduler.pt", "user_content.pt"])

    def test_verify_names_a_corrupted_file_and_gc_respects_the_lock(self):
        run(SAMPLE, self.dir, "--steps", "2")
        p = run(VERIFY, self.dir, "--json")
        self.assertTrue(json.loads(p.stdout)["ok"])
        tag2 = os.path.join(self.dir, "sample--step=2-consumed_samples=16.0.ckpt")
        victim = os.path.join(tag2, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt")
        with open(victim, "r+b") as f:
            f.seek(200)
            b = f.read(1)
            f.seek(200)
            f.write(bytes([b[0] ^ 1]))
        p = run(VERIFY, self.dir, "--json", check=False)
        self.assertEqual(p.returncode, 1)
        report = json.loads(p.stdout)
        bad = [t for t in report["tags"] if not t["ok"]]
        self.assertEqual([t["path"] for t in bad], [tag2])
        self.assertEqual(bad[0]["problems"][0]["file"], "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt")
        self.assertRegex(bad[0]["problems"][0]["problem"], r"checksum [0-9a-f]{8} differs")
        # An incomplete tag (save began, never finished) and a stray temporary.
        partial = os.path.join(self.dir, "sample--step=3-consumed_samples=24.0.ckpt")
        os.makedirs(os.path.join(partial, "model"))
        write_text(os.path.join(partial, "checkpoint"), "1")
        write_text(os.path.join(self.dir, "x.pt.tmp-shardkit-123"), "junk")
        with open(os.path.join(self.dir, ".shardkit.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # a running job
            p = run(VERIFY, self.dir, "--gc", check=False)
            self.assertEqual(p.returncode, 1)
            self.assertIn("a running job holds .shardkit.lock", p.stderr)
            self.assertTrue(os.path.exists(partial))
        p = run(VERIFY, self.dir, "--gc", "--dry-run")
        self.assertIn(f"would remove {partial} (incomplete: no done marker)", p.stdout)
        self.assertTrue(os.path.exists(partial))
        run(VERIFY, self.dir, "--gc")
        self.assertFalse(os.path.exists(partial))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "x.pt.tmp-shardkit-123")))
        self.assertTrue(os.path.exists(tag2))  # complete (if corrupt) tags are never collected

    def test_verify_rejects_bad_paths_clearly(self):
        p = run(VERIFY, os.path.join(self.dir, "nope"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("nope: not a directory", p.stderr)
        p = run(VERIFY, self.dir, check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("no checkpoint tags found", p.stderr)


if __name__ == "__main__":
    unittest.main()

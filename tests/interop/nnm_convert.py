"""nnm2nxdt-ckpt against torch: NNM checkpoints made by torch (nnm_fixture.py)
are converted, and every tensor and value of the NxDT output, read back with
torch.load, is compared with an independent Python statement of the mapping:
global layer names from the layer split the fixture chose, optimizer state
tied to parameters by the identity of the tensors torch's AdamW stepped."""
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
import unittest

import torch

from canon import BIN, TOKENIZE, TRAIN, VERIFY, TempDirTest, run
from nnm_fixture import lr_scheduler_state, make_nnm, nxdt_ids
import train_reference

CONVERT = os.path.join(BIN, "convert", "nnm2nxdt-ckpt")
LLAMA = dict(hidden=16, ffn=24, heads=4, kv_heads=4, layers=5, vocab=32, seq=8, gpt=False)


def rank_file(t, p, d=0):
    return f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"


def install_torch_xla_stub(where):
    """torch_xla.utils.serialization.TensorReference, enough for torch.load."""
    pkg = os.path.join(where, "torch_xla", "utils")
    os.makedirs(pkg, exist_ok=True)
    for f in (os.path.join(where, "torch_xla", "__init__.py"), os.path.join(pkg, "__init__.py")):
        open(f, "w").close()
    with open(os.path.join(pkg, "serialization.py"), "w") as f:
        f.write("class TensorReference:\n    pass\n")
    if where not in sys.path:
        sys.path.insert(0, where)


def load(path, xser):
    if not xser:
        return torch.load(path)
    refs = torch.load(path)
    info = torch.load(path + ".info.pt")

    def resolve(x):
        if type(x).__name__ == "TensorReference":
            t = torch.load(os.path.join(path + ".tensors", f"tensor_{x.tid}.pt"))
            assert info[x.tid]["dtype"] == t.dtype and tuple(info[x.tid]["shape"]) == tuple(t.shape), (path, x.tid)
            return t
        if isinstance(x, dict):
            return type(x)((k, resolve(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(resolve(v) for v in x)
        return x

    return resolve(refs)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def no_decay(name):
    module, leaf = name.rsplit(".", 1)
    return leaf == "bias" or module.endswith("norm")


class NnmToNxdt(TempDirTest):
    def setUp(self):
        super().setUp()
        install_torch_xla_stub(os.path.join(self.dir, "stub"))

    def convert(self, *args, check=True):
        return run(CONVERT, *args, check=check)

    def assert_same(self, what, got, want):
        if isinstance(want, torch.Tensor):
            self.assertIsInstance(got, torch.Tensor, what)
            self.assertEqual(got.dtype, want.dtype, what)
            self.assertEqual(got.shape, want.shape, what)
            self.assertTrue(torch.equal(got, want), what)
        elif isinstance(want, dict):
            self.assertEqual(list(got), list(want), what)
            for k in want:
                self.assert_same(f"{what}[{k!r}]", got[k], want[k])
        elif isinstance(want, (list, tuple)):
            self.assertEqual(len(got), len(want), what)
            for i, (g, w) in enumerate(zip(got, want)):
                self.assert_same(f"{what}[{i}]", g, w)
        else:
            self.assertEqual(got, want, what)

    def expected_optimizer(self, entry):
        """The NxDT state dict of one rank, from the NNM one, by parameter."""
        names = [n for n, _ in entry["model"] if not n.endswith("inv_freq")]
        ids = nxdt_ids(names, {n: no_decay(n) for n in names})
        to_nxdt = [ids[n] for n in entry["optim_names"]]
        osd = entry["optimizer"]
        state = {to_nxdt[i]: s for i, s in sorted(osd["state"].items(), key=lambda kv: to_nxdt[kv[0]])}
        groups = [dict(g, params=sorted(to_nxdt[i] for i in g["params"])) for g in osd["param_groups"]]
        return to_nxdt, {"state": state, "param_groups": groups}

    def check_tag(self, tag, expected, step=7, consumed=56.0, xser=False, zero1_dp=0):
        self.assertTrue(os.path.exists(os.path.join(tag, "done")))
        run(VERIFY, tag)
        for (t, p), e in expected.items():
            model = load(os.path.join(tag, "model", rank_file(t, p)), xser)
            self.assert_same(f"model {t},{p}", model, dict(e["model"]))
            if not xser:
                torch.load(os.path.join(tag, "model", rank_file(t, p)), weights_only=True)
            to_nxdt, want = self.expected_optimizer(e)
            if zero1_dp:
                for d in range(zero1_dp):
                    z = load(os.path.join(tag, "optim", rank_file(t, p, d)), xser)
                    src = e["zero1"][d]
                    self.assertEqual(sorted(z), sorted(src))
                    self.assert_same("base_state", z["base_state"], {to_nxdt[i]: s for i, s in sorted(src["base_state"].items(), key=lambda kv: to_nxdt[kv[0]])})
                    self.assert_same("shape_info", z["shape_info"], {to_nxdt[i]: s for i, s in sorted(src["shape_info"].items(), key=lambda kv: to_nxdt[kv[0]])})
                    self.assert_same("param_groups", z["param_groups"], want["param_groups"])
            else:
                self.assert_same(f"optim {t},{p}", load(os.path.join(tag, "optim", rank_file(t, p)), xser), want)
        uc = torch.load(os.path.join(tag, "user_content.pt"))
        self.assertEqual((uc["global_step"], uc["consumed_samples"], uc["epoch"]), (step, consumed, 0))
        self.assertEqual(torch.load(os.path.join(tag, "scheduler.pt")), lr_scheduler_state(step, 1e-3, 2, 0, 100, 1e-4))
        manifest = read_json(os.path.join(tag, "manifest.json"))
        self.assertEqual(manifest["step"], step)

    def roundtrip(self, c, tp, pp, *flags, xser_in=False, xser_out=False, zero1_dp=0, vpp=1):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        expected, _ = make_nnm(nnm, c, tp=tp, pp=pp, vpp=vpp, zero1_dp=zero1_dp, xser=xser_in)
        self.convert("--tp", tp, "--pp", pp, "--n_layers", c["layers"], "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out,
                     *(["--save_xser"] if xser_out else []), *flags)
        self.check_tag(out, expected, xser=xser_out, zero1_dp=zero1_dp)
        return out

    def test_tp2_pp2_with_an_uneven_layer_split(self):
        self.roundtrip(LLAMA, 2, 2)  # 5 layers: 2 + 3

    def test_pp1_mp_rank_folders_with_gqa(self):
        self.roundtrip(dict(LLAMA, kv_heads=2, layers=3), 2, 1)

    def test_single_file_xser_in_and_out(self):
        self.roundtrip(dict(LLAMA, layers=2), 1, 1, xser_in=True, xser_out=True)

    def test_zero1_dp2_shards_keep_their_padding(self):
        # 18 / tp 2 = 9 embedding rows: padded to 10 and split over dp 2.
        self.roundtrip(dict(LLAMA, hidden=12, heads=4, kv_heads=4, vocab=18, layers=4), 2, 2, zero1_dp=2)

    def test_zero1_xser_input(self):
        self.roundtrip(dict(LLAMA, layers=2), 1, 2, xser_in=True, zero1_dp=2)

    def test_gpt_style_with_biases_tied_embeddings_and_virtual_pipeline(self):
        self.roundtrip(dict(LLAMA, gpt=True, layers=8), 1, 2, vpp=2)

    def test_checkpoint_dir_names_the_tag_and_picks_the_newest_file(self):
        nnm, ckdir = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "ckpts")
        make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=1, step=3, last=False)
        expected, _ = make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=1, step=7, seed=1)
        p = self.convert("--nnm_ckpt_path", nnm, "--checkpoint_dir", ckdir)
        self.assertIn("megatron_llama--step=7-consumed_samples=56.0-last.ckpt", p.stderr)
        tag = os.path.join(ckdir, "megatron_llama--step=7-consumed_samples=56.0-last.ckpt")
        self.check_tag(tag, expected)
        self.assertEqual(sorted(os.listdir(ckdir)), [os.path.basename(tag)])  # no staging debris

    def test_end_to_end_training_core_resumes_with_the_nnm_step_loss_and_lr(self):
        self.end_to_end(gpt=False)

    def test_end_to_end_gpt_style_resumes_too(self):
        self.end_to_end(gpt=True)

    def end_to_end(self, gpt):
        """A megatron Llama (or GPT) trained 3 steps in torch and saved as NNM;
        converted; shardkit-train resumes from it. Its first step's loss and
        learning rate, and the weights after that step, equal torch continuing
        the same run."""
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, "/usr/share/common-licenses/GPL-3", os.path.join(self.dir, "data", "text_document"))
        c = dict(hidden=64, ffn=172, heads=4, kv_heads=4, layers=2, vocab=264, seq=64, gpt=gpt)
        cfg = dict(c, rotary_dim=0, layernorm=True, gelu=True, tied=True) if gpt else dict(c, rotary_dim=16)
        base_lr, warmup, min_lr, max_steps, S, gbs, wd = 3e-3, 10, 3e-4, 60, 3, 8, 0.01

        def samples(start, count):
            out = run(TOKENIZE, "--samples", os.path.join(self.dir, "data", "text_document"), 64, 1234, start, count).stdout
            return torch.tensor([[int(x) for x in line.split()] for line in out.strip().split("\n")])

        def train_step(chunk, params, batch):
            named = {k: v for k, v in chunk.state_dict(keep_vars=True).items() if not k.endswith("inv_freq")}
            logits = train_reference.forward(named, cfg, batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c["vocab"]), batch[:, 1:].reshape(-1))
            for q in params:
                q.grad = None
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            return loss.item()

        lr_at = lambda s: train_reference.nemo_cosine(s, base_lr, warmup, 0, max_steps, min_lr)
        nnm = os.path.join(self.dir, "nnm")
        expected, _ = make_nnm(nnm, c, steps=S, step=S, gbs=gbs, lr=base_lr, weight_decay=wd, lr_at=lr_at,
                               sched=lr_scheduler_state(S, base_lr, warmup, 0, max_steps, min_lr),
                               grads=lambda chunks, params, s: train_step(chunks[0], params, samples(s * gbs, gbs)))
        obj = torch.load(glob.glob(os.path.join(nnm, "*.ckpt"))[0])

        run_dir = os.path.join(self.dir, "run")
        self.convert("--tp", 1, "--pp", 1, "--n_layers", 2, "--nnm_ckpt_path", nnm, "--checkpoint_dir", os.path.join(run_dir, "checkpoints"))
        conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf",
                            "tiny_gpt.yaml" if gpt else "tiny_llama.yaml")
        # tiny_gpt trains in mixed precision with dropout; this NNM run was fp32 without.
        gpt_overrides = ["precision.type=fp32", "model.ffn_hidden_size=172", "model.hidden_dropout=0.0",
                         "model.attention_dropout=0.0", "model.ffn_dropout=0.0"] if gpt else []
        p = subprocess.run([TRAIN, conf, f"exp_manager.explicit_log_dir={run_dir}", f"trainer.max_steps={S + 1}",
                            f"+model.optim.sched.max_steps={max_steps}", "exp_manager.async_checkpointing=False",
                            *gpt_overrides], cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"at step {S}, {S * gbs} samples consumed", p.stderr)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(l) for l in f]
        self.assertEqual([m["step"] for m in metrics], [S + 1])

        # torch continues the same run for one step.
        sched = obj["lr_schedulers"][0]
        lr = train_reference.nemo_cosine(sched["last_epoch"], sched["base_lrs"][0], sched["warmup_steps"],
                                         sched["constant_steps"], sched["max_steps"], sched["min_lr"])
        opt, chunk = expected[(0, 0)]["opt"], expected[(0, 0)]["chunks"][0]
        params = [q for g in opt.param_groups for q in g["params"]]
        loss = train_step(chunk, params, samples(S * gbs, gbs))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        self.assertAlmostEqual(metrics[0]["lr"], lr, delta=1e-12 * lr)
        self.assertLessEqual(abs(metrics[0]["loss"] - loss), 1e-4 * abs(loss), (metrics[0]["loss"], loss))
        tag = glob.glob(os.path.join(run_dir, "checkpoints", f"*step={S + 1}-*"))[0]
        ours = torch.load(os.path.join(tag, "model", rank_file(0, 0)))
        for k, v in chunk.state_dict().items():
            if k.endswith("inv_freq"):
                continue
            err, scale = (ours[k] - v).abs().max().item(), v.abs().max().item()
            self.assertLessEqual(err, 1e-4 * scale, f"{k}: {err} vs {scale}")

    def big_checkpoint(self):
        nnm = os.path.join(self.dir, "nnm")
        c = dict(hidden=256, ffn=688, heads=4, kv_heads=4, layers=4, vocab=8192, seq=8, gpt=False)
        expected, _ = make_nnm(nnm, c, tp=2, pp=2, steps=1)
        return nnm, expected

    def test_sigkill_never_leaves_done_on_a_partial_output(self):
        nnm, expected = self.big_checkpoint()
        out = os.path.join(self.dir, "out.ckpt")
        args = [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--overwrite"]
        t0 = time.time()
        run(*args)
        full = time.time() - t0
        self.check_tag(out, expected)
        rng = random.Random(7)
        for trial in range(16):
            p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0, full))
            p.send_signal(signal.SIGKILL)
            p.wait()
            # Whatever has `done` is whole: the target (old or new) and any staging folder.
            for tag in glob.glob(os.path.join(self.dir, "*.ckpt")) + glob.glob(os.path.join(self.dir, ".*")):
                if os.path.exists(os.path.join(tag, "done")):
                    run(VERIFY, tag)
            self.assertFalse(os.path.exists(out) and not os.path.exists(os.path.join(out, "done")), f"trial {trial}")
            # The earlier complete output is never lost: it is in place or set aside to be restored.
            self.assertTrue(os.path.exists(os.path.join(out, "done")) or
                            os.path.exists(os.path.join(self.dir, ".out.ckpt.nnm2nxdt-old", "done")), f"trial {trial}")
        run(*args)
        self.check_tag(out, expected)
        self.assertEqual(sorted(os.listdir(self.dir)), sorted(["nnm", "out.ckpt", "stub"]))

    def test_bad_inputs_get_clear_errors_and_no_complete_looking_output(self):
        nnm, out = os.path.join(self.dir, "nnm"), os.path.join(self.dir, "out.ckpt")
        make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=2)
        victim = glob.glob(os.path.join(nnm, "tp_rank_01_pp_rank_001", "*.ckpt"))[0]
        good = read_bytes(victim)

        def fails(*extra, code=1):
            p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, *extra, check=False)
            self.assertEqual(p.returncode, code, p.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "done")))
            return p.stderr

        self.assertIn("--tp 4 --pp 2 was given", fails("--tp", 4, "--pp", 2))
        self.assertIn("--n_layers is 3 but the checkpoint holds 2 layers", fails("--n_layers", 3))
        self.assertIn("not a boolean", fails("--enable_parallel_processing", "maybe", code=2))
        with open(victim, "wb") as f:  # truncated
            f.write(good[: len(good) // 2])
        self.assertIn(victim, fails())
        with open(victim, "wb") as f:  # one flipped byte inside a tensor record
            bad = bytearray(good)
            bad[len(good) // 2] ^= 0xFF
            f.write(bad)
        err = fails()
        self.assertIn(victim, err)
        self.assertIn("CRC-32", err)
        with open(victim, "wb") as f:
            f.write(good)
        os.rename(os.path.join(nnm, "tp_rank_01_pp_rank_000"), os.path.join(self.dir, "moved"))
        self.assertIn("tp_rank_01_pp_rank_000", fails())
        os.rename(os.path.join(self.dir, "moved"), os.path.join(nnm, "tp_rank_01_pp_rank_000"))
        # --dry_run plans and writes nothing.
        p = self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--dry_run")
        self.assertIn("rename (pp 1) model.language_model.encoder.layers.0.mlp.dense_h_to_4h.weight -> "
                      "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight", p.stderr)
        self.assertFalse(os.path.exists(out))
        # A non-empty target is kept unless --overwrite.
        os.makedirs(out)
        with open(os.path.join(out, "mine.txt"), "w") as f:
            f.write("keep")
        self.assertIn("--overwrite", fails("--enable_parallel_processing", "False"))
        self.assertEqual(os.listdir(out), ["mine.txt"])
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--overwrite", "--enable_parallel_processing", "no")
        self.assertFalse(os.path.exists(os.path.join(out, "mine.txt")))
        run(VERIFY, out)

    def test_mpirun_ranks_split_the_files_and_write_what_one_process_writes(self):
        nnm = os.path.join(self.dir, "nnm")
        expected, _ = make_nnm(nnm, dict(LLAMA, layers=4), tp=2, pp=2)
        one, two = os.path.join(self.dir, "one.ckpt"), os.path.join(self.dir, "two.ckpt")
        self.convert("--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", one)
        p = run("mpirun", "--allow-run-as-root", "--oversubscribe", "-np", 2, CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", two)
        self.assertIn("rank 1: converted", p.stderr)
        self.check_tag(two, expected)
        m1, m2 = (read_json(os.path.join(d, "manifest.json")) for d in (one, two))
        self.assertEqual(m1["files"], m2["files"])  # same bytes: sizes and CRC-32s
        self.assertEqual(m2["world_size"], 2)


if __name__ == "__main__":
    unittest.main()

"""The permanent bad-input suite: mistaken and hostile inputs for every
command. Each case asserts that the command
  - exits 1 or 2 (never 0 with output that looks complete, never a signal),
  - names the offending path or key in its message,
  - leaves nothing complete-looking under an output's final name,
  - leaves every file that existed before byte-identical,
  - stays within bounded memory (RLIMIT_AS, as `ulimit -v`) and time.
A few cases (ckpt-verify --gc on folders that are not ours) expect exit 0
and assert what was kept. Run directly, it prints the table of cases per
command and how many behaved well."""
import collections
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import unittest

import torch

from canon import BIN, CONFIG, INSPECT, TOKENIZE, TRAIN, VERIFY, TempDirTest, run
from nnm_fixture import make_hf_converted, make_nnm

CONVERT = os.path.join(BIN, "convert", "nnm2nxdt-ckpt")
CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
TEXT = "/usr/share/common-licenses/GPL-3"
MEMORY = 4 << 30  # bytes of address space per command: ulimit -v
SECONDS = 60
LLAMA = dict(hidden=16, ffn=24, heads=4, kv_heads=4, layers=4, vocab=32, seq=8, gpt=False)
RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"

TALLY = collections.OrderedDict()  # command -> [cases, behaved well]


def limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def read(path):
    with open(path, "rb") as f:
        return f.read()


def snapshot(root):
    files = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                files[p] = f.read()
    return files


class BadInput(TempDirTest):
    def expect(self, command, argv, names, codes=(1, 2), absent=(), cwd=None, changes_allowed=()):
        """Runs one case; `absent`: outputs that must not exist afterwards;
        `changes_allowed`: files the command may rewrite (logs)."""
        TALLY.setdefault(command, [0, 0])[0] += 1
        before = snapshot(self.dir)
        t0 = time.time()
        p = subprocess.run([str(a) for a in argv], cwd=cwd or self.dir, capture_output=True, text=True, timeout=SECONDS,
                           preexec_fn=limited, stdin=subprocess.DEVNULL)
        took = time.time() - t0
        out = p.stderr + p.stdout
        what = f"{command} {' '.join(str(a) for a in argv[1:])}"
        self.assertIn(p.returncode, codes, f"{what}: exit {p.returncode}\n{out}")
        for n in names:
            self.assertIn(str(n), out, f"{what}: message does not name {n}")
        for a in absent:
            self.assertFalse(os.path.exists(a), f"{what}: left {a}")
        after = snapshot(self.dir)
        for path, data in before.items():
            if path in changes_allowed:
                continue
            self.assertIn(path, after, f"{what}: deleted {path}")
            self.assertEqual(after[path], data, f"{what}: changed {path}")
        self.assertLess(took, SECONDS)
        TALLY[command][1] += 1
        return out

    def nnm(self, **kw):
        root = os.path.join(self.dir, "nnm")
        make_nnm(root, LLAMA, tp=2, pp=2, **kw)
        return root

    # -- nnm2nxdt-ckpt ---------------------------------------------------
    def test_nnm2nxdt_ckpt(self):
        nnm = self.nnm()
        out = os.path.join(self.dir, "out.ckpt")
        c = "nnm2nxdt-ckpt"
        for target in (nnm, os.path.join(nnm, "tp_rank_00_pp_rank_000", "x.ckpt"), self.dir):
            self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", target, "--overwrite"], ["--nnm_ckpt_path", target])
        os.makedirs(os.path.join(self.dir, "mine"))
        with open(os.path.join(self.dir, "mine", "notes.txt"), "w") as f:
            f.write("mine")
        self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", os.path.join(self.dir, "mine"), "--overwrite"],
                    ["notes.txt", "not a checkpoint tag"])
        os.symlink(os.path.join(self.dir, "mine"), os.path.join(self.dir, "link.ckpt"))
        self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", os.path.join(self.dir, "link.ckpt")], ["symbolic link"])
        self.expect(c, [CONVERT, "--tp", 0, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], ["--tp", "1 to 1048576"], absent=[out])
        self.expect(c, [CONVERT, "--tp", "two", "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], ["--tp"], absent=[out])
        self.expect(c, [CONVERT, "--nnm_ckpt_path", os.path.join(self.dir, "none"), "--nxdt_ckpt_path", out], ["none"], absent=[out])
        # A partial checkpoint (rank folders gone) is not converted as a smaller model.
        for gone, msg in ((["tp_rank_01_pp_rank_000", "tp_rank_01_pp_rank_001"], "tp=1 pp=2"),
                          (["tp_rank_00_pp_rank_001", "tp_rank_01_pp_rank_001"], "tp=2 pp=1"),
                          (["tp_rank_01_pp_rank_001"], "tp_rank_01_pp_rank_001")):
            for g in gone:
                shutil.move(os.path.join(nnm, g), os.path.join(self.dir, g))
            self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], [msg], absent=[out])
            for g in gone:
                shutil.move(os.path.join(self.dir, g), os.path.join(nnm, g))
        victim = glob.glob(os.path.join(nnm, "tp_rank_01_pp_rank_001", "*.ckpt"))[0]
        good = read(victim)
        # Shapes that do not fit: one tp shard's tensor of another shape.
        ck = torch.load(victim)
        key = "model.language_model.encoder.layers.0.self_attention.dense.weight"
        ck["state_dict"][key] = torch.zeros(3, 3)
        torch.save(ck, victim)
        self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], [victim, key, "[3, 3]"], absent=[out])
        for bad, msg in ((good[: len(good) // 2], victim), (b"garbage" * 100, victim),
                         (bytes(b ^ 0xFF if i == good.find(b"data.pkl") + 200 else b for i, b in enumerate(good)), victim)):
            with open(victim, "wb") as f:
                f.write(bad)
            self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], [msg], absent=[out])
        with open(victim, "wb") as f:
            f.write(good)
        # ZeRO-1 file as a bare dict; weights-only input with --require_optimizer.
        shutil.rmtree(nnm)
        make_nnm(nnm, dict(LLAMA, layers=2), tp=1, pp=2, zero1_dp=2)
        z = glob.glob(os.path.join(nnm, "tp_rank_00_pp_rank_001", "optim", "dp_rank_001", "*.ckpt"))[0]
        torch.save(torch.load(z)[0], z)
        self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], [z, "optimizer_states' list"], absent=[out])
        shutil.rmtree(nnm)
        make_hf_converted(nnm, LLAMA, tp=2, pp=2)
        self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--require_optimizer"],
                    ["no optimizer state", "tp_rank_00_pp_rank_000"], codes=(2,), absent=[out])
        # xser: a tensor file whose shape is not its reference's declared shape.
        shutil.rmtree(nnm)
        make_nnm(nnm, dict(LLAMA, layers=2), xser=True)
        tensor = sorted(glob.glob(os.path.join(nnm, "*.ckpt.tensors", "tensor_*.pt")))[0]
        torch.save(torch.zeros(2, 2, 2), tensor)
        self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], [tensor, "declares"], absent=[out])

    # -- nnm2nxdt-config and --check ------------------------------------
    def test_nnm2nxdt_config(self):
        c = "nnm2nxdt-config"
        src = os.path.join(self.dir, "nnm.yaml")
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "configs", "megatron_llama_config.yaml"), src)
        ok = "model.data.data_prefix=[1.0,/data/x]"
        out, rep = os.path.join(self.dir, "out.yaml"), os.path.join(self.dir, "rep.json")
        self.expect(c, [CONFIG, src, "-o", src, ok], ["-o", src, "is the input"])
        self.expect(c, [CONFIG, src, "-o", out, "--report", out, ok], ["--report", "-o"], absent=[out])
        self.expect(c, [CONFIG, src, "-o", out, "--report", os.path.join(self.dir, "missing", "r.json"), ok],
                    ["missing", "does not exist"], absent=[out])
        os.symlink(src, os.path.join(self.dir, "alias.yaml"))  # a link to the input is the input
        self.expect(c, [CONFIG, src, "-o", os.path.join(self.dir, "alias.yaml"), ok], ["alias.yaml", "is the input"])
        with open(os.path.join(self.dir, "other.yaml"), "w") as f:
            f.write("mine: 1\n")
        os.symlink(os.path.join(self.dir, "other.yaml"), os.path.join(self.dir, "link.yaml"))
        self.expect(c, [CONFIG, src, "-o", os.path.join(self.dir, "link.yaml"), ok], ["symbolic link"])
        self.expect(c, [CONFIG, src, "-o", "/dev/null", ok], ["/dev/null", "not a regular file"])
        self.expect(c, [CONFIG, src, "-o", out, "--report", rep], ["data.data_prefix", "does not pass --check"], absent=[out, rep])
        hostile = {
            "self.yaml": ("model: &a {x: *a}\n", "an alias refers to a node that contains it"),
            "laughs.yaml": ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' +
                            "".join(f"{c}: &{c} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefghijk", "bcdefghijkl")),
                            "alias bomb"),
            "deep.yaml": ("model: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 64 levels"),
            "dup.yaml": ("model:\n  num_layers: 2\n  num_layers: 4\n", "duplicate key 'model.num_layers'"),
            "cycle.yaml": ("model:\n  a: ${model.b}\n  b: ${model.a}\n", "model.a"),
            "binary.yaml": ("\x00\x01\x02\xff", "binary.yaml"),
        }
        for name, (text, msg) in hostile.items():
            path = os.path.join(self.dir, name)
            with open(path, "w") as f:
                f.write(text)
            self.expect(c, [CONFIG, path, "-o", out], [name, msg], absent=[out])
            self.expect(c + " --check", [CONFIG, "--check", path], [name])
            self.expect("shardkit-train", [TRAIN, path], [name])
        self.expect(c, [CONFIG, src, "model.x=[1,", "-o", out], ["override 'model.x=[1,'"], absent=[out])
        # --check on values that make no model.
        good = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
        text = read(good).decode()
        for old, new, msg in (("num_layers: 2", "num_layers: 0", "model.num_layers: 0 must be at least 1"),
                              ("hidden_size: 64", "hidden_size: 66", "model.hidden_size (66) is not divisible"),
                              ("global_batch_size: 8", "global_batch_size: 0", "data.global_batch_size: 0 must be at least 1"),
                              ("micro_batch_size: 4", "micro_batch_size: 0", "data.micro_batch_size: 0 must be at least 1"),
                              ("lr: 3e-3", "lr: -3e-3", "model.optim.lr"),
                              ("num_kv_heads: 4", "num_kv_heads: 3", "model.num_kv_heads (3) does not divide"),
                              ("devices: 1", "devices: 0", "trainer.devices: 0 must be at least 1"),  # once a division by zero
                              ("devices: 1", "devices: 99999999999999", "trainer.devices"),
                              ("encoder_seq_length: 64", "encoder_seq_length: ${model.max_position_embeddings}", "interpolation cycle")):
            path = os.path.join(self.dir, f"bad_{len(os.listdir(self.dir))}_" + new.split(":")[0] + ".yaml")
            self.assertIn(old, text)
            with open(path, "w") as f:
                f.write(text.replace(old, new))
            self.expect(c + " --check", [CONFIG, "--check", path], [msg], codes=(1,))

    # -- shardkit-train ---------------------------------------------------
    def test_shardkit_train(self):
        c = "shardkit-train"
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))
        base = [TRAIN, CONF, "exp_manager.explicit_log_dir=run", "exp_manager.async_checkpointing=False"]
        for override, msg in (("model.optim.lr=-0.1", "model.optim.lr"), ("model.optim.weight_decay=-1", "model.optim.weight_decay"),
                              ("model.num_layers=99999999999999999999", "model.num_layers"),
                              ("model.num_layers=0", "model.num_layers"), ("data.data_prefix=[x,data/text_document]", "data.data_prefix"),
                              ("model.optim.betas=[0.9,{a: 1}]", "model.optim.betas"), ("trainer.max_steps=-3", "trainer.max_steps"),
                              ("model.optim.sched.min_lr=1.0", "model.optim.sched.min_lr")):
            self.expect(c, base + [override], [msg], absent=[os.path.join(self.dir, "run", "checkpoints")])
        # Damaged checkpoints: never trained on, never deleted.
        subprocess.run(base + ["trainer.max_steps=20", "exp_manager.checkpoint_callback_params.every_n_train_steps=10"],
                       cwd=self.dir, check=True, capture_output=True)
        tags = sorted(glob.glob(os.path.join(self.dir, "run", "checkpoints", "*.ckpt")))
        self.assertEqual(len(tags), 2)
        for t in tags:
            path = os.path.join(t, "model", RANK_FILE)
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                f.write(b"\xAA" * 4096)
        metrics = os.path.join(self.dir, "run", "metrics.jsonl")
        named = [os.path.relpath(t, self.dir) for t in tags]  # the run directory is given relative
        self.expect(c, base + ["trainer.max_steps=30"], named + ["resume_past_damaged_checkpoints"], codes=(2,), changes_allowed=[metrics])
        self.expect(c, base + ["trainer.max_steps=30", f"exp_manager.resume_from_checkpoint={tags[0]}"],
                    [tags[0], "not a complete, intact checkpoint"], changes_allowed=[metrics])

    # -- shardkit-tokenize ------------------------------------------------
    def test_shardkit_tokenize(self):
        c = "shardkit-tokenize"
        text = os.path.join(self.dir, "corpus.bin")
        shutil.copy(TEXT, text)
        self.expect(c, [TOKENIZE, text, os.path.join(self.dir, "corpus")], ["corpus.bin", "is the input"])
        idx = os.path.join(self.dir, "c.idx")
        shutil.copy(TEXT, idx)
        self.expect(c, [TOKENIZE, idx, os.path.join(self.dir, "c")], ["c.idx", "is the input"], absent=[os.path.join(self.dir, "c.bin")])
        self.expect(c, [TOKENIZE, TEXT, os.path.join(self.dir, "missing", "p")], ["does not exist"])
        prefix = os.path.join(self.dir, "p")
        run(TOKENIZE, TEXT, prefix)
        for args, msg in ((["--samples", prefix, 0, 1, 0, 1], "SEQ_LENGTH"), (["--samples", prefix, "abc", 1, 0, 1], "SEQ_LENGTH"),
                          (["--samples", prefix, 64, 1, 0, 10**15], "COUNT"), (["--samples", prefix, 64, 1, -1, 1], "START"),
                          (["--samples", prefix, 64, "x", 0, 1], "SEED"), (["--samples", prefix, 10**12, 1, 0, 1], "SEQ_LENGTH"),
                          (["--dump", prefix, 0, 10**15], "COUNT"), (["--dump", prefix, "1e3", 5], "START"),
                          (["--samples", prefix, 64, 1, 0], "--samples takes")):
            self.expect(c, [TOKENIZE] + args, [msg])

    # -- ckpt-verify and ckpt-inspect -------------------------------------
    def sample_tag(self):
        d = os.path.join(self.dir, "ckpts")
        run(os.path.join(BIN, "tools", "ckpt-sample"), d)
        return d, glob.glob(os.path.join(d, "*.ckpt"))[0]

    def test_ckpt_verify(self):
        c = "ckpt-verify"
        d, tag = self.sample_tag()
        manifest = os.path.join(tag, "manifest.json")
        good = json.loads(read(manifest))
        for mutate, msg in ((lambda m: m["grid"].update(tp=100000000), "'tp' is 100000000"), (lambda m: m["grid"].update(tp=0), "'tp' is 0"),
                            (lambda m: next(iter(m["files"].values())).update(size=-5), "'size' is -5"),
                            (lambda m: m["grid"].update(tp=64), "needs 64 model files"),
                            (lambda m: m.update(files=[1, 2]), "'files' is not an object"),
                            (lambda m: m.update(world_size=2**40), "world_size"), (lambda m: m.update(step="x"), "'step'")):
            m = json.loads(json.dumps(good))
            mutate(m)
            with open(manifest, "w") as f:
                json.dump(m, f)
            self.expect(c, [VERIFY, tag], ["manifest.json", msg], codes=(1,))
        with open(manifest, "w") as f:
            f.write("{not json")
        self.expect(c, [VERIFY, tag], ["manifest.json", "not valid JSON"], codes=(1,))
        with open(manifest, "w") as f:
            json.dump(good, f)
        # A tolerance that is no tolerance.
        self.expect(c + " --rtol", [VERIFY, tag, "--against", tag, "--rtol", "2"], ["--rtol: Value 2 not in range"], codes=(2,))
        self.expect(c + " --atol", [VERIFY, tag, "--against", tag, "--atol", "-1"], ["--atol"], codes=(2,))
        # An NxD-style tag whose rank file name claims an absurd grid.
        nxd = os.path.join(self.dir, "nxd", "step_5")
        os.makedirs(os.path.join(nxd, "model"))
        open(os.path.join(nxd, "checkpoint"), "w").close()
        open(os.path.join(nxd, "done"), "w").close()
        torch.save({"w": torch.ones(1)}, os.path.join(nxd, "model", "dp_rank_00_tp_rank_99999_pp_rank_99999.pt"))
        self.expect(c, [VERIFY, nxd], ["far more ranks"], codes=(1,))
        torch.save({"w": torch.ones(1)}, os.path.join(nxd, "model", "dp_rank_00_tp_rank_99999999999_pp_rank_00.pt"))
        self.expect(c, [VERIFY, nxd], ["far more ranks"], codes=(1,))
        # --gc collects only what is ours: a *.ckpt folder of the user's files stays.
        foreign = os.path.join(d, "notes.ckpt")
        os.makedirs(foreign)
        with open(os.path.join(foreign, "readme.txt"), "w") as f:
            f.write("mine")
        empty = os.path.join(d, "empty.ckpt")
        os.makedirs(empty)
        self.expect(c + " --gc", [VERIFY, d, "--gc"], ["left alone", "notes.ckpt", "readme.txt"], codes=(0,))
        self.assertTrue(os.path.exists(empty))

    def test_ckpt_inspect(self):
        c = "ckpt-inspect"
        _, tag = self.sample_tag()
        f = os.path.join(self.dir, "x.pt")
        torch.save({"a": torch.arange(10.0), "b": [1, 2, 3]}, f)
        good = read(f)
        at = good.find(b"data.pkl") + 60  # inside the pickle record
        with open(f, "wb") as out:
            out.write(good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1:])
        self.expect(c, [INSPECT, f], [f, "data.pkl"])
        with open(f, "wb") as out:
            out.write(good[: len(good) // 3])
        self.expect(c, [INSPECT, f], [f])
        optim = glob.glob(os.path.join(tag, "optim", "*.pt"))[0]
        os.remove(optim)
        self.expect(c, [INSPECT, tag], [os.path.relpath(optim, tag), "missing"])
        self.expect(c, [INSPECT, os.path.join(self.dir, "none")], ["none"])


@classmethod
def _print_tally(cls):
    if TALLY:
        width = max(len(k) for k in TALLY)
        lines = [f"{'command':<{width}}  cases  behaved well"]
        lines += [f"{k:<{width}}  {v[0]:>5}  {v[1]:>12}" for k, v in TALLY.items()]
        lines.append(f"{'total':<{width}}  {sum(v[0] for v in TALLY.values()):>5}  {sum(v[1] for v in TALLY.values()):>12}")
        print("\n" + "\n".join(lines), file=sys.stderr)


BadInput.tearDownClass = _print_tally

if __name__ == "__main__":
    unittest.main()

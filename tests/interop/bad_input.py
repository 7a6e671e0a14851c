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
import tempfile
import time
import unittest

import torch

from canon import BIN, CONFIG, CONVERT, EXPORT, IMPORT, INSPECT, RESHARD, TOKENIZE, TRAIN, TempDirTest, VERIFY, run
from nnm_fixture import make_hf_converted, make_nnm
from upstream_tags import NXD_PT, NXD_XSER, TensorReference

HF_LLAMA = dict(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=32)
CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
TEXT = "/usr/share/common-licenses/GPL-3"
MEMORY = 4 << 30  # bytes of address space per command: ulimit -v
SECONDS = 60
LLAMA = dict(hidden=16, ffn=24, heads=4, kv_heads=4, layers=4, vocab=32, seq=8, gpt=False)
RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"

TALLY = collections.OrderedDict()  # command -> [cases, behaved well]


def good_groups(h5):
    """The names under /optim of an export (parameter names)."""
    import h5py
    with h5py.File(h5, "r") as f:
        return list(f["optim"].keys())


def hf_tensors(cfg, seed=0):
    """A LlamaForCausalLM state dict of `cfg`'s sizes, float32."""
    g = torch.Generator().manual_seed(seed)
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = H // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    sd = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (kv, H),
                   p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, H), p + "post_attention_layernorm.weight": (H,),
                   p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F)})
    sd.update({"model.norm.weight": (H,), "lm_head.weight": (V, H)})
    return {k: torch.randn(shape, generator=g) for k, shape in sd.items()}


def write_safetensors(path, tensors, header_edit=None):
    """safetensors by hand (8-byte little-endian header length, JSON header, data)."""
    header, blobs, at = {}, [], 0
    for k, t in tensors.items():
        b = t.contiguous().numpy().tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    if header_edit:
        header_edit(header)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def make_hf(root, shards=1):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(dict(HF_LLAMA, architectures=["LlamaForCausalLM"]), f)
    sd = hf_tensors(HF_LLAMA)
    if shards == 1:
        write_safetensors(os.path.join(root, "model.safetensors"), sd)
        return root
    names = list(sd)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(os.path.join(root, fname), {n: sd[n] for n in part})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return root


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
    def expect(self, command, argv, names, codes=(1, 2), absent=(), cwd=None, changes_allowed=(), memory=MEMORY):
        """Runs one case; `absent`: outputs that must not exist afterwards;
        `changes_allowed`: files the command may rewrite (logs); `memory`: the
        address-space limit (None: only for a case that maps a huge sparse input)."""
        TALLY.setdefault(command, [0, 0])[0] += 1
        before = snapshot(self.dir)
        t0 = time.time()
        p = subprocess.run([str(a) for a in argv], cwd=cwd or self.dir, capture_output=True, text=True, timeout=SECONDS,
                           preexec_fn=limited if memory == MEMORY else None, stdin=subprocess.DEVNULL)
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
        # Other degrees in one pass: what the target cannot take is refused before anything is written.
        for extra, msg in ((["--tp", 1, "--pp", 2, "--pipeline_cuts", 9], "pipeline cuts must be ascending"),
                           (["--tp", 3], "--tp 3"), (["--tp", 1, "--memory_budget", "1K"], "--memory_budget"),
                           (["--tp", 1, "--memory_budget", "lots"], "'lots' is not a size"),
                           (["--tp", 1, "--pp", 2, "--pipeline_cuts", "1,x"], "--pipeline_cuts")):
            # (This fixture trained each rank apart, so its norm replicas differ: trusted, to reach each check.)
            self.expect(c, [CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--trust_first_replica", *extra], [msg], absent=[out])
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
        # An output that would not pass --check (12 heads over tp 5) is not written; NNM's ??? data_prefix is not a problem.
        self.expect(c, [CONFIG, src, "-o", out, "--report", rep, "model.tensor_model_parallel_size=5"],
                    ["not divisible by tensor_model_parallel_size (5)", "does not pass --check"], absent=[out, rep])
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

    def trained_tag(self, steps=10, every=10):
        os.makedirs(os.path.join(self.dir, "data"), exist_ok=True)
        run(TOKENIZE, TEXT, os.path.join(self.dir, "data", "text_document"))
        subprocess.run([TRAIN, CONF, "exp_manager.explicit_log_dir=run", "exp_manager.async_checkpointing=False", f"trainer.max_steps={steps}",
                        f"exp_manager.checkpoint_callback_params.every_n_train_steps={every}",
                        "exp_manager.checkpoint_callback_params.save_top_k=-1"],
                       cwd=self.dir, check=True, capture_output=True)
        return sorted(glob.glob(os.path.join(self.dir, "run", "checkpoints", "*.ckpt")))

    def test_resume_trusts_only_a_tag_that_verifies(self):
        """The newest tag loses its manifest and 256 bytes of a model file (same size): resume
        must not train on it, and retention must not delete the good tags before it."""
        c = "shardkit-train resume"
        tags = self.trained_tag(steps=30)
        self.assertEqual(len(tags), 3)
        newest = [t for t in tags if "step=30" in t][0]
        os.remove(os.path.join(newest, "manifest.json"))
        path = os.path.join(newest, "model", RANK_FILE)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(bytes(range(256)))
        self.assertEqual(os.path.getsize(path), size)
        base = [TRAIN, CONF, "exp_manager.explicit_log_dir=run", "exp_manager.async_checkpointing=False",
                "exp_manager.checkpoint_callback_params.every_n_train_steps=10", "exp_manager.checkpoint_callback_params.save_top_k=2"]
        TALLY.setdefault(c, [0, 0])[0] += 1
        p = subprocess.run(base + ["trainer.max_steps=40"], cwd=self.dir, capture_output=True, text=True, timeout=SECONDS,
                           preexec_fn=limited, stdin=subprocess.DEVNULL)
        out = p.stdout + p.stderr
        self.assertEqual(p.returncode, 0, out)
        self.assertIn("skipping " + os.path.basename(newest), out)
        self.assertIn("resumed from " + os.path.relpath(tags[1], self.dir), out)
        # The damaged tag is kept as evidence (set aside, never deleted), and every tag that is
        # there afterwards verifies.
        aside = glob.glob(newest + ".damaged*")
        self.assertEqual(len(aside), 1, os.listdir(os.path.dirname(newest)))
        self.assertEqual(read(os.path.join(aside[0], "model", RANK_FILE))[size // 2:size // 2 + 256], bytes(range(256)))
        TALLY[c][1] += 1

        # Without a manifest but intact, a tag is resumed, checked by what its files say of
        # themselves; the newest tag that verifies against its manifest outlives save_top_k.
        c = "shardkit-train retention"
        TALLY.setdefault(c, [0, 0])[0] += 1
        tags = sorted(t for t in glob.glob(os.path.join(self.dir, "run", "checkpoints", "*.ckpt")))
        at40 = [t for t in tags if "step=40" in t][0]
        os.remove(os.path.join(at40, "manifest.json"))
        p = subprocess.run(base + ["trainer.max_steps=60"], cwd=self.dir, capture_output=True, text=True, timeout=SECONDS,
                           preexec_fn=limited, stdin=subprocess.DEVNULL)
        out = p.stdout + p.stderr
        self.assertEqual(p.returncode, 0, out)
        self.assertIn("checked without one", out)
        self.assertIn("resumed from " + os.path.relpath(at40, self.dir), out)
        left = sorted(os.path.basename(t) for t in glob.glob(os.path.join(self.dir, "run", "checkpoints", "*.ckpt")))
        # save_top_k=2 counts 60 and 50; 40 (no manifest) is neither counted nor deleted, and 30,
        # the newest tag verified against its manifest before it, stays.
        self.assertEqual([t.split("--")[1].split("-")[0] for t in left], ["step=30", "step=40", "step=50", "step=60"], left)
        self.assertIn("kept", out)
        TALLY[c][1] += 1

    def test_resume_falls_back_past_a_truncated_tag(self):
        """A truncated model file whose manifest entry was rewritten to match: the tag does not load,
        so resume takes the older one instead of stopping."""
        tags = self.trained_tag(steps=20)
        newest = tags[-1]
        path = os.path.join(newest, "model", RANK_FILE)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        manifest = os.path.join(newest, "manifest.json")
        m = json.loads(read(manifest))
        import zlib
        data = read(path)
        m["files"]["model/" + RANK_FILE] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        with open(manifest, "w") as f:
            json.dump(m, f)
        c = "shardkit-train truncated"
        TALLY.setdefault(c, [0, 0])[0] += 1
        p = subprocess.run([TRAIN, CONF, "exp_manager.explicit_log_dir=run", "exp_manager.async_checkpointing=False", "trainer.max_steps=25"],
                           cwd=self.dir, capture_output=True, text=True, timeout=SECONDS, preexec_fn=limited, stdin=subprocess.DEVNULL)
        out = p.stdout + p.stderr
        self.assertEqual(p.returncode, 0, out)
        self.assertIn("unreadable", out)
        self.assertIn("resumed from " + os.path.relpath(tags[0], self.dir), out)
        TALLY[c][1] += 1

    # -- ckpt-import (HDF5) -----------------------------------------------
    def test_ckpt_import_h5(self):
        import h5py
        import numpy as np
        import pickle
        c = "ckpt-import"
        tag = self.trained_tag()[0]
        good = os.path.join(self.dir, "good.h5")
        run(EXPORT, tag, good)
        out = os.path.join(self.dir, "out.ckpt")
        pwned = os.path.join(self.dir, "PWNED")

        def case(name, mutate, msg):
            h5 = os.path.join(self.dir, name + ".h5")
            shutil.copy(good, h5)
            with h5py.File(h5, "r+") as f:
                mutate(f)
            self.expect(c, [IMPORT, h5, out, "--tp", 1, "--pp", 1], [h5] + msg, codes=(2,), absent=[out])
            self.assertFalse(os.path.exists(pwned))

        class Evil:
            def __reduce__(self):
                return (os.system, ("touch " + pwned,))

        def set_attr(f, key, value):
            del f.attrs[key]
            f.attrs[key] = value

        groups = pickle.dumps([{"params": [0], "lr": 0.1, "hook": Evil()}], protocol=2)
        case("pickle", lambda f: set_attr(f, "param_groups", np.frombuffer(groups, dtype=np.uint8)), ["param_groups", "system", "not checkpoint data"])
        call = {"t": "object", "module": "posix", "name": "system", "how": "reduce",
                "args": {"t": "tuple", "items": [{"t": "str", "v": "touch " + pwned}]}, "state": None, "list_items": [], "dict_items": []}
        for attr in ("user_content.pt", "scheduler.pt"):
            case("json_call_" + attr[:4], lambda f: set_attr(f, attr, json.dumps({"t": "dict", "items": [[{"t": "str", "v": "x"}, call]]})),
                 [attr, "posix.system", "not checkpoint data"])
        case("global", lambda f: set_attr(f, "user_content.pt", json.dumps({"t": "global", "module": "os", "name": "system"})),
             ["os.system"])
        case("deep", lambda f: set_attr(f, "user_content.pt", "[" * 20000 + "]" * 20000), ["user_content.pt", "nested deeper"])
        case("source_layout", lambda f: set_attr(f, "source_layout", "[1, 2]"), ["source_layout", "is array where an object"])

        def model_attr(**kw):
            def mutate(f):
                m = json.loads(f.attrs["model"])
                m.update(kw)
                set_attr(f, "model", json.dumps(m))
            return mutate

        case("vocab", model_attr(vocab_size=2 ** 34), ["vocabulary", str(2 ** 34)])
        case("layers", model_attr(num_layers=2 ** 20), ["layer count"])
        first = [k for k in good_groups(good)][0]
        case("step", lambda f: set_attr(f["optim"][first], "step", json.dumps({"t": "str", "v": "seven"})), ["step", "not AdamW's step"])
        case("step_nan", lambda f: set_attr(f["optim"][first], "step", json.dumps({"t": "float", "bits": "7ff8000000000000"})), ["step"])

        # Nothing outside the file: external links, external raw storage, virtual datasets.
        other = os.path.join(self.dir, "other.h5")
        with h5py.File(other, "w") as f:
            f["data"] = np.zeros(4, dtype=np.float32)
        case("elink", lambda f: f.__setitem__("/model/sneaky", h5py.ExternalLink(other, "/data")), ["external link"])

        def replace_dataset(f, how):
            path = "/model/" + first
            src = f[path]
            data, attrs = src[()], dict(src.attrs)
            del f[path]
            if how == "external":
                raw = os.path.join(self.dir, "raw.bin")
                data.tofile(raw)
                ds = f.create_dataset(path, shape=data.shape, dtype=data.dtype, external=[(raw, 0, data.nbytes)])
            else:
                layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
                with h5py.File(other, "a") as o:
                    if "v" in o:
                        del o["v"]
                    o["v"] = data
                layout[...] = h5py.VirtualSource(other, "v", shape=data.shape)
                ds = f.create_virtual_dataset(path, layout)
            for k, v in attrs.items():
                ds.attrs[k] = v

        case("external", lambda f: replace_dataset(f, "external"), ["external files"])
        case("virtual", lambda f: replace_dataset(f, "virtual"), ["virtual dataset"])
        # A FIFO where the file is expected: refused at once, not waited on.
        fifo = os.path.join(self.dir, "fifo.h5")
        os.mkfifo(fifo)
        self.expect(c, [IMPORT, fifo, out, "--tp", 1, "--pp", 1], [fifo, "not a regular file"], codes=(2,), absent=[out])

    # -- ckpt-import --format hf ------------------------------------------
    def test_ckpt_import_hf(self):
        c = "ckpt-import --format hf"
        out = os.path.join(self.dir, "out.ckpt")

        def imp(src, msg, codes=(2,)):
            self.expect(c, [IMPORT, "--format", "hf", src, out, "--tp", 1, "--pp", 1], msg, codes=codes, absent=[out])

        # An in-folder link the index names, pointing outside: refused, the outside file never opened.
        hf = make_hf(os.path.join(self.dir, "hf_link"), shards=2)
        shard = os.path.join(hf, "model-00002-of-00002.safetensors")
        outside = os.path.join(self.dir, "elsewhere", "w.safetensors")
        os.makedirs(os.path.dirname(outside))
        shutil.move(shard, outside)
        os.symlink(outside, shard)
        imp(hf, [shard, "outside"])
        hf = make_hf(os.path.join(self.dir, "hf_config_link"))
        shutil.move(os.path.join(hf, "config.json"), os.path.join(self.dir, "elsewhere", "config.json"))
        os.symlink(os.path.join(self.dir, "elsewhere", "config.json"), os.path.join(hf, "config.json"))
        imp(hf, ["config.json", "outside"])
        # A Hugging Face cache snapshot links into its blobs/: that stays allowed.
        cache = os.path.join(self.dir, "models--x--tiny")
        snap = make_hf(os.path.join(cache, "snapshots", "abc"))
        os.makedirs(os.path.join(cache, "blobs"))
        for name in ("config.json", "model.safetensors"):
            shutil.move(os.path.join(snap, name), os.path.join(cache, "blobs", name + ".blob"))
            os.symlink(os.path.join("..", "..", "blobs", name + ".blob"), os.path.join(snap, name))
        self.expect(c + " (cache)", [IMPORT, "--format", "hf", snap, out, "--tp", 1, "--pp", 1], [], codes=(0,))
        shutil.rmtree(out)
        # weight_map is followed: a stray shard holding every name (zeros) is refused, not imported.
        hf = make_hf(os.path.join(self.dir, "hf_stray"), shards=2)
        write_safetensors(os.path.join(hf, "model-00002-of-00002.safetensors"), {k: torch.zeros_like(v) for k, v in hf_tensors(HF_LLAMA).items()})
        imp(hf, ["in both", "refusing to pick one"])
        hf = make_hf(os.path.join(self.dir, "hf_moved"), shards=2)
        idx = os.path.join(hf, "model.safetensors.index.json")
        m = json.loads(read(idx))
        k = sorted(m["weight_map"])[0]
        m["weight_map"][k] = "model-00002-of-00002.safetensors" if m["weight_map"][k].startswith("model-00001") else "model-00001-of-00002.safetensors"
        with open(idx, "w") as f:
            json.dump(m, f)
        imp(hf, [k, "places"])
        # Safetensors headers that lie.
        root = make_hf(os.path.join(self.dir, "hf_st"))
        st = os.path.join(root, "model.safetensors")
        sd = hf_tensors(HF_LLAMA)
        q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
        for edit, msg in ((lambda h: h[o].update(data_offsets=h[q]["data_offsets"]), "overlap"),
                          (lambda h: h[q].update(shape=[2 ** 40, 2 ** 40]), q),
                          (lambda h: h[q].update(shape=[2 ** 62, 4]), q),
                          (lambda h: h[q].update(data_offsets=[0, 2 ** 63]), q),
                          (lambda h: h[q].update(dtype="I64"), "dtype")):
            write_safetensors(st, sd, edit)
            imp(root, [st, msg])
        with open(st, "wb") as f:
            f.write((2 ** 60).to_bytes(8, "little") + b"{}")
        imp(root, [st, "header length"])
        write_safetensors(st, sd)
        # config.json with sizes past any model, or nested without end.
        cfg = os.path.join(root, "config.json")
        good_cfg = read(cfg)
        for key, value, msg in (("num_hidden_layers", 2 ** 40, "layer count"), ("vocab_size", 2 ** 34, "vocabulary"),
                                ("hidden_size", 2 ** 62, "hidden_size")):
            with open(cfg, "w") as f:
                json.dump(dict(json.loads(good_cfg), **{key: value}), f)
            imp(root, [cfg, msg])
        with open(cfg, "w") as f:
            f.write('{"a": ' + "[" * 20000 + "]" * 20000 + "}")
        imp(root, [cfg, "nested deeper"])
        with open(cfg, "wb") as f:
            f.write(good_cfg)
        # A model within the size bounds whose output (2 TiB of embeddings) exceeds the free space:
        # refused before anything is written. The input is a sparse file outside the snapshot folder.
        with tempfile.TemporaryDirectory() as big:
            cfg_big = dict(HF_LLAMA, hidden_size=1 << 14, intermediate_size=1 << 14, num_attention_heads=128, num_key_value_heads=128,
                           num_hidden_layers=1, vocab_size=1 << 24, architectures=["LlamaForCausalLM"])
            with open(os.path.join(big, "config.json"), "w") as f:
                json.dump(cfg_big, f)
            H, V = cfg_big["hidden_size"], cfg_big["vocab_size"]
            shapes = {"model.embed_tokens.weight": [V, H], "model.layers.0.input_layernorm.weight": [H],
                      "model.layers.0.post_attention_layernorm.weight": [H], "model.norm.weight": [H], "lm_head.weight": [V, H]}
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                      "mlp.down_proj"):
                shapes[f"model.layers.0.{n}.weight"] = [H, H]
            header, at = {}, 0
            for k, shape in shapes.items():
                n = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
                header[k] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
                at += n
            text = json.dumps(header).encode()
            big_st = os.path.join(big, "model.safetensors")
            with open(big_st, "wb") as f:
                f.write(len(text).to_bytes(8, "little") + text)
                f.truncate(8 + len(text) + at)
            self.assertGreater(at, 2 * shutil.disk_usage(self.dir).free)
            self.expect(c, [IMPORT, "--format", "hf", big, out, "--tp", 1, "--pp", 1], ["the output needs", "free; nothing was written"],
                        codes=(2,), absent=[out], memory=None)
        # A FIFO where a weights file is expected.
        os.remove(st)
        os.mkfifo(st)
        imp(root, [st, "not a regular file"])

    # -- ckpt-reshard, ckpt-export, ckpt-verify --against ---------------------
    def test_ckpt_reshard_export_verify(self):
        hf = make_hf(os.path.join(self.dir, "hf"))
        tag = os.path.join(self.dir, "tags", "a.ckpt")
        run(IMPORT, "--format", "hf", hf, tag, "--tp", 2, "--pp", 1)
        out = os.path.join(self.dir, "out.ckpt")
        c = "ckpt-reshard"
        self.expect(c, [RESHARD, tag, out, "--tp", 1, "--pp", 1, "--dp", 1000000, "--zero1"], ["rank files"], codes=(2,), absent=[out])
        # A rank file linked out of the tag is not read through the link.
        victim = os.path.join(tag, "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt")
        moved = os.path.join(self.dir, "elsewhere.pt")
        shutil.copy(victim, moved)
        original = read(victim)
        os.remove(victim)
        os.symlink(moved, victim)
        self.expect(c, [RESHARD, tag, out, "--tp", 1, "--pp", 1], ["dp_rank_00_tp_rank_01_pp_rank_00.pt", "outside"], codes=(2,), absent=[out])
        self.expect("ckpt-export", [EXPORT, tag, os.path.join(self.dir, "x.h5")], ["outside"], codes=(2,),
                    absent=[os.path.join(self.dir, "x.h5")])
        os.remove(victim)
        with open(victim, "wb") as f:
            f.write(original)
        # A FIFO for a rank file.
        os.rename(victim, moved)
        os.mkfifo(victim)
        self.expect(c, [RESHARD, tag, out, "--tp", 1, "--pp", 1], ["dp_rank_00_tp_rank_01_pp_rank_00.pt", "not a regular file"], codes=(2,),
                    absent=[out])
        self.expect(c + " --no_verify", [RESHARD, tag, out, "--tp", 1, "--pp", 1, "--no_verify"], ["not a regular file"], codes=(2,),
                    absent=[out])
        os.remove(victim)
        os.rename(moved, victim)
        # ckpt-verify --against computes: rank files swapped and their checksums rewritten do not pass as "same".
        other = os.path.join(self.dir, "tags", "b.ckpt")
        shutil.copytree(tag, other)
        a0, a1 = (os.path.join(other, "model", f"dp_rank_00_tp_rank_0{r}_pp_rank_00.pt") for r in (0, 1))
        os.rename(a0, a0 + ".x")
        os.rename(a1, a0)
        os.rename(a0 + ".x", a1)
        manifest = os.path.join(other, "manifest.json")
        m = json.loads(read(manifest))
        import zlib
        for p in (a0, a1):
            data = read(p)
            m["files"][os.path.relpath(p, other)] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        with open(manifest, "w") as f:
            json.dump(m, f)
        got = self.expect("ckpt-verify --against", [VERIFY, tag, "--against", other], ["self_attention.query.weight", "records another fingerprint"], codes=(1,))
        self.assertNotIn("same state", got)
        # ckpt-export --format hf checks the recorded fingerprints too.
        self.expect("ckpt-export --format hf", [EXPORT, other, os.path.join(self.dir, "hfout"), "--format", "hf"], ["fingerprint"], codes=(2,),
                    absent=[os.path.join(self.dir, "hfout")])
        self.expect("ckpt-verify --rtol", [VERIFY, tag, "--against", tag, "--rtol", "nan"], ["--rtol"], codes=(2,))

    # -- xser tags (NxD's own, tests/data/upstream/nxd_tags) ------------------
    def test_xser_tags(self):
        tag = os.path.join(self.dir, "step_4")
        model = os.path.join(tag, "model")
        x01 = os.path.join(model, "dp_rank_00_tp_rank_01_pp_rank_00.pt")  # its tids 0..14 (README table)
        out = os.path.join(self.dir, "out")
        hostile = os.path.join(self.dir, "pwned")

        class Hostile:
            def __reduce__(self):
                return (os.system, (f"touch {hostile}",))

        def case(what, mutate, names, verify_names=None):
            if os.path.exists(tag):
                shutil.rmtree(tag)
            shutil.copytree(NXD_XSER, tag)
            mutate()
            for c, argv in (("ckpt-reshard", [RESHARD, tag, out, "--tp", 1, "--pp", 1, "--heads", 4]),
                            ("ckpt-reshard --no_verify", [RESHARD, tag, out, "--tp", 1, "--pp", 1, "--heads", 4, "--no_verify"]),
                            ("ckpt-export", [EXPORT, tag, out + ".h5", "--heads", 4, "--no_verify"])):
                self.expect(f"{c} ({what})", argv, names, codes=(2,), absent=[out, out + ".h5"])
            self.expect(f"ckpt-verify ({what})", [VERIFY, tag], verify_names or names, codes=(1,))
            self.assertFalse(os.path.exists(hostile))

        def edit_info(edit):
            info = torch.load(x01 + ".info.pt")
            edit(info)
            torch.save(info, x01 + ".info.pt")

        def edit_refs(edit):
            tree = torch.load(x01)
            edit(tree)
            torch.save(tree, x01)

        case("missing tensor file", lambda: os.remove(os.path.join(x01 + ".tensors", "tensor_5.pt")), ["tensor_5.pt", "missing"])
        case("info.pt shape", lambda: edit_info(lambda i: i[3].update(shape=torch.Size([99]))), ["tensor_3.pt", "declares tid 3", "[99]"])
        case("info.pt dtype", lambda: edit_info(lambda i: i[2].update(dtype=torch.float32)), ["tensor_2.pt", "declares tid 2 float32"])
        case("tid out of range", lambda: edit_info(lambda i: i.pop(7)), ["tid 7 is out of range", "info.pt"])
        first = "language_model.embedding.word_embeddings.weight"
        case("tid referenced twice", lambda: edit_refs(lambda t: t.update({first: TensorReference(1)})), ["tid 1 is referenced twice"])
        case("negative tid", lambda: edit_refs(lambda t: t.update({first: TensorReference(-3)})), ["negative tid -3"])
        case("tensor folder without X.pt", lambda: os.remove(x01), ["dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors", "an xser tensor folder with no"])

        def mix():
            shutil.rmtree(x01 + ".tensors")
            os.remove(x01 + ".info.pt")
            shutil.copy(os.path.join(NXD_PT, "model", os.path.basename(x01)), x01)
        case("plain and xser mixed", mix, ["dp_rank_00_tp_rank_01_pp_rank_00.pt", "is plain .pt but", "one container or the other"])
        case("hostile info.pt", lambda: torch.save({0: Hostile()}, x01 + ".info.pt"), ["info.pt", "system"])
        ep = os.path.join(model, "dp_rank_00_ep_rank_00_tp_rank_01_pp_rank_00.pt")
        case("expert-parallel file", lambda: (os.rename(x01, ep), os.rename(x01 + ".tensors", ep + ".tensors")),
             ["dp_rank_00_ep_rank_00_tp_rank_01_pp_rank_00.pt", "expert-parallel"])

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
        run(os.path.join(BIN, "bin", "ckpt-sample"), d)
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

"""shardkit against tags NxD's and NxDT's own save code wrote
(tests/data/upstream/nxd_tags: NxD fbac349, NxDT 9169aa0, run on CPU; see its
README). These files are the ground truth CI carries: nothing here is written
from belief about the layout.

  - an xser tag and the same tag in plain .pt read alike (byte-identical
    reshards, ckpt-verify --against);
  - what ckpt-reshard --save_xser writes is NxD's xser, file for file: the
    same files, the same reference trees (tids in NxD's traversal order), the
    same info.pt and the same tensors as NxD's own save of that state;
  - resharded values equal the upstream shards, assembled here with torch;
  - NxDT's one-shard ZeRO-1 optimizer (dp=2 saved as dp_rank_00 only) is
    refused with what happened, and --weights_only takes the model;
  - model files in any key order, model-only folders (NxD's converter
    output) and NxDT's tag-level content carried through unchanged.

The dev-time counterpart, NxD's own load_checkpoint reading what shardkit
writes, is tests/data/upstream/nxd_tags/load_check.py (needs upstream source)."""
import filecmp
import os
import pickle
import shutil
import subprocess
import sys
import types
import unittest

import torch

from canon import BIN, EXPORT, RESHARD, TRAIN, TempDirTest, VERIFY, run
from indexed_dataset_interop import megatron_write
from megatron_partition import nxdt_order

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_tags")
NXD_XSER = os.path.join(DATA, "nxd_xser", "step_4")
NXD_PT = os.path.join(DATA, "nxd_pt", "step_4")
NXDT_TAG = "megatron_llama--step=4-consumed_samples=32.0.ckpt"
NXDT_XSER = os.path.join(DATA, "nxdt_xser", NXDT_TAG)
NXDT_PT = os.path.join(DATA, "nxdt_pt", NXDT_TAG)
HEADS = ["--heads", "4"]  # NxD writes no model format; the fixture's model has 4 heads (README)
L = "language_model."
LAYER = L + "encoder.layers.{}."


class TensorReference:
    """torch_xla.utils.serialization.TensorReference as pickled: NEWOBJ, then BUILD {'tid': n}."""

    def __init__(self, tid=None):
        if tid is not None:
            self.tid = tid


TensorReference.__module__ = "torch_xla.utils.serialization"  # so that it pickles as torch_xla's


def _install_xla_stub():
    # Only to unpickle X.pt here; shardkit itself never runs Python.
    for name in ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["torch_xla.utils.serialization"].TensorReference = TensorReference


_install_xla_stub()


def load(path):
    return torch.load(path, map_location="cpu")


def refs(tree):
    """The tree with each TensorReference as ('tid', n) and containers as plain Python."""
    if isinstance(tree, TensorReference):
        return ("tid", tree.tid)
    if isinstance(tree, dict):
        return [(k, refs(v)) for k, v in tree.items()]  # order matters: tids follow it
    if isinstance(tree, (list, tuple)):
        return [refs(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return ("tensor", str(tree.dtype), list(tree.shape), tree.flatten().tolist())
    return tree


def files(root, skip=("manifest.json", "checkpoint", "done")):
    out = set()
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".shardkit"]
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel not in skip:
                out.add(rel)
    return out


def same_files(test, a, b, skip=()):
    fa, fb = files(a) - set(skip), files(b) - set(skip)
    test.assertEqual(fa, fb)
    for rel in sorted(fa):
        test.assertTrue(filecmp.cmp(os.path.join(a, rel), os.path.join(b, rel), shallow=False), rel)


MEGATRON_GROUPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxdt_megatron",
                               "megatron_groups.json")


class MegatronGrouping(unittest.TestCase):
    def test_python_statement_of_the_grouping_is_what_nemo_built(self):
        """megatron_partition.nxdt_order, which the other tests use, against NeMo v2.1.0's functions as
        run over NxDT's own GPT and Llama (tests/data/upstream/nxdt_megatron)."""
        import json
        with open(MEGATRON_GROUPS) as f:
            models = json.load(f)["models"]
        for model in ("gpt", "llama"):
            entries = [e for e in models[model]["model"]["state_dict"] if e["kind"] == "parameter"]
            every = [e["key"] for e in entries]
            once = []
            for e in entries:
                if not set(e["same_object_as"]) & set(once):
                    once.append(e["key"])
            for flag in (False, True):
                groups = models[model]["groups"][f"do_layer_norm_weight_decay={str(flag).lower()}"]["groups"]
                want = [(holders, gi) for gi, g in enumerate(groups) for holders in g["params"]]
                got = nxdt_order(once if flag else every, flag)
                self.assertEqual(len(got), len(want), (model, flag))
                for i, ((name, gi), (holders, wgi)) in enumerate(zip(got, want)):
                    self.assertIn(name, holders, (model, flag, i))
                    self.assertEqual(gi, wgi, (model, flag, i, name))
                # NeMo's no-decay group is the one with weight_decay 0.0.
                self.assertEqual([g["options"].get("weight_decay") for g in groups], [None, 0.0] if len(groups) == 2 else [None])


class UpstreamTags(TempDirTest):
    def out(self, name):
        return os.path.join(self.dir, name)

    def test_xser_and_plain_tags_read_alike(self):
        # The same training state, saved by NxD both ways, reshards to the same bytes.
        a, b = self.out("from_xser"), self.out("from_pt")
        for src, dst in ((NXD_XSER, a), (NXD_PT, b)):
            p = run(RESHARD, src, dst, "--tp", 1, "--pp", 1, "--dp", 1, "--zero1", *HEADS, "--no_save_xser")
            self.assertIn("model format (no manifest records it)", p.stderr)
        # Each user content is its own run's (its cli_args name the container); each is carried as it was.
        same_files(self, a, b, skip=["user_content.pt"])
        for src, dst in ((NXD_XSER, a), (NXD_PT, b)):
            self.assertEqual(refs(load(os.path.join(dst, "user_content.pt"))), refs(load(os.path.join(src, "user_content.pt"))))
        self.assertTrue(os.path.isfile(os.path.join(a, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt")))
        p = run(VERIFY, NXD_XSER, "--against", NXD_PT, *HEADS)
        self.assertIn("same", p.stdout)
        # Default container: the source's.
        c = self.out("default")
        run(RESHARD, NXD_XSER, c, "--tp", 1, "--pp", 1, *HEADS)
        self.assertTrue(os.path.isdir(os.path.join(c, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors")))

    def test_save_xser_writes_what_nxd_writes(self):
        # NxD's plain tag, written back at its own layout as xser, is NxD's xser tag of that state.
        ours = self.out("ours")
        run(RESHARD, NXD_PT, ours, "--tp", 2, "--pp", 2, *HEADS, "--save_xser")
        theirs = NXD_XSER
        self.assertEqual(files(ours), files(theirs))
        xfiles = sorted(f for f in files(theirs) if f.endswith(".pt") and ".pt.tensors/" not in f and f.startswith(("model/", "optim/"))
                        and not f.endswith(".info.pt"))
        self.assertEqual(len(xfiles), 4 + 8)  # model per tp/pp rank, optim per dp/tp/pp rank
        for rel in xfiles:
            self.assertEqual(refs(load(os.path.join(ours, rel))), refs(load(os.path.join(theirs, rel))), rel)
            a, b = load(os.path.join(ours, rel + ".info.pt")), load(os.path.join(theirs, rel + ".info.pt"))
            self.assertEqual(list(a.keys()), list(b.keys()), rel)
            for tid in b:
                self.assertEqual(a[tid], b[tid], f"{rel} info tid {tid}")
                self.assertIsInstance(a[tid]["shape"], torch.Size)
        for rel in sorted(f for f in files(theirs) if ".pt.tensors/" in f):
            x, y = load(os.path.join(ours, rel)), load(os.path.join(theirs, rel))
            self.assertEqual((x.dtype, x.shape), (y.dtype, y.shape), rel)
            self.assertTrue(torch.equal(x, y), rel)

    def test_resharded_values_are_the_upstream_shards(self):
        out = self.out("tp1")
        run(RESHARD, NXD_XSER, out, "--tp", 1, "--pp", 1, *HEADS, "--no_save_xser")
        model = load(os.path.join(out, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        shard = {(t, p): load(os.path.join(NXD_PT, "model", f"dp_rank_00_tp_rank_0{t}_pp_rank_0{p}.pt")) for t in (0, 1) for p in (0, 1)}
        emb = L + "embedding.word_embeddings.weight"
        self.assertTrue(torch.equal(model[emb], torch.cat([shard[0, 0][emb], shard[1, 0][emb]])))
        out_w = L + "output_layer.weight"
        self.assertTrue(torch.equal(model[out_w], torch.cat([shard[0, 1][out_w], shard[1, 1][out_w]])))
        for layer, stage in ((0, 0), (3, 1)):
            pre = LAYER.format(layer)
            dense = pre + "self_attention.dense.weight"
            self.assertTrue(torch.equal(model[dense], torch.cat([shard[0, stage][dense], shard[1, stage][dense]], dim=1)))
            fc1 = pre + "mlp.dense_h_to_4h.weight"  # rank r holds [gate_r; up_r] (NxDT's swiglu)
            gate = torch.cat([shard[t, stage][fc1].chunk(2)[0] for t in (0, 1)])
            up = torch.cat([shard[t, stage][fc1].chunk(2)[1] for t in (0, 1)])
            self.assertTrue(torch.equal(model[fc1], torch.cat([gate, up])))
            norm = pre + "input_layernorm.weight"
            self.assertTrue(torch.equal(model[norm], shard[0, stage][norm]))
        self.assertEqual(model[emb].dtype, torch.bfloat16)
        # The ZeRO-1 masters: dp shards of each tp-local tensor, concatenated and then across tp.
        opt = load(os.path.join(out, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        src = [load(os.path.join(NXD_PT, "optim", f"dp_rank_0{d}_tp_rank_00_pp_rank_00.pt")) for d in (0, 1)]
        # id 0 is the embedding in both (NxD's example grouping), at tp 1 only tp rank 0's half is this source's rows 0..31.
        local = torch.cat([src[d]["sharded_master_weights"][0] for d in (0, 1)])
        self.assertTrue(torch.equal(opt["sharded_master_weights"][0][: local.shape[0]], local))

    def test_nxdt_one_shard_zero1_is_detected(self):
        for tag in (NXDT_XSER, NXDT_PT):
            p = run(VERIFY, tag, check=False)
            self.assertEqual(p.returncode, 1, p.stdout)
            self.assertIn("damaged by design", p.stdout)
            self.assertIn("dp=2 ZeRO-1 optimizer as one shard", p.stdout)
            out = self.out("x")
            p = run(RESHARD, tag, out, "--tp", 1, "--pp", 1, *HEADS, check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("moments were never written", p.stderr)
            self.assertFalse(os.path.exists(out))
            p = run(RESHARD, tag, out, "--tp", 1, "--pp", 1, *HEADS, "--no_verify", check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("--weights_only", p.stderr)
            self.assertFalse(os.path.exists(out))
        a, b = self.out("w_xser"), self.out("w_pt")
        run(RESHARD, NXDT_XSER, a, "--tp", 1, "--pp", 1, *HEADS, "--weights_only", "--no_save_xser")
        run(RESHARD, NXDT_PT, b, "--tp", 1, "--pp", 1, *HEADS, "--weights_only")
        same_files(self, a, b)
        self.assertFalse(os.path.exists(os.path.join(a, "optim")))
        self.assertFalse(os.path.exists(os.path.join(a, "scheduler.pt")))  # NxDT writes none
        self.assertEqual(run(VERIFY, a).returncode, 0)
        # NxDT's user content (the Lightning dict minus model and optimizer) is carried through as it was.
        self.assertEqual(refs(load(os.path.join(a, "user_content.pt"))), refs(load(os.path.join(NXDT_XSER, "user_content.pt"))))
        self.assertEqual(run(EXPORT, NXDT_XSER, self.out("w.h5"), *HEADS, "--weights_only").returncode, 0)

    def test_nxdt_tags_describe_their_model(self):
        # NxDT records the job's config in user_content.pt (hyper_parameters.cfg): no --heads needed.
        out = self.out("no_hints")
        p = run(RESHARD, NXDT_XSER, out, "--tp", 1, "--pp", 1, "--weights_only")
        self.assertIn("num_attention_heads 4 from the job config", p.stderr)
        p = run(RESHARD, NXDT_XSER, self.out("bad"), "--tp", 1, "--pp", 1, "--weights_only", "--heads", 2, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--heads 2 contradicts", p.stderr)
        self.assertIn("hyper_parameters.cfg.num_attention_heads) is 4", p.stderr)
        self.assertFalse(os.path.exists(self.out("bad")))
        # NxD's own trainer records no config: the hint is still asked for.
        p = run(RESHARD, NXD_XSER, self.out("nxd"), "--tp", 1, "--pp", 1, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("give --heads", p.stderr)

    def test_model_files_in_any_key_order(self):
        # HF -> NNM tools write keys in HF order; NxD loads by name, and so does shardkit.
        shuffled = self.out("shuffled")
        shutil.copytree(NXD_PT, shuffled)
        for name in os.listdir(os.path.join(shuffled, "model")):
            path = os.path.join(shuffled, "model", name)
            sd = load(path)
            torch.save(dict(reversed(list(sd.items()))), path)
        a, b = self.out("a"), self.out("b")
        run(RESHARD, NXD_PT, a, "--tp", 1, "--pp", 2, *HEADS)
        run(RESHARD, shuffled, b, "--tp", 1, "--pp", 2, *HEADS, "--no_verify")  # no manifest to check; NxD wrote none
        # The optimizer's ids follow module order, not the files' key order: the same bytes.
        same_files(self, a, b, skip=[f"model/dp_rank_00_tp_rank_00_pp_rank_0{p}.pt" for p in (0, 1)])
        for p in (0, 1):
            rel = f"model/dp_rank_00_tp_rank_00_pp_rank_0{p}.pt"
            x, y = load(os.path.join(a, rel)), load(os.path.join(b, rel))
            self.assertEqual(sorted(x), sorted(y))
            for k in x:
                self.assertTrue(torch.equal(x[k], y[k]), k)
            # Parameters are written in module order whatever order they were read in; only the
            # inv_freq buffers keep their place beside the key they followed.
            params = lambda d: [k for k in d if not k.endswith("inv_freq")]
            self.assertEqual(params(x), params(y))

    def test_model_only_folder(self):
        # NxD's checkpoint_converter.py writes model/ alone: no marker, optim/ or user content.
        conv = self.out("converted")
        shutil.copytree(os.path.join(NXD_XSER, "model"), os.path.join(conv, "model"))
        p = run(VERIFY, conv)
        self.assertIn("weights only", p.stdout)
        out = self.out("re")
        p = run(RESHARD, conv, out, "--tp", 1, "--pp", 1, *HEADS)
        self.assertIn("weights-only tag", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "optim")))
        ref = self.out("ref")
        run(RESHARD, NXD_XSER, ref, "--tp", 1, "--pp", 1, *HEADS, "--weights_only")
        self.assertEqual(files(out), files(ref) - {"scheduler.pt", "user_content.pt"})
        for rel in files(out):
            self.assertTrue(filecmp.cmp(os.path.join(out, rel), os.path.join(ref, rel), shallow=False), rel)
        # Without `done`, a folder that is more than model/ stays incomplete.
        with open(os.path.join(conv, "checkpoint"), "w") as f:
            f.write("1")
        p = run(RESHARD, conv, self.out("re2"), "--tp", 1, "--pp", 1, *HEADS, check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("done", p.stderr)

    def test_trainer_resumes_nxdts_tag_as_nxdt_would(self):
        # The NxDT tag at tp2 pp2 (one-shard ZeRO-1 optimizer) resumed by a one-process run: resharded
        # for it (resume_reshard), the model only (NxDT's model.weight_init_only), the step from
        # Lightning's loops, consumed samples from the tag's name and the LR schedule from lr_schedulers.
        import numpy as np
        os.makedirs(os.path.join(self.dir, "data"))
        rng = np.random.default_rng(0)
        megatron_write(os.path.join(self.dir, "data", "tok"), [rng.integers(0, 64, 300) for _ in range(20)], np.uint16)
        conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
        # The fixture's model and schedule (tests/data/upstream/nxd_tags/README.md, its user content's lr_schedulers).
        model = ["model.num_layers=4", "model.hidden_size=16", "model.ffn_hidden_size=32", "model.num_attention_heads=4",
                 "model.num_kv_heads=4", "model.encoder_seq_length=32", "+model.vocab_size=64", "model.optim.lr=3e-4",
                 "model.optim.sched.warmup_steps=2", "+model.optim.sched.max_steps=10", "model.optim.sched.min_lr=3e-5"]
        for tag in (NXDT_XSER, NXDT_PT):
            run_dir = os.path.join(self.dir, os.path.basename(os.path.dirname(tag)))
            ckpts = os.path.join(run_dir, "checkpoints")
            shutil.copytree(tag, os.path.join(ckpts, NXDT_TAG))
            argv = [TRAIN, conf, f"exp_manager.explicit_log_dir={run_dir}", "trainer.max_steps=6", "data.data_prefix=[1.0,data/tok]",
                    "data.global_batch_size=8", "data.micro_batch_size=4", "+exp_manager.resume_reshard=True", *model]
            # Without weight_init_only the lost moments are refused, naming what happened.
            p = subprocess.run(argv, cwd=self.dir, capture_output=True, text=True)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("moments were never written", p.stderr)
            p = subprocess.run(argv + ["+model.weight_init_only=True"], cwd=self.dir, capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("at step 4, 32 samples consumed", p.stderr)
            self.assertIn("optimizer starts fresh", p.stderr)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                metrics = [__import__("json").loads(line) for line in f]
            self.assertEqual([m["step"] for m in metrics], [5, 6])
            self.assertEqual([m["consumed_samples"] for m in metrics], [40, 48])
            # NeMo's CosineAnnealing after last_epoch 4 gives the step-5 LR NxDT saved as _last_lr.
            want = load(os.path.join(tag, "user_content.pt"))["lr_schedulers"][0]["_last_lr"][0]
            self.assertAlmostEqual(metrics[0]["lr"], want, delta=1e-12)
        # NxD's own trainer's tag (bf16 model, ZeRO-1 with fp32 masters, free-form user content,
        # named step_4): resumed with its optimizer state, the step from the name.
        run_dir = os.path.join(self.dir, "nxd")
        shutil.copytree(NXD_XSER, os.path.join(run_dir, "in", "step_4"))
        argv = [TRAIN, conf, f"exp_manager.explicit_log_dir={run_dir}", "trainer.max_steps=6", "data.data_prefix=[1.0,data/tok]",
                f"exp_manager.resume_from_checkpoint={os.path.join(run_dir, 'in', 'step_4')}", "+exp_manager.resume_reshard=True",
                "precision.type=mixed_precision", "distributed_strategy.zero1=True",
                "+exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True", *model]
        p = subprocess.run(argv, cwd=self.dir, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("the step is 4, from the tag's name", p.stderr)
        self.assertIn("at step 4, 0 samples consumed", p.stderr)
        self.assertNotIn("starts fresh", p.stderr)
        self.assertNotIn("holds no master weights", p.stderr)

    def test_trainer_bins_xser_tensors_across_dp_as_nxd_does(self):
        """At dp 2, NxD's save_checkpoint has each dp replica write its bin of a model file's
        tensor files (_assign_tensors_to_bins); generate.out.txt records which simulated rank wrote
        which tid of nxd_xser. The rule, checked against that record, then predicts which rank of
        shardkit-train writes which tensor file at the fixture's layout (tp2 pp2 dp2, ZeRO-1, bf16
        with fp32 masters, xser); each rank's completion record lists what it wrote."""
        import json
        import re
        import numpy as np

        def info_bytes(info_path):
            info = load(info_path)
            return [int(np.prod(info[t]["shape"])) * torch.empty((), dtype=info[t]["dtype"]).element_size() for t in range(len(info))]

        def nxd_bins(sizes, bins):
            # NxD trainer/checkpoint.py _assign_tensors_to_bins, line for line.
            bin_tidxs, bin_sizes = [[] for _ in range(bins)], [0] * bins
            for tidx, size in sorted(enumerate(sizes), key=lambda a: a[1]):
                bid = bin_sizes.index(min(bin_sizes))
                bin_tidxs[bid].append(tidx)
                bin_sizes[bid] += size
            return [sorted(b) for b in bin_tidxs]

        def dp_of(rank):  # NxD's and shardkit's rank order: tp fastest, then dp, then pp (tp 2, dp 2)
            return rank // 2 % 2

        with open(os.path.join(DATA, "generate.out.txt")) as f:
            out = f.read()
        section = out[out.index("### nxd_xser"):]
        section = section[:section.index("\n###", 1)] if "\n###" in section[1:] else section
        recorded = {}  # (model file, dp rank) -> tids NxD's save wrote from that rank
        for m in re.finditer(r"  (model/\S+)\.tensors/tensor_<tid>\.pt written by: (.*)", section):
            for part in m.group(2).split("; "):
                r, tids = re.fullmatch(r"rank (\d+) -> tids \[([\d, ]*)\]", part).groups()
                recorded[(m.group(1), dp_of(int(r)))] = sorted(int(t) for t in tids.split(", ") if t)
        self.assertEqual(len(recorded), 8, section[:2000])  # 4 model files, each split over 2 dp ranks
        for (rel, dp), tids in recorded.items():
            self.assertEqual(nxd_bins(info_bytes(os.path.join(NXD_XSER, rel + ".info.pt")), 2)[dp], tids, (rel, dp))

        os.makedirs(os.path.join(self.dir, "data"))
        rng = np.random.default_rng(0)
        megatron_write(os.path.join(self.dir, "data", "tok"), [rng.integers(0, 64, 300) for _ in range(20)], np.uint16)
        conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
        run_dir = os.path.join(self.dir, "run")
        argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "8", TRAIN, conf, f"exp_manager.explicit_log_dir={run_dir}",
                "trainer.max_steps=2", "trainer.devices=8", "data.data_prefix=[1.0,data/tok]", "data.global_batch_size=8",
                "data.micro_batch_size=2", "distributed_strategy.tensor_model_parallel_size=2",
                "distributed_strategy.pipeline_model_parallel_size=2", "distributed_strategy.zero1=True", "precision.type=mixed_precision",
                "+exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=True", "+exp_manager.save_xser=True",
                "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
                "model.num_layers=4", "model.hidden_size=16", "model.ffn_hidden_size=32", "model.num_attention_heads=4",
                "model.num_kv_heads=4", "model.encoder_seq_length=32", "+model.vocab_size=64"]
        p = subprocess.run(argv, cwd=self.dir, capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        ckpts = os.path.join(run_dir, "checkpoints")
        tag = os.path.join(ckpts, [t for t in os.listdir(ckpts) if "step=2" in t][0])
        self.assertEqual(run(VERIFY, tag).returncode, 0)
        got, xpt = {}, {}
        for r in range(8):
            with open(os.path.join(tag, ".shardkit", f"rank_{r:05d}.json")) as f:
                for path in json.load(f)["files"]:
                    if m := re.fullmatch(r"(model/\S+)\.tensors/tensor_(\d+)\.pt", path):
                        got.setdefault((m.group(1), dp_of(r)), []).append(int(m.group(2)))
                    elif m := re.fullmatch(r"(model/\S+?\.pt)(\.info\.pt)?", path):
                        xpt.setdefault(m.group(1), set()).add(dp_of(r))
        want = {}
        for rel in {k[0] for k in got}:
            for dp, tids in enumerate(nxd_bins(info_bytes(os.path.join(tag, rel + ".info.pt")), 2)):
                want[(rel, dp)] = tids
        self.assertEqual(len(want), 8)
        self.assertEqual({k: sorted(v) for k, v in got.items()}, want)
        self.assertEqual(xpt, {rel: {0} for rel, _ in want})  # X.pt and its info.pt from dp rank 0, as NxD writes them

if __name__ == "__main__":
    unittest.main()

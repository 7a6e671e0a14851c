"""shardkit-train writes and resumes checkpoints at expert parallelism ep > 1 (issue #39): NxD's ep layout.

- At tp 2 dp 2 ep 2 (4 ranks) NxDT's HF Mixtral, at the sizes of NxD's own tags (tests/data/upstream/nxd_mixtral:
  vocabulary 64, hidden 16, 2 MoE layers of 4 experts), writes a tag laid out as hf_ep2_pt and hf_ep2_xser: the same
  files; model files dp_rank_00_ep_rank_EE_ with the same keys, order, shapes and dtypes (the int32 SPMDRank tensors
  included); xser ep_rank_01 tensor folders holding only the expert tensors, info.pt marking exactly those; optim
  files of NxD's NeuronEPZero1Optimizer (its offsets, its param_groups and ids, base_state keys and shard shapes,
  shape_info). Values aside, and one dtype: the fixture's moments are float64 (NxDT's mixed precision on CPU keeps
  fp64 master weights and moments), the trainer's float32. NxD's load_checkpoint reads these tags: committed output
  load_check_train_ep2.out.txt (and load_check_train_ep1.out.txt for the ep 1 tag) in that folder.
- tp 1 dp 4 ep 2: the model file of each ep rank comes from its expert-data-parallel pair, as xser each writing its
  bin (NxD: groups=get_expert_data_parallel_replica_groups()); the experts' ZeRO-1 state is cut over expert-dp (2),
  the rest over dp (4).
- Killed after a save (async, xser), a tp 2 dp 2 ep 2 run resumes to exactly the uninterrupted run.
- What does not work is refused by name: a tag resumed at another ep (without resume_reshard: train_moe_resume_reshard.py),
  checkpoints at ep > 1 without ZeRO-1.
"""
import glob
import json
import os
import re
import signal
import subprocess
import unittest

import numpy as np
import torch

from canon import TRAIN, TempDirTest
from indexed_dataset_interop import megatron_write
from train_hf_llama import mpirun
from train_resume import losses, start_until
from nxd_mixtral_fixture import read  # a tag file, plain or xser (its ep_rank_00 folder's tensors too)
from upstream_tags import TensorReference  # installs the torch_xla stub that unpickles xser reference files
import train_moe  # its shrink of NxDT's HF Mixtral configs (a module: its tests run in their own file)
from train_moe import CONFIGS

HERE = os.path.dirname(os.path.abspath(__file__))
NXD = os.path.join(HERE, "..", "data", "upstream", "nxd_mixtral")
EP = "distributed_strategy.expert_model_parallel_size"
TP = "distributed_strategy.tensor_model_parallel_size"
# NxD's tags' model (generate.py MODEL), as a config.json.
TINY = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 16, "intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64,
        "max_position_embeddings": 32, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
        "router_jitter_noise": 0.0}
EXPERT = re.compile(r"\.mlp\.expert_mlps\.mlp_op\.(gate_up|down)_proj\.weight$")


def tag_of(step_dir):
    return os.path.join(NXD, step_dir, "step_2")


def files(tag):
    """Every file of a tag (relative), but the store's own and the tensor files (listed per folder by tensor_tids)."""
    out = []
    for root, _, names in os.walk(tag):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), tag)
            if ".tensors" not in rel and (rel.startswith("model/") or rel.startswith("optim/")):
                out.append(rel)
    return sorted(out)


def tensor_tids(tag):
    """folder -> sorted tids of its tensor files."""
    out = {}
    for d in glob.glob(os.path.join(tag, "*", "*.pt.tensors")):
        out[os.path.relpath(d, tag)] = sorted(int(re.match(r"tensor_(\d+)\.pt$", n).group(1)) for n in os.listdir(d))
    return out


def structure(v, moments_dtype=False):
    """A value's shape: dict keys in order, tensors as (dtype, shape), other leaves as their type (values aside).
    With moments_dtype, floating tensors' dtype is left out (the fixture's float64 moments, the trainer's float32)."""
    if isinstance(v, dict):
        return [(k, structure(x, moments_dtype)) for k, x in v.items()]
    if isinstance(v, (list, tuple)):
        return ["list", [structure(x, moments_dtype) for x in v]]
    if isinstance(v, torch.Tensor):
        return ("tensor", "float" if moments_dtype and v.dtype.is_floating_point else str(v.dtype), tuple(v.shape))
    if isinstance(v, torch.Size):
        return ("size", tuple(v))
    if isinstance(v, TensorReference):  # an xser reference file's: its tid
        return ("tid", v.tid)
    return type(v).__name__


def load(path):
    return torch.load(path, map_location="cpu")


def assert_killed_run_resumes_exactly(test, argv, ranks):
    """Killed after an async xser save, an ep > 1 run of `ranks` ranks resumes to exactly the uninterrupted run:
    the same losses and every model and optim file byte for byte. `argv(run_dir, *overrides, steps=)`."""
    extra = ["exp_manager.async_checkpointing=True", "exp_manager.checkpoint_callback_params.every_n_train_steps=5",
             "exp_manager.checkpoint_callback_params.save_top_k=-1"]
    steps = 30
    test.trained(argv("full", *extra, steps=steps), ranks=ranks)
    p = start_until(test, mpirun(ranks) + [TRAIN, *argv("killed", *extra, steps=steps)], test.dir,
                    os.path.join(test.dir, "killed", "checkpoints", "*step=5-*", "done"), 120)
    pids = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "shardkit-train"], capture_output=True, text=True).stdout.split()
    test.assertEqual(len(pids), ranks)
    os.kill(int(pids[-1]), signal.SIGKILL)
    test.assertNotEqual(p.wait(timeout=60), 0)
    test.assertLess(max(losses(os.path.join(test.dir, "killed"))), steps)
    r = test.trained(argv("killed", *extra, "exp_manager.resume_if_exists=True", steps=steps), ranks=ranks)
    test.assertRegex(r.stderr, r"resumed from \S*step=(5|10|15|20|25)-")
    test.assertEqual(losses(os.path.join(test.dir, "killed")), losses(os.path.join(test.dir, "full")))
    full, killed = test.tag("full", steps), test.tag("killed", steps)
    every = sorted(os.path.relpath(os.path.join(r, n), full) for r, _, ns in os.walk(full) for n in ns
                   if os.path.relpath(r, full).split(os.sep)[0] in ("model", "optim"))
    test.assertGreater(len(every), 100)  # xser: a file per tensor
    for rel in every:
        with open(os.path.join(full, rel), "rb") as f1, open(os.path.join(killed, rel), "rb") as f2:
            test.assertEqual(f1.read(), f2.read(), f"{rel} differs")


class TrainMoeEpCkpt(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        rng = np.random.default_rng(39)
        megatron_write(os.path.join(self.dir, "data", "tok"), [rng.integers(0, 64, 200) for _ in range(40)], np.uint16)
        self.mixtral = os.path.join(self.dir, "tiny_mixtral.json")
        with open(self.mixtral, "w") as f:
            json.dump(TINY, f)

    train = train_moe.TrainMoe.train  # plain functions: these run in this class
    trained = train_moe.TrainMoe.trained
    tag = train_moe.TrainMoe.tag

    def argv(self, run_dir, *overrides, tp=2, ep=2, steps=2, xser=False):
        return (train_moe.TrainMoe.argv(self, CONFIGS[0], run_dir, devices=4, steps=steps) +
                [f"model.model_config={self.mixtral}", "model.num_layers=2", "model.hidden_size=16", "model.moe.num_experts=4",
                 "precision.type=fp32", f"{TP}={tp}", f"{EP}={ep}",
                 f"exp_manager.save_xser={xser}", *overrides])

    def assert_layout_of_fixture(self, got, want):
        self.assertEqual(files(got), files(want))
        for rel in files(want):
            with self.subTest(rel):
                a, b = load(os.path.join(got, rel)), load(os.path.join(want, rel))
                if rel.startswith("optim/") and not rel.endswith(".info.pt"):
                    # The param_groups' ids; their dicts aside, which the trainer writes as at ep 1 (its keys' order,
                    # and no initial_lr: NeMo's scheduler's, which NxD's save carries).
                    groups = lambda sd: [(g["weight_decay"] > 0, g["params"]) for g in sd["param_groups"]]  # noqa: E731
                    self.assertEqual(groups(a), groups(b))
                    a, b = {k: v for k, v in a.items() if k != "param_groups"}, {k: v for k, v in b.items() if k != "param_groups"}
                    for k in ("ep_param_id_offset", "ep_param_group_offset", "ep_base_state_offset", "ep_shape_info_offset"):
                        self.assertEqual(a[k], b[k], k)
                    self.assertEqual(structure(a, moments_dtype=True), structure(b, moments_dtype=True))
                elif rel.endswith(".info.pt"):  # tid -> dtype, shape, expert_model_parallel (moments' dtype aside)
                    info = lambda i: {t: (str(x["dtype"]) if rel.startswith("model/") else "", tuple(x["shape"]),  # noqa: E731
                                          x["expert_model_parallel"]) for t, x in i.items()}
                    self.assertEqual(list(a), list(b))
                    self.assertEqual(info(a), info(b))
                else:
                    self.assertEqual(structure(a), structure(b))
        self.assertEqual(tensor_tids(got), tensor_tids(want))

    def test_tp2_dp2_ep2_tags_are_nxds_ep_layout(self):
        for xser, fixture in ((False, "hf_ep2_pt"), (True, "hf_ep2_xser")):
            with self.subTest(fixture):
                run = f"ep2_{fixture}"
                self.trained(self.argv(run, xser=xser), ranks=4)
                self.assert_layout_of_fixture(self.tag(run, 2), tag_of(fixture))
        # The SPMDRank tensors as NxD's __init__ leaves them, and each ep rank's experts its own.
        pt = self.tag("ep2_hf_ep2_pt", 2)
        model = {e: load(os.path.join(pt, "model", f"dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt")) for e in (0, 1)}
        spmd = "model.layers.0.mlp.expert_mlps.spmd_rank."
        for e in (0, 1):
            self.assertTrue(torch.equal(model[e][spmd + "rank"], torch.zeros(1, dtype=torch.int32)))
            self.assertTrue(torch.equal(model[e][spmd + "local_expert_indices"], torch.zeros(1, 2, dtype=torch.int32)))
        gate_up = "model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
        self.assertFalse(torch.equal(model[0][gate_up], model[1][gate_up]))
        for n in model[0]:
            if not EXPERT.search(n):
                self.assertTrue(torch.equal(model[0][n], model[1][n]), n)  # non-expert tensors: the same on every ep rank
        # The xser tag's ep rank 1 file reads back (its non-expert tensors from ep rank 0's folder) as the plain one's
        # shapes; the marks are on the expert tensors alone.
        xs = self.tag("ep2_hf_ep2_xser", 2)
        info = load(os.path.join(xs, "model", "dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt.info.pt"))
        self.assertEqual(sorted(t for t, i in info.items() if i["expert_model_parallel"]), [8, 9, 19, 20])

    def test_tp1_dp4_ep2_shares_each_file_over_its_expert_data_parallel_pair(self):
        for xser in (False, True):
            with self.subTest(xser=xser):
                run = f"dp4_{xser}"
                self.trained(self.argv(run, tp=1, xser=xser), ranks=4)
                tag = self.tag(run, 2)
                self.assertEqual(files(tag), sorted(
                    [f"model/dp_rank_00_ep_rank_0{e}_tp_rank_00_pp_rank_00.pt" + s for e in (0, 1) for s in (("", ".info.pt") if xser else ("",))] +
                    [f"optim/dp_rank_0{d}_tp_rank_00_pp_rank_00.pt" + s for d in range(4) for s in (("", ".info.pt") if xser else ("",))]))
                model = [read(os.path.join(tag, "model", f"dp_rank_00_ep_rank_0{e}_tp_rank_00_pp_rank_00.pt"), xser) for e in (0, 1)]
                gate_up = "model.layers.1.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
                self.assertEqual(tuple(model[0][gate_up].shape), (2, 16, 64))  # experts [2e, 2e + 2), tp 1
                if xser:  # ep rank 1's folder: the expert tensors alone
                    tids = tensor_tids(tag)
                    self.assertEqual(len(tids["model/dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt.tensors"]), 25)
                    self.assertEqual(tids["model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt.tensors"], [8, 9, 19, 20])
                optim = read(os.path.join(tag, "optim", "dp_rank_01_tp_rank_00_pp_rank_00.pt"), xser)
                off = optim["ep_base_state_offset"]
                self.assertEqual((optim["ep_param_group_offset"], off), (2, 17))
                # embed_tokens (64, 16): dp 4 shards of 16 rows; layer 0's gate_up (2, 16, 64): expert-dp 2 shards of 1 expert.
                self.assertEqual(tuple(optim["base_state"][0]["exp_avg"].shape), (16, 16))
                self.assertEqual(tuple(optim["base_state"][off]["exp_avg"].shape), (1, 16, 64))
                self.assertEqual(tuple(optim["shape_info"][off]), (2, 16, 64))

    def test_killed_run_resumes_exactly(self):
        assert_killed_run_resumes_exactly(self, lambda run_dir, *extra, steps: self.argv(run_dir, *extra, steps=steps, xser=True), 4)

    def test_what_does_not_work_is_refused_by_name(self):
        self.trained(self.argv("ep2"), ranks=4)
        self.trained(self.argv("ep1", ep=1), ranks=4)
        resume = ["exp_manager.resume_if_exists=True", "exp_manager.create_checkpoint_callback=False"]
        # A layout the tag was not written at ends the run (status 1, as any resume that does not fit); a config, status 2.
        cases = [
            (self.argv("ep2", *resume, ep=1), 1,
             re.escape("written at tp 2, pp 1, dp 2, ep 2 (ZeRO-1), but this run is tp 2, pp 1, dp 2 (ZeRO-1)")),
            (self.argv("ep1", *resume), 1,
             re.escape("written at tp 2, pp 1, dp 2 (ZeRO-1), but this run is tp 2, pp 1, dp 2, ep 2 (ZeRO-1)")),
            (self.argv("nozero1", "distributed_strategy.zero1=False"), 2,
             re.escape("distributed_strategy.zero1: checkpoints at distributed_strategy.expert_model_parallel_size > 1 need ZeRO-1")),
        ]
        for argv, status, message in cases:
            with self.subTest(message):
                p = self.train(argv, 4)
                self.assertEqual(p.returncode, status, p.stderr)
                self.assertRegex(p.stderr, message)


if __name__ == "__main__":
    unittest.main()

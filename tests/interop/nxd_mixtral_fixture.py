"""The Mixtral (MoE) ground truth of issue #38 (tests/data/upstream/nxd_mixtral:
NxDT's HF MixtralForCausalLM on NxD's MoE modules, NxD's ZeRO-1 and
save_checkpoint, run on CPU; see its README) is what it claims to be:

  - every file matches manifest.json (size, sha256), and nothing else is there;
  - each rank file's tensors equal their box of the gathered full state, the
    boxes stated here from the README's layout facts (experts contiguous over
    ep on dim 0; gate_up_proj [gate | up] split on dim 2 with stride 2,
    down_proj on dim 1; router and norms replicated), model and optimizer
    (ZeRO-1 shards on dim 0 over the sharding group, EP offsets and groups);
  - xser: info.pt marks exactly the expert tids, ep_rank_01 folders hold only them;
  - hf_reference: the HF MixtralForCausalLM layout (w1/w3 = gate_up_proj
    halves transposed, w2 = down_proj transposed, gate = router), whose MoE
    forward on the committed tokens matches NxD's MoE layer output;
  - NxDT's save route at ep 2 loses the expert optimizer state of ep rank 1
    (plain: ep_rank_00 optimizer files only; xser: ep_rank_01 X.pt with an empty
    .tensors folder).

No shardkit program runs here: this guards the fixture other tests read."""
import hashlib
import json
import os
import re
import unittest

import sys

import torch

from nxd_fixture import zero1_shard
from upstream_tags import TensorReference, files, load

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_mixtral")
sys.path.insert(0, DATA)
from hf_moe import hf_sparse_moe  # noqa: E402  (HF's Mixtral MoE block forward, torch only)
TAG = "step_2"
NXDT_TAG = "hf_mixtral--step=2-consumed_samples=16.0.ckpt"
TP, DP, EXPERTS = 2, 2, 4
EXPERT_KEYS = ("mlp_op.gate_up_proj.weight", "mlp_op.down_proj.weight")
SPMD_KEYS = ("spmd_rank.rank", "spmd_rank.local_expert_indices")


def is_expert(name):
    return name.endswith(EXPERT_KEYS)


def tp_box(name, full, t):
    """Rank t's tensor-parallel part, as the README states NxD's layers cut it."""
    if name.endswith("mlp_op.gate_up_proj.weight"):  # (E, H, 2I): [gate | up], stride 2 on dim 2
        pieces = full.chunk(2 * TP, dim=2)
        return torch.cat([pieces[t], pieces[TP + t]], dim=2)
    if name.endswith("down_proj.weight") and full.dim() == 3:
        return full.chunk(TP, dim=1)[t]
    if name.endswith("mlp.gate_up_proj.weight"):  # HF-style dense LlamaMLP (2I, H): [gate ; up], stride 2 on dim 0
        pieces = full.chunk(2 * TP, dim=0)
        return torch.cat([pieces[t], pieces[TP + t]], dim=0)
    if name.endswith(("mlp.down_proj.weight", "mlp.dense_4h_to_h.weight")):
        return full.chunk(TP, dim=1)[t]
    if name.endswith("mlp.dense_h_to_4h.weight"):  # Megatron-style dense MLP: stride 1 (NxDT's ColumnParallelLinear)
        return full.chunk(TP, dim=0)[t]
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "embed_tokens.weight", "lm_head.weight",
                      "query.weight", "key_value.weight", "word_embeddings.weight", "output_layer.weight")):
        return full.chunk(TP, dim=0)[t]
    if name.endswith(("o_proj.weight", "self_attention.dense.weight")):
        return full.chunk(TP, dim=1)[t]
    if name.endswith(("router.linear_router.weight", "norm.weight", "layernorm.weight", "rotary_emb.inv_freq")):
        return full
    raise AssertionError(f"no box rule for {name}")


def box(name, full, t, e, ep):
    if is_expert(name):
        full = full.chunk(ep, dim=0)[e]
    return tp_box(name, full, t).contiguous()


def read_xser(path):
    """An xser file: its reference tree with each TensorReference replaced by
    its tensor file; a tid absent from an ep_rank_EE (EE > 0) folder is read from
    ep_rank_00's, as NxD's load_checkpoint does (checkpoint.py, _xser_load_data)."""
    tree = load(path)
    own = path + ".tensors"
    base = re.sub(r"ep_rank_\d{2}", "ep_rank_00", path) + ".tensors"

    def walk(o):
        if isinstance(o, TensorReference):
            p = os.path.join(own, f"tensor_{o.tid}.pt")
            return load(p if os.path.exists(p) else os.path.join(base, f"tensor_{o.tid}.pt"))
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        return o

    return walk(tree)


def read(path, xser):
    return read_xser(path) if xser else load(path)


class Manifest(unittest.TestCase):
    def test_files_match_manifest(self):
        with open(os.path.join(DATA, "manifest.json")) as f:
            manifest = json.load(f)
        on_disk = {r for r in files(DATA, skip=()) if r != "manifest.json" and not r.endswith((".py", ".md", ".txt"))}
        self.assertEqual(on_disk, set(manifest))
        for rel, want in manifest.items():
            with open(os.path.join(DATA, rel), "rb") as f:
                b = f.read()
            self.assertEqual((len(b), hashlib.sha256(b).hexdigest()), (want["bytes"], want["sha256"]), rel)


class HfTags(unittest.TestCase):
    """hf_ep{1,2}_{pt,xser}: NxD's save_checkpoint(zero1_optimizer=True) of NxDT's HF-style model."""
    MOE = "model.layers.{}.mlp."  # where NxD's MoE module sits
    EXPERT_TIDS = [8, 9, 19, 20]  # xser tids of gate_up_proj, down_proj of layers 0 and 1
    FREQUENCY = 1
    EMPTY_GROUPS = 1  # NxDT's get_param_groups_by_weight_decay(["bias"]): every parameter in group 0, group 1 empty

    STEM = "hf_ep{}"
    EPS, CONTAINERS = (1, 2), (False, True)
    MOE_LAYERS = (0, 1)

    @classmethod
    def setUpClass(cls):
        cls.full = {ep: load(os.path.join(DATA, cls.STEM.format(ep) + "_full_state.pt")) for ep in cls.EPS}

    def tag(self, ep, xser):
        return os.path.join(DATA, self.STEM.format(ep) + ("_xser" if xser else "_pt"), TAG)

    def moe_config(self, ep):
        c = self.full[ep]["config"]
        return c["num_local_experts"], c["num_experts_per_tok"], c["moe_frequency"]

    def model_file(self, ep, t, e):
        return f"model/dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt" if ep > 1 else \
            f"model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"

    def test_full_state_orientation(self):
        for ep in self.EPS:
            m = self.full[ep]["model"]
            self.assertEqual(self.moe_config(ep), (4, 2, self.FREQUENCY))
            moe_layers = {int(re.search(r"layers\.(\d+)\.", k).group(1)) for k in m if is_expert(k)}
            self.assertEqual(sorted(moe_layers), list(self.MOE_LAYERS))
            for layer in self.MOE_LAYERS:
                p = self.MOE.format(layer)
                self.assertEqual(list(m[p + "router.linear_router.weight"].shape), [4, 16])
                self.assertEqual(list(m[p + "expert_mlps.mlp_op.gate_up_proj.weight"].shape), [4, 16, 64])
                self.assertEqual(list(m[p + "expert_mlps.mlp_op.down_proj.weight"].shape), [4, 32, 16])
            self.assertTrue(all(v.dtype == torch.float32 for v in m.values()))
            self.assertEqual(set(self.full[ep]["optimizer"]), {k for k in m if not k.endswith("inv_freq")})

    def test_model_files_equal_their_boxes(self):
        for ep in self.EPS:
            full = self.full[ep]["model"]
            for xser in self.CONTAINERS:
                tag = self.tag(ep, xser)
                names = {self.model_file(ep, t, e) for t in range(TP) for e in range(ep)}
                self.assertEqual({f for f in files(tag) if re.fullmatch(r"model/[^/]+_pp_rank_00\.pt", f)}, names)
                for t in range(TP):
                    for e in range(ep):
                        sd = read(os.path.join(tag, self.model_file(ep, t, e)), xser)
                        want = [k for k in sd if not k.endswith(SPMD_KEYS)]
                        self.assertEqual(want, list(full))  # same keys, same order
                        for k in want:
                            self.assertTrue(torch.equal(sd[k], box(k, full[k], t, e, ep)), (ep, xser, t, e, k))
                        spmd = {k: v for k, v in sd.items() if k.endswith(SPMD_KEYS)}
                        if ep == 1:
                            self.assertEqual(spmd, {})
                            continue
                        self.assertEqual(len(spmd), 2 * len(self.MOE_LAYERS))  # (rank, local_expert_indices) per MoE layer
                        for k, v in spmd.items():
                            shape = [1] if k.endswith("rank") else [1, EXPERTS // ep]
                            self.assertEqual((v.dtype, list(v.shape), int(v.abs().sum())), (torch.int32, shape, 0), k)

    def test_xser_info_and_ep_folders(self):
        tag = self.tag(2, True)
        for t in range(TP):
            for e in range(2):
                path = os.path.join(tag, self.model_file(2, t, e))
                tree = load(path)
                tids = {k: v.tid for k, v in tree.items()}
                info = load(path + ".info.pt")
                expert = sorted(tid for tid, i in info.items() if i["expert_model_parallel"])
                self.assertEqual(expert, sorted(tid for k, tid in tids.items() if is_expert(k)))
                self.assertEqual(expert, self.EXPERT_TIDS)
                held = sorted(int(f[7:-3]) for f in os.listdir(path + ".tensors"))
                self.assertEqual(held, sorted(tids.values()) if e == 0 else expert)

    def test_optimizer_files_equal_their_boxes(self):
        for ep in self.EPS:
            st = self.full[ep]["optimizer"]
            names = [n for n in self.full[ep]["model"] if n in st]  # parameters, in model order
            order = names if ep == 1 else [n for n in names if not is_expert(n)] + [n for n in names if is_expert(n)]
            for xser in self.CONTAINERS:
                tag = self.tag(ep, xser)
                for d in range(DP):
                    for t in range(TP):
                        sd = read(os.path.join(tag, f"optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt"), xser)
                        self.check_optimizer(sd, st, order, ep, d, t)

    def check_optimizer(self, sd, st, order, ep, d, t):
        n_plain = len(order) if ep == 1 else sum(not is_expert(n) for n in order)
        groups = [g["params"] for g in sd["param_groups"]]
        empty = [[]] * self.EMPTY_GROUPS
        if ep == 1:
            self.assertEqual(list(sd), ["state", "param_groups", "base_state", "shape_info"])
            self.assertEqual(groups, [list(range(len(order)))] + empty)
        else:
            self.assertEqual([sd[k] for k in ("ep_param_id_offset", "ep_param_group_offset", "ep_base_state_offset",
                                              "ep_shape_info_offset")], [1, 1 + self.EMPTY_GROUPS, n_plain, n_plain])
            self.assertEqual(groups, [list(range(n_plain))] + empty + [list(range(len(order) - n_plain))] + empty)
        self.assertEqual(sd["param_groups"][0]["weight_decay"], self.full[ep]["weight_decay"][0])
        self.assertEqual(sd["state"], {})
        self.assertEqual(sorted(sd["base_state"]), list(range(len(order))))
        for i, name in enumerate(order):
            e = d if ep > 1 else 0  # ep 2: the expert-parallel group is the data-parallel group: ep rank == dp rank
            group = 1 if (ep > 1 and is_expert(name)) else DP  # expert-dp size 1 at ep 2
            shard = d if group > 1 else 0
            local = box(name, st[name]["exp_avg"], t, e, ep)
            self.assertEqual(list(sd["shape_info"][i]), list(local.shape), name)
            for key in ("exp_avg", "exp_avg_sq"):
                want = zero1_shard(box(name, st[name][key], t, e, ep), group, shard)
                got = sd["base_state"][i][key]
                self.assertEqual(got.dtype, torch.float64)
                self.assertTrue(torch.equal(got, want), (ep, d, t, name, key))
            self.assertEqual(float(sd["base_state"][i]["step"]), 2.0)


class HfFrequency2(HfTags):
    """hf_freq2_ep1_pt: moe_frequency 2; NxDT's HF code makes 0-based layer 0 MoE, layer 1 dense."""
    STEM = "hf_freq2_ep{}"
    EPS, CONTAINERS = (1,), (False,)
    FREQUENCY, MOE_LAYERS = 2, (0,)
    test_xser_info_and_ep_folders = None  # no ep 2 xser tag in this variant


class MegatronTags(HfTags):
    """megatron_ep{1,2}_{pt,xser}: the same of NxDT's Megatron-style model (NeuronSwitchMLP)."""
    STEM = "megatron_ep{}"
    MOE = "language_model.encoder.layers.{}.mlp.moe."
    EXPERT_TIDS = [10, 11, 21, 22]
    EMPTY_GROUPS = 0  # NeMo's get_params_for_weight_decay_optimization: one group, is_expert False

    def moe_config(self, ep):
        c = self.full[ep]["config"]["model"]["moe"]
        return c["num_experts"], c["top_k"], c["frequency"]


class MegatronFrequency2(MegatronTags):
    """megatron_freq2_ep1_pt: moe_frequency 2; NxDT's Megatron code (1-based layer_number) makes
    0-based layer 1 MoE, layer 0 dense: the opposite of the HF style."""
    STEM = "megatron_freq2_ep{}"
    EPS, CONTAINERS = (1,), (False,)
    FREQUENCY, MOE_LAYERS = 2, (1,)
    test_xser_info_and_ep_folders = None  # no ep 2 xser tag in this variant


class HfReference(unittest.TestCase):
    """hf_reference/epE: the full state in HF's names and orientation."""

    def test_hf_layout_is_the_transposed_full_state(self):
        for ep in (1, 2):
            full = load(os.path.join(DATA, f"hf_ep{ep}_full_state.pt"))["model"]
            hf = load(os.path.join(DATA, "hf_reference", f"ep{ep}", "pytorch_model.bin"))
            with open(os.path.join(DATA, "hf_reference", f"ep{ep}", "config.json")) as f:
                cfg = json.load(f)
            self.assertEqual((cfg["architectures"], cfg["num_local_experts"], cfg["num_experts_per_tok"]),
                             (["MixtralForCausalLM"], 4, 2))
            inter = cfg["intermediate_size"]
            self.assertEqual(len(hf), 9 + 2 * (7 + 3 * EXPERTS) - 6)  # 41: no expert_mlps / router names left
            for layer in range(cfg["num_hidden_layers"]):
                p, h = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe."
                self.assertTrue(torch.equal(hf[h + "gate.weight"], full[p + "router.linear_router.weight"]))
                gate_up, down = full[p + "expert_mlps.mlp_op.gate_up_proj.weight"], full[p + "expert_mlps.mlp_op.down_proj.weight"]
                for e in range(EXPERTS):
                    w1, w2, w3 = (hf[h + f"experts.{e}.{w}.weight"] for w in ("w1", "w2", "w3"))
                    self.assertEqual([list(w1.shape), list(w2.shape), list(w3.shape)], [[inter, 16], [16, inter], [inter, 16]])
                    self.assertTrue(torch.equal(w1, gate_up[e][:, :inter].t()))
                    self.assertTrue(torch.equal(w3, gate_up[e][:, inter:].t()))
                    self.assertTrue(torch.equal(w2, down[e].t()))
            rest = [k for k in full if ".mlp." not in k]
            self.assertTrue(all(torch.equal(hf[k], full[k]) for k in rest))

    def test_hf_moe_forward_matches_nxd(self):
        for ep in (1, 2):
            d = os.path.join(DATA, "hf_reference", f"ep{ep}")
            hf, check = load(os.path.join(d, "pytorch_model.bin")), load(os.path.join(d, "moe_check.pt"))
            h = f"model.layers.{check['layer']}.block_sparse_moe."
            w = {n: [hf[h + f"experts.{e}.{n}.weight"] for e in range(EXPERTS)] for n in ("w1", "w2", "w3")}
            out, _ = hf_sparse_moe(check["tokens"], hf[h + "gate.weight"], w["w1"], w["w2"], w["w3"], 2)
            self.assertTrue(torch.equal(out, check["hf_output"]))
            self.assertTrue(torch.allclose(out, check["nxd_output"], rtol=1e-5, atol=1e-7))
            swapped, _ = hf_sparse_moe(check["tokens"], hf[h + "gate.weight"], w["w3"], w["w2"], w["w1"], 2)
            self.assertFalse(torch.allclose(swapped, check["nxd_output"], rtol=1e-5, atol=1e-7))  # the check can fail


class NxdtLossyEpSave(unittest.TestCase):
    """nxdt_ep2_{pt,xser}: NxDT's NLPCheckpointIO at ep 2 (zero1_optimizer unset)."""

    def test_plain_keeps_only_ep_rank_00_optimizer(self):
        tag = os.path.join(DATA, "nxdt_ep2_pt", NXDT_TAG)
        optim = sorted(os.listdir(os.path.join(tag, "optim")))
        self.assertEqual(optim, [f"dp_rank_00_ep_rank_00_tp_rank_{t:02d}_pp_rank_00.pt" for t in range(TP)])
        self.assertEqual(len(os.listdir(os.path.join(tag, "model"))), 4)
        hf = os.path.join(DATA, "hf_ep2_pt", TAG)
        for t in range(TP):  # what survives is dp/ep rank 0's state, byte for byte its NxD-route twin's content
            lossy = load(os.path.join(tag, "optim", optim[t]))
            twin = load(os.path.join(hf, f"optim/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt"))
            self.assertEqual(sorted(lossy["base_state"]), sorted(twin["base_state"]))
            for i in twin["base_state"]:
                self.assertTrue(torch.equal(lossy["base_state"][i]["exp_avg"], twin["base_state"][i]["exp_avg"]))
        cfg = load(os.path.join(tag, "user_content.pt"))["hyper_parameters"]["cfg"]
        self.assertNotIn("wrap_with_zero", cfg)

    def test_xser_ep_rank_01_optimizer_has_no_tensors(self):
        tag = os.path.join(DATA, "nxdt_ep2_xser", NXDT_TAG)
        with open(os.path.join(DATA, "empty_dirs.txt")) as f:
            empty = f.read().split()
        for t in range(TP):
            x = os.path.join(tag, "optim", f"dp_rank_00_ep_rank_01_tp_rank_{t:02d}_pp_rank_00.pt")
            self.assertTrue(os.path.isfile(x) and os.path.isfile(x + ".info.pt"))
            rel = os.path.relpath(x + ".tensors", DATA)
            self.assertIn(rel, empty)  # git keeps no empty folder: empty_dirs.txt records it
            self.assertEqual(os.listdir(x + ".tensors") if os.path.isdir(x + ".tensors") else [], [])
            tree = load(x)
            self.assertGreater(len(tree["base_state"]), 0)
            x0 = x.replace("ep_rank_01", "ep_rank_00")
            self.assertEqual(len(os.listdir(x0 + ".tensors")), len(load(x0 + ".info.pt")))


if __name__ == "__main__":
    unittest.main()

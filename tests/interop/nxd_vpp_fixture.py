"""The virtual-pipeline fixture tests/data/upstream/nxd_vpp (NxD fbac349's
NxDPPModel with pp 2 and virtual_pipeline_size 2, tp 2, dp 2, ZeRO-1, run on
CPU; see its README) is whole and says what its README says:

  - every data file has the size and sha256 manifest.json records, and no
    data file is missing from the manifest;
  - each pp rank's model files hold exactly the layers of its two virtual
    stages (p and p + pp; NxD's create_partitions puts 2 of the 8 layers on
    each of the 4 stages), with their global names, in NxDPPModel's
    local_state_dict order (stage p's modules, then stage p + pp's);
  - the optimizer ids are NxD's local_named_parameters order split into the
    example's two weight-decay groups (no-decay: names with "norm");
  - full_state.pt, the gathered state, gives back every rank's model tensor
    (tp slice) and every ZeRO-1 moment and master weight (tp slice, padded to
    dp and cut into dp shards) bit for bit, in the plain and the xser tag.

tests/data/upstream/nnm_vpp (NNM f4743ce's own save methods for 2 virtual
stages, and NxDT's NNM converter on the result) is whole too, and its files
are what its README says: model0/model1 nested per state_dict_for_save_checkpoint
with local layer keys, a state_dict without model tensors, and NxDT's
converter output without them.

No shardkit binary runs here: this checks the ground truth itself."""
import hashlib
import json
import os
import re
import unittest

import torch

from upstream_tags import TensorReference, files, load

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_vpp")
NNM = os.path.join(DATA, "..", "nnm_vpp")
TAGS = {"pt": os.path.join(DATA, "nxd_pt", "step_2"), "xser": os.path.join(DATA, "nxd_xser", "step_2")}
TP, PP, DP, VPP, LAYERS = 2, 2, 2, 2, 8
# tp partition dim of each parameter kind (NxD parallel layers: ParallelEmbedding and
# ColumnParallelLinear split rows, RowParallelLinear columns; GQA weight_qkv stacks the
# ranks' [q_r; k_r; v_r] blocks on rows; norms are whole on every rank)
SPLIT = {"embed_tokens.weight": 0, "qkv_proj.weight_qkv": 0, "o_proj.weight": 1, "gate_up_proj.weight": 0,
         "down_proj.weight": 1, "lm_head.weight": 0, "norm.weight": None, "layernorm.weight": None}
LAYER_PARAMS = ["self_attn.qkv_proj.weight_qkv", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]


def check_manifest(test, root, manifest):
    for rel, want in manifest.items():
        with open(os.path.join(root, rel), "rb") as f:
            b = f.read()
        test.assertEqual(len(b), want["bytes"], rel)
        test.assertEqual(hashlib.sha256(b).hexdigest(), want["sha256"], rel)


def split_dim(name):
    return next(d for suffix, d in SPLIT.items() if name.endswith(suffix))


def stage_layers(stage):
    per = LAYERS // (PP * VPP)
    return list(range(stage * per, (stage + 1) * per))


def expected_names(pp):
    """NxDPPModel.local_state_dict() order: stage pp's modules, then stage pp + PP's."""
    names = []
    for stage in (pp, pp + PP):
        if stage == 0:
            names.append("model.embed_tokens.weight")
        for layer in stage_layers(stage):
            names += [f"model.layers.{layer}.{p}" for p in LAYER_PARAMS]
        if stage == PP * VPP - 1:
            names += ["model.norm.weight", "lm_head.weight"]
    return names


def optimizer_names(pp):
    """Ids in order: run_llama_nxd.py's weight-decay group, then the no-decay group ("norm")."""
    names = expected_names(pp)
    return [n for n in names if "norm" not in n] + [n for n in names if "norm" in n]


def rank_file(kind, dp, tp, pp):
    return f"{kind}/dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def read(tag, rel):
    """A rank file as the tree NxD saved, xser references replaced by their tensor files."""
    tree = load(os.path.join(TAGS[tag], rel))
    if tag == "pt":
        return tree
    folder = os.path.join(TAGS[tag], rel + ".tensors")

    def fill(t):
        if isinstance(t, TensorReference):
            return load(os.path.join(folder, f"tensor_{t.tid}.pt"))
        if isinstance(t, dict):
            return {k: fill(v) for k, v in t.items()}
        if isinstance(t, list):
            return [fill(v) for v in t]
        return t

    return fill(tree)


def tp_slice(full, name, tp):
    d = split_dim(name)
    return full if d is None else full.chunk(TP, dim=d)[tp]


def dp_shard(t, dp):
    """torch_xla ZeroRedundancyOptimizer._shard_tensor: pad dim 0 to a multiple of dp, take chunk dp."""
    rows = -(-t.shape[0] // DP) * DP
    padded = torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))]) if rows != t.shape[0] else t
    return padded.chunk(DP)[dp]


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


class NxdVppFixtureTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(DATA, "manifest.json")) as f:
            cls.manifest = json.load(f)
        cls.full = load(os.path.join(DATA, "full_state.pt"))

    def test_manifest_matches_every_data_file(self):
        self.assertGreater(len(self.manifest), 900)
        check_manifest(self, DATA, self.manifest)
        on_disk = {os.path.join(d, f) for d in ("nxd_pt", "nxd_xser") for f in files(os.path.join(DATA, d), skip=())}
        self.assertEqual(on_disk, {r for r in self.manifest if r.startswith(("nxd_pt/", "nxd_xser/"))})

    def test_tag_files_per_rank(self):
        for tag, path in TAGS.items():
            got = {f for f in files(path) if ".tensors/" not in f and not f.endswith(".info.pt")}
            want = {"scheduler.pt", "user_content.pt"}
            want |= {rank_file("model", 0, tp, pp) for tp in range(TP) for pp in range(PP)}
            want |= {rank_file("optim", dp, tp, pp) for dp in range(DP) for tp in range(TP) for pp in range(PP)}
            self.assertEqual(got, want, tag)

    def test_each_pp_rank_holds_its_two_virtual_stages(self):
        self.assertEqual(expected_names(0)[1:3], ["model.layers.0." + LAYER_PARAMS[0], "model.layers.0." + LAYER_PARAMS[1]])
        for tag in TAGS:
            for pp in range(PP):
                for tp in range(TP):
                    model = read(tag, rank_file("model", 0, tp, pp))
                    self.assertEqual(list(model), expected_names(pp), (tag, pp, tp))
                    layers = sorted({int(m.group(1)) for k in model if (m := re.match(r"model\.layers\.(\d+)\.", k))})
                    self.assertEqual(layers, [0, 1, 4, 5] if pp == 0 else [2, 3, 6, 7])

    def test_model_tensors_are_the_full_state_sliced(self):
        for tag in TAGS:
            for pp in range(PP):
                for tp in range(TP):
                    for name, t in read(tag, rank_file("model", 0, tp, pp)).items():
                        want = tp_slice(self.full["model/" + name], name, tp)
                        self.assertTrue(bits_equal(t, want.contiguous()), (tag, tp, pp, name))

    def test_optimizer_ids_and_state_are_the_full_state_sharded(self):
        for tag in TAGS:
            for pp in range(PP):
                names = optimizer_names(pp)
                for tp in range(TP):
                    model = read(tag, rank_file("model", 0, tp, pp))
                    for dp in range(DP):
                        opt = read(tag, rank_file("optim", dp, tp, pp))
                        self.check_optimizer(opt, names, model, tp, dp, (tag, pp, tp, dp))

    def test_xser_tids_follow_the_state_order(self):
        """NxD's xser: per file, tids from 0 in depth-first order; the optimizer's base_state
        (step, exp_avg, exp_avg_sq per id) before all sharded_master_weights; info.pt per tid."""
        for pp in range(PP):
            n = len(expected_names(pp))
            for tp in range(TP):
                rel = rank_file("model", 0, tp, pp)
                refs = load(os.path.join(TAGS["xser"], rel))
                self.assertEqual([r.tid for r in refs.values()], list(range(n)), rel)
                info = load(os.path.join(TAGS["xser"], rel + ".info.pt"))
                model = read("pt", rel)
                self.assertEqual({t: (i["dtype"], list(i["shape"])) for t, i in info.items()},
                                 {t: (model[k].dtype, list(model[k].shape)) for t, k in enumerate(model)}, rel)
                for dp in range(DP):
                    opt = load(os.path.join(TAGS["xser"], rank_file("optim", dp, tp, pp)))
                    base = [[opt["base_state"][i][k].tid for k in ("step", "exp_avg", "exp_avg_sq")] for i in range(n)]
                    self.assertEqual(base, [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(n)])
                    self.assertEqual([opt["sharded_master_weights"][i].tid for i in range(n)], list(range(3 * n, 4 * n)))

    def check_optimizer(self, opt, names, model, tp, dp, where):
        groups = [g["params"] for g in opt["param_groups"]]
        n_decay = sum("norm" not in n for n in names)
        self.assertEqual(groups, [list(range(n_decay)), list(range(n_decay, len(names)))], where)
        self.assertEqual([g["weight_decay"] for g in opt["param_groups"]], [0.01, 0.0], where)
        self.assertEqual(sorted(opt["base_state"]), list(range(len(names))), where)
        for i, name in enumerate(names):
            self.assertEqual(list(opt["shape_info"][i]), list(model[name].shape), (where, name))
            st = opt["base_state"][i]
            for key, full_key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                want = dp_shard(tp_slice(self.full[f"optim/{full_key}/{name}"], name, tp), dp)
                self.assertTrue(bits_equal(st[key], want.contiguous()), (where, name, key))
                self.assertTrue(st[key].abs().sum() > 0, (where, name, key))
            self.assertTrue(bits_equal(st["step"], self.full[f"optim/step/{name}"]), (where, name))
            want = dp_shard(tp_slice(self.full[f"optim/master/{name}"], name, tp), dp)
            self.assertTrue(bits_equal(opt["sharded_master_weights"][i], want.contiguous()), (where, name))
            self.assertTrue(bits_equal(model[name], tp_slice(self.full[f"optim/master/{name}"], name, tp).to(model[name].dtype).contiguous()), (where, name))


class NnmVppFixtureTest(unittest.TestCase):
    def test_manifest_matches_every_file(self):
        with open(os.path.join(NNM, "manifest.json")) as f:
            manifest = json.load(f)
        self.assertEqual(set(manifest), {f for f in files(NNM, skip=()) if "/" in f})
        check_manifest(self, NNM, manifest)

    def test_nnm_chunks_are_nested_with_local_layer_keys(self):
        for t in range(TP):
            for p in range(PP):
                ck = load(os.path.join(NNM, "gpt_tied", "nnm", f"tp_rank_{t:02d}_pp_rank_{p:03d}", "model_optim_rng.ckpt"))
                self.assertEqual(ck["state_dict"], {"untrained_buffer_names": []})
                self.assertEqual([k for k in ck if k.startswith("model")], ["model0", "model1"])
                for v in range(VPP):
                    chunk = ck[f"model{v}"]
                    enc = chunk["language_model"]["encoder"]
                    self.assertEqual(sorted({k.split(".")[1] for k in enc if k.startswith("layers.")}), ["0", "1"])
                    self.assertEqual("embedding" in chunk["language_model"], (v, p) == (0, 0))
                    last = (v, p) == (VPP - 1, PP - 1)
                    self.assertEqual("final_layernorm.weight" in enc, last)
                    self.assertEqual(sorted(chunk), ["language_model", "word_embeddings_for_head"] if last else ["language_model"])

    def test_nxdt_converter_output_holds_no_model_tensor(self):
        failed = os.path.join(NNM, "gpt_tied", "nxdt", "model")
        self.assertEqual(sorted(files(failed, skip=())), ["dp_rank_00_tp_rank_00_pp_rank_00.pt"])
        self.assertEqual(list(load(os.path.join(failed, "dp_rank_00_tp_rank_00_pp_rank_00.pt"))), ["untrained_buffer_names"])
        empty = os.path.join(NNM, "gpt_tied", "nxdt_from_variant", "model")
        names = sorted(files(empty, skip=()))  # (its empty tensor folders are not kept by git)
        self.assertEqual(len(names), 2 * TP * PP)
        for f in names:
            self.assertEqual(load(os.path.join(empty, f)), {}, f)


if __name__ == "__main__":
    unittest.main()

"""shardkit against the Mixtral (MoE) tags NxD's own code wrote
(tests/data/upstream/nxd_mixtral, from branch mixfix: NxDT's HF-style
MixtralForCausalLM on NxD's MoE modules, tp 2 dp 2, ep 1 and ep 2, plain and
xser, ZeRO-1, with the gathered full state of each run; see its README). Issue #38.

  - what shardkit's tag reader loads of every model file (LoadTagFile, through
    pt_canonical tag-file) equals the full state's box for that rank bit for bit:
    experts contiguous over ep on dim 0, gate_up_proj's [gate || up] split over tp
    on dim 2 with stride 2, down_proj over tp on dim 1, the router whole on every
    rank; an ep rank above 0's xser file reads its shared tensors from ep_rank_00's
    folder, as NxD's _xser_load_data does, and its info.pt marks the experts alone;
  - every transforming command refuses an MoE tag (exit 2, nothing written) naming
    MoE (at ep 1: until --heads and --moe_top_k tell what no tensor does), and
    ckpt-verify does not say ok on NxDT's lossy expert-parallel save (an ep 1 one it reads:
    tests/interop/mixtral_ep1.py);
  - ckpt-inspect names the family, the experts and ep.
  (ckpt-import --format hf of MixtralForCausalLM: tests/interop/mixtral_hf.py, mixtral_ep1.py.)

Nothing here is written from belief about the layout: the boxes are the README's
layout facts, which its generator read from NxD's files."""
import json
import os
import shutil
import unittest

import torch

from canon import EXPORT, INSPECT, PT_CANONICAL, RESHARD, TempDirTest, VERIFY, run

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "upstream", "nxd_mixtral")
NXDT_TAG = "hf_mixtral--step=2-consumed_samples=16.0.ckpt"
TAGS = {  # name: (tag, ep of the run)
    "hf_ep1_pt": (os.path.join("hf_ep1_pt", "step_2"), 1),
    "hf_ep1_xser": (os.path.join("hf_ep1_xser", "step_2"), 1),
    "hf_ep2_pt": (os.path.join("hf_ep2_pt", "step_2"), 2),
    "hf_ep2_xser": (os.path.join("hf_ep2_xser", "step_2"), 2),
    "nxdt_ep2_pt": (os.path.join("nxdt_ep2_pt", NXDT_TAG), 2),
    "nxdt_ep2_xser": (os.path.join("nxdt_ep2_xser", NXDT_TAG), 2),
}
TP = 2
MOE = ".mlp.expert_mlps."
ROUTER = ".mlp.router.linear_router.weight"
GATE_UP = MOE + "mlp_op.gate_up_proj.weight"
DOWN = MOE + "mlp_op.down_proj.weight"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "bfloat16": torch.bfloat16}


def full_state(ep):
    return torch.load(os.path.join(DATA, f"hf_ep{ep}_full_state.pt"))


def tensors_of(canonical):
    """name -> torch tensor of a canonical JSON dict (value_json.cc's form, with tensor bytes)."""
    out = {}
    for k, v in canonical["items"]:
        if v.get("t") != "tensor":
            continue
        raw = bytearray(bytes.fromhex(v["data"]))
        t = torch.frombuffer(raw, dtype=DTYPES[v["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[v["dtype"]])
        out[k["v"]] = t.reshape(v["shape"])
    return out


def model_files(tag_dir, ep):
    """(rel, ep rank, tp rank) of each model file, NxD's names (trainer/checkpoint.py _get_path)."""
    for e in range(ep):
        for t in range(TP):
            ep_part = f"_ep_rank_{e:02d}" if ep > 1 else ""
            yield f"model/dp_rank_00{ep_part}_tp_rank_{t:02d}_pp_rank_00.pt", e, t


def expected_box(name, full, e, t, ep):
    """The README's layout facts: what ep rank e, tp rank t holds of full tensor `full`."""
    experts = full.shape[0] // ep if name.endswith((GATE_UP, DOWN)) else None
    if name.endswith(GATE_UP):  # dim 2 [gate || up], stride 2 over tp
        x = full[e * experts:(e + 1) * experts]
        half = x.shape[2] // 2
        cols = half // TP
        return torch.cat([x[:, :, t * cols:(t + 1) * cols], x[:, :, half + t * cols:half + (t + 1) * cols]], dim=2)
    if name.endswith(DOWN):  # dim 1 over tp
        x = full[e * experts:(e + 1) * experts]
        rows = x.shape[1] // TP
        return x[:, t * rows:(t + 1) * rows]
    if full.dim() == 1 or name.endswith(ROUTER):  # norms and the router: whole on every rank
        return full
    if name.endswith("o_proj.weight"):  # row-parallel: dim 1
        cols = full.shape[1] // TP
        return full[:, t * cols:(t + 1) * cols]
    rows = full.shape[0] // TP  # column-parallel, embedding, lm_head: dim 0
    return full[t * rows:(t + 1) * rows]


def copy_tag(rel, dst):
    """Tag `rel` of DATA copied to `dst`, with the empty folders git cannot store (empty_dirs.txt)."""
    shutil.copytree(os.path.join(DATA, rel), dst)
    with open(os.path.join(DATA, "empty_dirs.txt")) as f:
        for line in f.read().split():
            if line.startswith(rel + "/"):
                os.makedirs(os.path.join(dst, line[len(rel) + 1:]), exist_ok=True)
    return dst


class MixtralTags(TempDirTest):
    def copy(self, name):
        """The tag in a temporary folder (copy_tag)."""
        return copy_tag(TAGS[name][0], os.path.join(self.dir, name))

    def test_model_files_read_as_the_full_state_boxes(self):
        for name in ("hf_ep1_pt", "hf_ep1_xser", "hf_ep2_pt", "hf_ep2_xser"):
            tag, ep = self.copy(name), TAGS[name][1]
            full = full_state(ep)["model"]
            for rel, e, t in model_files(tag, ep):
                got = tensors_of(json.loads(run(PT_CANONICAL, "tag-file", tag, rel).stdout))
                for key, want in full.items():
                    with self.subTest(tag=name, file=rel, tensor=key):
                        self.assertIn(key, got)
                        box = expected_box(key, want, e, t, ep)
                        self.assertEqual(got[key].dtype, box.dtype)
                        self.assertTrue(torch.equal(got[key], box.contiguous()))
                # The SPMDRank int32 tensors (ep > 1 only) are NxD's __init__ zeros, outside the full state.
                extra = sorted(set(got) - set(full))
                self.assertEqual([k for k in extra if "spmd_rank" not in k], [])
                self.assertEqual(len(extra), 0 if ep == 1 else 4)

    def test_ep_rank_above_zero_xser_holds_only_the_experts(self):
        tag = self.copy("hf_ep2_xser")
        rel = "model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"
        info = torch.load(os.path.join(tag, rel + ".info.pt"))
        present = sorted(int(f[len("tensor_"):-len(".pt")]) for f in os.listdir(os.path.join(tag, rel + ".tensors")))
        self.assertEqual(present, sorted(tid for tid, d in info.items() if d["expert_model_parallel"]))
        self.assertGreater(len(present), 0)
        # Without ep_rank_00's shared tensor files the ep rank 1 file cannot be read: they are read from there.
        shutil.rmtree(os.path.join(tag, "model", "dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt.tensors"))
        p = run(PT_CANONICAL, "tag-file", tag, rel, check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt.tensors", p.stderr)

    def expect_refused(self, args, out=None):
        p = run(*args, check=False)
        self.assertEqual(p.returncode, 2, f"{args}: {p.stdout} {p.stderr}")
        self.assertIn("MoE", p.stderr, p.stderr)
        if out:
            self.assertFalse(os.path.exists(out), out)
        return p

    def test_transforming_commands_refuse_naming_moe(self):
        for name in TAGS:
            with self.subTest(tag=name):
                tag = self.copy(name)
                out = os.path.join(self.dir, name + "_out")
                self.expect_refused([RESHARD, tag, out, "--tp", 1, "--pp", 1], out)
                self.expect_refused([RESHARD, tag, out, "--tp", 1, "--pp", 1, "--weights_only"], out)
                self.expect_refused([EXPORT, tag, out + ".h5", "--weights_only"], out + ".h5")
                self.expect_refused([EXPORT, tag, out, "--format", "hf"], out)
                self.expect_refused([VERIFY, tag, "--against", tag])

    def test_verify_does_not_say_ok_at_ep_2(self):
        # NxDT's lossy ep 2 saves (NxD's own ep 2 tags verify: tests/interop/mixtral_ep_optim.py).
        for name in (n for n in TAGS if TAGS[n][1] > 1 and n.startswith("nxdt_")):
            with self.subTest(tag=name):
                p = run(VERIFY, self.copy(name), check=False)
                self.assertNotEqual(p.returncode, 0, p.stdout)
                self.assertFalse(p.stdout.startswith("ok"), p.stdout)
                self.assertIn("MoE", p.stdout)

    def test_inspect_names_family_experts_and_ep(self):
        for name in ("hf_ep1_pt", "hf_ep2_xser"):
            tag, ep = self.copy(name), TAGS[name][1]
            full = full_state(ep)
            routers = sorted(k for k in full["model"] if k.endswith(ROUTER))
            got = json.loads(run(INSPECT, tag, "--json", check=False).stdout)["model"]
            self.assertEqual(got["model_family"], "hf_mixtral")
            self.assertEqual(got["num_experts"], full["model"][routers[0]].shape[0])
            self.assertEqual(got["ep"], full["ep"])
            self.assertEqual(got["moe_layers"], [int(k.split(".")[2]) for k in routers])



if __name__ == "__main__":
    unittest.main()

"""ckpt-inspect on checkpoints torch writes in NNM and NxDT (plain and xser) layouts."""
import json
import os
import unittest

import torch

from canon import INSPECT, TempDirTest, run
from interop_classes import Foreign, TensorReference

DT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int64: "int64"}


def nnm_state(pp_rank, g):
    sd = {"model.language_model.encoder.layers.0.input_layernorm.weight": torch.ones(16),
          "model.language_model.encoder.layers.0.self_attention.query_key_value.weight": torch.randn(24, 16, generator=g)}
    if pp_rank == 0:
        sd["model.language_model.embedding.word_embeddings.weight"] = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    return {"epoch": 0, "global_step": 1085, "pytorch-lightning_version": "1.8.6", "state_dict": sd,
            "optimizer_states": [{"state": {0: {"step": torch.tensor(1085.), "exp_avg": torch.zeros(16)}},
                                  "param_groups": [{"lr": 3e-4, "params": [0]}]}],
            "lr_schedulers": [{"last_epoch": 1085}], "hyper_parameters": {"cfg": Foreign("cfg", {"tp": 2})}}


class InspectCli(TempDirTest):
    def inspect(self, path):
        return json.loads(run(INSPECT, path, "--json", "--verify-crc").stdout)

    def test_nnm_folder_lists_every_rank_file(self):
        g = torch.Generator().manual_seed(0)
        root = os.path.join(self.dir, "checkpoints")
        expected = {}
        for tp in range(2):
            for pp in range(2):
                rank = os.path.join(root, f"tp_rank_{tp:02d}_pp_rank_{pp:03d}")
                os.makedirs(rank)
                obj = nnm_state(pp, g)
                name = "megatron_llama--step=1085-consumed_samples=69632.0-last.ckpt"
                torch.save(obj, os.path.join(rank, name))
                expected[f"tp_rank_{tp:02d}_pp_rank_{pp:03d}/{name}"] = obj
        rep = self.inspect(root)
        self.assertEqual(rep["kind"], "nnm_folder")
        self.assertEqual(sorted(f["file"] for f in rep["files"]), sorted(expected))
        for f in rep["files"]:
            obj = expected[f["file"]]
            entries = {e["key"]: e for e in f["entries"]}
            for k, t in obj["state_dict"].items():
                e = entries["state_dict/" + k]
                self.assertEqual((e["dtype"], e["shape"], e["bytes"]),
                                 (DT[t.dtype], list(t.shape), t.numel() * t.element_size()))
            self.assertEqual(entries["global_step"]["value"], {"t": "int", "v": 1085})
            self.assertEqual(entries["optimizer_states/[0]/state/0/step"]["dtype"], "float32")
            self.assertEqual(entries["hyper_parameters/cfg"]["value"], {"object": "interop_classes.Foreign"})
        total = sum(t.numel() * t.element_size() for o in expected.values() for t in o["state_dict"].values())
        self.assertGreater(rep["totals"]["tensor_bytes"], total)  # plus optimizer tensors

    def test_xser_tag(self):
        tag = os.path.join(self.dir, "megatron_llama--step=5-consumed_samples=5120.0.ckpt")
        os.makedirs(os.path.join(tag, "model"))
        f = os.path.join(tag, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt")
        tensors = {"a.weight": torch.randn(4, 2), "b.weight": torch.arange(6).to(torch.bfloat16)}
        refs = {}
        os.makedirs(f + ".tensors")
        for tid, (k, t) in enumerate(tensors.items()):
            torch.save(t, os.path.join(f + ".tensors", f"tensor_{tid}.pt"))
            refs[k] = TensorReference(tid)
        torch.save(refs, f)
        for marker in ("checkpoint", "done"):
            with open(os.path.join(tag, marker), "w") as m:
                m.write("1")
        rep = self.inspect(tag)
        self.assertEqual(rep["kind"], "nxdt_tag")
        self.assertEqual(rep["markers"], ["checkpoint", "done"])
        self.assertEqual(len(rep["files"]), 1)  # the .tensors folder is part of the xser file
        self.assertEqual(rep["files"][0]["format"], "xser")
        got = {e["key"]: (e["dtype"], e["shape"]) for e in rep["files"][0]["entries"]}
        self.assertEqual(got, {k: (DT[t.dtype], list(t.shape)) for k, t in tensors.items()})
        text = run(INSPECT, tag).stdout
        self.assertIn("b.weight  bfloat16 [6]  12 B", text)

    def test_bad_inputs_exit_nonzero_naming_the_path(self):
        bad = os.path.join(self.dir, "bad.pt")
        with open(bad, "wb") as f:
            f.write(b"PK\x03\x04 not really a zip")
        for path in (bad, os.path.join(self.dir, "missing.pt"), self.dir):
            p = run(INSPECT, path, check=False)
            self.assertEqual(p.returncode, 2, path)  # bad input; 1 is a damaged tag's report
            self.assertIn(path, p.stderr)
            self.assertEqual(p.stdout, "")


if __name__ == "__main__":
    unittest.main()

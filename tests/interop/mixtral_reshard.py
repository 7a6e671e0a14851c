"""ckpt-reshard --weights_only of the HF-style Mixtral tags NxD's own code wrote at
ep 1 (tests/data/upstream/nxd_mixtral hf_ep1_pt, hf_ep1_xser: tp 2, dp 2; see its
README). Issue #38, item 2/4, first step.

  - tp 2 -> tp 1: the one model file holds every tensor of the gathered full state
    (hf_ep1_full_state.pt), bit for bit, and nothing else;
  - tp 1 -> tp 2: every model file equals the NxD tag's file of that rank, tensor by
    tensor, and ckpt-verify --against --weights_only says the two tags hold the same model;
  (What it once refused is read since: the optimizer state at ep 1 and the Megatron-style
    Mixtral, tests/interop/mixtral_ep1.py; ep 2 weights, mixtral_ep.py and
    mixtral_megatron_ep.py; the ep 2 optimizer state of either style, mixtral_ep_optim.py.
    What stays refused: mixtral_ep.py and mixtral_tags.py.)

The truth is the full state the upstream run gathered, not anything computed here."""
import json
import os
import unittest

import torch

from canon import PT_CANONICAL, RESHARD, TempDirTest, VERIFY, run
from mixtral_tags import TAGS, copy_tag, full_state, model_files, tensors_of

# Not in any tensor (no shape shows them): the run's config, as its full state records it.
CONFIG = full_state(1)["config"]


def hints():
    return ["--heads", str(CONFIG["num_attention_heads"]), "--moe_top_k", str(CONFIG["num_experts_per_tok"]),
            "--rope_theta", str(CONFIG["rope_theta"]), "--layernorm_epsilon", str(CONFIG["rms_norm_eps"])]


def read_file(tag, rel):
    return tensors_of(json.loads(run(PT_CANONICAL, "tag-file", tag, rel).stdout))


class MixtralReshard(TempDirTest):
    def round_trip(self, name):
        src = copy_tag(TAGS[name][0], os.path.join(self.dir, name))
        tp1, tp2 = os.path.join(self.dir, name + "_tp1"), os.path.join(self.dir, name + "_tp2")
        run(RESHARD, src, tp1, "--tp", "1", "--pp", "1", "--weights_only", *hints())
        full = full_state(1)["model"]
        got = read_file(tp1, "model/dp_rank_00_tp_rank_00_pp_rank_00.pt")
        self.assertEqual(sorted(got), sorted(full))
        for key, want in full.items():
            with self.subTest(tag=name, tensor=key):
                self.assertEqual(got[key].dtype, want.dtype)
                self.assertEqual(got[key].shape, want.shape)
                self.assertTrue(torch.equal(got[key], want))
        run(RESHARD, tp1, tp2, "--tp", "2", "--pp", "1", "--weights_only")
        for rel, _, _ in model_files(src, 1):
            want, back = read_file(src, rel), read_file(tp2, rel)
            self.assertEqual(sorted(back), sorted(want), rel)
            for key in want:
                with self.subTest(tag=name, file=rel, tensor=key):
                    self.assertEqual(back[key].dtype, want[key].dtype)
                    self.assertTrue(torch.equal(back[key], want[key]))
        run(VERIFY, tp2)
        p = run(VERIFY, tp2, "--against", src, "--weights_only", *hints(), check=False)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return src

    def test_ep1_pt_round_trip(self):
        self.round_trip("hf_ep1_pt")

    def test_ep1_xser_round_trip(self):
        self.round_trip("hf_ep1_xser")


if __name__ == "__main__":
    unittest.main()

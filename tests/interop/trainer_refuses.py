"""shardkit-train on NxDT's 22 example configs (tests/data/configs/nxdt, NxDT 9169aa0, byte for byte).

Shrunk to tiny sizes by overrides (layers, widths, heads, vocabulary, sequence, batch, devices, the
degrees, the data and the HF config.json), each config either trains two steps and checkpoints, or
exits 2 before any work naming every key that would change what is trained and that shardkit does
not implement (libtrain/config_keys.cc). What each config gets is stated below from the keys it sets.
"""
import glob
import os
import re
import subprocess
import unittest

import torch

from canon import TOKENIZE, TRAIN, TempDirTest, run
from train_hf_llama import mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
NXDT = os.path.join(HERE, "..", "data", "configs", "nxdt")
HF_CONFIG = os.path.join(HERE, "..", "..", "conf", "hf_llama_config.json")  # a tiny Llama: hidden 64, 4 heads, vocab 260

# Every config of the folder and what it gets: None trains, else the keys refused (the config's own values).
EXPECTED = {
    # HF-style pretraining: the data is NxDT's HF datasets folder (data.train_dir), which shardkit does not read.
    "hf_llama3.1_405B_trn1_config": ["data.train_dir"],
    "hf_llama3.1_70B_config": ["data.train_dir"],
    "hf_llama3.1_8B_config": ["data.train_dir"],
    "hf_llama3_70B_config": ["data.train_dir"],
    "hf_llama3_70B_trn2_config": ["data.train_dir"],
    # context_parallel_size: 2.
    "hf_llama3_70B_CP_config": ["distributed_strategy.context_parallel_size", "data.train_dir"],
    # optim.name: adamw_fp32OptState (NxD's AdamW_FP32OptimParams).
    "hf_llama3_8B_config": ["data.train_dir", "model.optim.name"],
    "hf_llama3_8B_trn2_config": ["data.train_dir", "model.optim.name"],
    "hf_llama_7B_config": ["data.train_dir", "model.optim.name"],
    "megatron_gpt_config": ["model.optim.name"],
    # Alignment: model_alignment_strategy.dpo / orpo / sft / peft; SFT's dev_choose_samples: 2250, LoRA's precision autocast.
    "hf_llama3_8B_DPO_config": ["data.train_dir", "model.optim.name", "model_alignment_strategy.dpo"],
    "hf_llama3_8B_ORPO_config": ["data.train_dir", "model.optim.name", "model_alignment_strategy.orpo"],
    "hf_llama3_8B_SFT_config": ["data.train_dir", "data.dev_choose_samples", "model.optim.name", "model_alignment_strategy.sft"],
    "hf_llama3_8B_SFT_lora_config": ["data.train_dir", "data.dev_choose_samples", "model.optim.name", "model_alignment_strategy.sft",
                                     "model_alignment_strategy.peft", "precision.type"],
    # Megatron SFT: use_sft_style_data_module, packing, JSONL train_dir, dev_choose_samples: 10000.
    "megatron_llama2_7B_SFT_config": ["data.packing", "data.use_sft_style_data_module", "data.train_dir", "data.dev_choose_samples"],
    # HF-style Mixtral (issue #39: trained, tests/interop/train_moe.py): refused for its data alone.
    "hf_mixtral_8x7b_config": ["data.train_dir"],
    "hf_mixtral_8x7b_dropless_config": ["data.train_dir"],
    # Megatron-style Mixtral (NeuronSwitchMLP; issue #39: trained, tests/interop/train_moe_megatron.py).
    "megatron_mixtral_8x7b_config": None,
    "megatron_mixtral_8x7b_dropless_config": None,
    # Dense Megatron-style Llamas with data_prefix; Mistral's sliding window (4096) covers its sequence.
    "megatron_llama_7B_config": None,
    "megatron_llama_70b_config": None,
    "megatron_mistral_config": None,
}
# HF-style configs refused for their data alone train once their data is given as data.data_prefix.
DATA_ONLY = [name for name, keys in EXPECTED.items() if keys == ["data.train_dir"]]


def keys_of(path):
    """The dotted keys of a block-style YAML file (enough for NxDT's configs: no flow mappings)."""
    keys, stack = set(), []
    with open(path) as f:
        for line in f:
            m = re.match(r"^( *)([A-Za-z_][\w.]*):", line)
            if not m:
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            keys.add(".".join(k for _, k in stack))
    return keys


class TrainerRefuses(TempDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(os.path.join(self.dir, "data"))
        run(TOKENIZE, "/usr/share/common-licenses/GPL-3", os.path.join(self.dir, "data", "tok"))

    def shrunk(self, name, run_dir, devices=1, pp=1):
        """Overrides that shrink config `name` to a tiny model on `devices` processes; its keys untouched otherwise."""
        path = os.path.join(NXDT, name + ".yaml")
        have = keys_of(path)
        tiny = {"trainer.devices": devices, "trainer.num_nodes": 1, "trainer.max_steps": 2, "trainer.log_every_n_steps": 1,
                "distributed_strategy.tensor_model_parallel_size": 1, "distributed_strategy.pipeline_model_parallel_size": pp,
                "distributed_strategy.kv_replicator": 1, "data.micro_batch_size": 1, "data.global_batch_size": 2 * devices // pp,
                "data.seq_length": 32, "model.encoder_seq_length": 32, "model.max_position_embeddings": 32, "model.num_layers": 4,
                "model.hidden_size": 64, "model.optim.sched.warmup_steps": 1, "model.optim.sched.constant_steps": 0,
                "exp_manager.explicit_log_dir": run_dir, "exp_manager.checkpoint_callback_params.every_n_train_steps": 2,
                "exp_manager.async_checkpointing": False}
        add = {}  # keys the config lacks
        if "model.model_config" in have:  # HF-style: the model is a config.json
            tiny["model.model_config"] = HF_CONFIG
        else:  # Megatron-style: the model is the YAML's
            tiny.update({"model.ffn_hidden_size": 128, "model.num_attention_heads": 4, "model.num_kv_heads": 2})
            add["model.vocab_size"] = 260  # else read from the tokenizer the config names
        if "data.data_prefix" in have:
            tiny["data.data_prefix"] = "[1.0,data/tok]"
        return ([path] + [f"{k}={v}" for k, v in tiny.items() if k in have] +
                [f"+{k}={v}" for k, v in add.items() if k not in have])

    def train(self, argv, ranks=1):
        return subprocess.run((mpirun(ranks) if ranks > 1 else []) + [TRAIN, *argv], cwd=self.dir, capture_output=True, text=True,
                              timeout=300)

    def assert_trained(self, p, run_dir):
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("done: steps 0 -> 2", p.stderr)
        tags = glob.glob(os.path.join(self.dir, run_dir, "checkpoints", "*--step=2-consumed_samples=4.0.ckpt"))
        self.assertEqual(len(tags), 1, p.stderr)
        # Neuron's own settings are named and ignored, not refused.
        self.assertIn("info: compiler_flags (a Neuron compiler or runtime setting) is accepted and ignored", p.stderr)

    def test_every_example_config_trains_or_names_what_it_refuses(self):
        names = sorted(os.path.basename(p)[:-len(".yaml")] for p in glob.glob(os.path.join(NXDT, "*.yaml")))
        self.assertEqual(len(names), 22)
        self.assertEqual(sorted(EXPECTED), names)
        for name in names:
            with self.subTest(name):
                run_dir = "run_" + name
                p = self.train(self.shrunk(name, run_dir))
                want = EXPECTED[name]
                if want is None:
                    self.assert_trained(p, run_dir)
                    continue
                self.assertEqual(p.returncode, 2, p.stderr)
                lines = [line for line in p.stderr.splitlines() if line.strip()]
                self.assertEqual(len(lines), len(want), p.stderr)
                path = os.path.join(NXDT, name + ".yaml")
                refused = [re.match(r"^(?:shardkit-train: )?" + re.escape(path) + r": ([\w.]+): ", line) for line in lines]
                self.assertTrue(all(refused), p.stderr)
                self.assertEqual(sorted(m.group(1) for m in refused), sorted(want), p.stderr)
                for line in lines:
                    self.assertTrue(line.endswith("; shardkit does not implement it"), line)
                self.assertFalse(os.path.exists(os.path.join(self.dir, run_dir)), "refused after starting work")

    def test_mistrals_sliding_window_is_named_as_without_effect(self):
        p = self.train(self.shrunk("megatron_mistral_config", "mistral"))
        self.assert_trained(p, "mistral")
        self.assertIn("model.sliding_window_size (no effect: the window of 4096 covers data.seq_length 32)", p.stderr)
        p = self.train(self.shrunk("megatron_mistral_config", "narrow") + ["model.sliding_window_size=16"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("model.sliding_window_size: sliding-window attention over 16 tokens, fewer than data.seq_length (32); "
                      "shardkit does not implement it", p.stderr)

    def test_hf_configs_train_with_their_data_given_as_data_prefix(self):
        for name in DATA_ONLY:
            with self.subTest(name):
                run_dir = "run_" + name
                argv = self.shrunk(name, run_dir) + ["~data.train_dir", "+data.data_prefix=[1.0,data/tok]"]
                if "model.pipeline_cuts" in keys_of(os.path.join(NXDT, name + ".yaml")):
                    argv.append("~model.pipeline_cuts")  # cuts for 80 layers on 4 stages: see the pipeline test
                self.assert_trained(self.train(argv), run_dir)

    def test_nxdt_pipeline_cuts_name_the_last_layer_of_a_stage(self):
        # hf_llama3_70B_trn2 cuts its 80 layers after model.layers.18, .39 and .60 (NxD's partition(): the
        # named layer ends its stage). Shrunk to 4 layers on 2 stages, ending stage 0 after model.layers.0.
        name = "hf_llama3_70B_trn2_config"
        argv = self.shrunk(name, "pp", devices=2, pp=2) + ["~data.train_dir", "+data.data_prefix=[1.0,data/tok]",
                                                           "model.pipeline_cuts=[model.layers.0]", "exp_manager.save_xser=False"]
        p = self.train(argv, ranks=2)
        self.assert_trained(p, "pp")
        tag = glob.glob(os.path.join(self.dir, "pp", "checkpoints", "*.ckpt"))[0]
        layers = {}
        for stage in (0, 1):
            (f,) = glob.glob(os.path.join(tag, "model", f"*pp_rank_{stage:02d}*.pt"))
            names = torch.load(f, map_location="cpu").keys()
            layers[stage] = sorted({int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in names if "layers." in n})
        self.assertEqual(layers, {0: [0], 1: [1, 2, 3]})
        # NxDT's names on an NxDT megatron model are language_model.encoder.layers.N; the HF name is refused there.
        p = self.train(self.shrunk("megatron_llama_7B_config", "bad_cut", devices=2, pp=2) + ["+model.pipeline_cuts=[model.layers.0]"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("is neither a layer number nor 'language_model.encoder.layers.N' (NxDT's form)", p.stderr)

    def test_the_issues_cases_by_override(self):
        # Issue #35: virtual pipeline under both spellings, context parallelism, MoE, DPO on a config that trains.
        cases = [
            (["distributed_strategy.virtual_pipeline_model_parallel_size=2"], "distributed_strategy.virtual_pipeline_model_parallel_size: 2"),
            (["+model.virtual_pipeline_model_parallel_size=2"], "model.virtual_pipeline_model_parallel_size: 2"),
            (["+distributed_strategy.context_parallel_size=2"], "distributed_strategy.context_parallel_size: 2"),
            (["+model.moe.num_experts=8", "+model.moe.routing_algorithm=sinkhorn"], "model.moe.routing_algorithm: 'sinkhorn': Sinkhorn"),
            (["+model_alignment_strategy.dpo.kl_beta=0.1"], "model_alignment_strategy.dpo: DPO"),
            (["precision.type=bf16SR"], "precision.type: 'bf16SR': a precision other than fp32 and mixed_precision"),
            (["+model.frobnicate=1"], "model.frobnicate: not a key shardkit knows"),
            (["data.eod_mask_loss=True"], "data.eod_mask_loss: True: masks end-of-document tokens out of the loss"),
        ]
        for i, (overrides, message) in enumerate(cases):
            with self.subTest(message):
                p = self.train(self.shrunk("megatron_llama_7B_config", f"bad{i}") + overrides)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertFalse(os.path.exists(os.path.join(self.dir, f"bad{i}")))


if __name__ == "__main__":
    unittest.main()

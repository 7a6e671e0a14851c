"""Writes the README walkthrough's sample data (run from the repository root):

    python3 tests/data/sample/make_sample.py

- `nnm_tiny_llama.yaml`: NNM's own example config (tests/data/configs/
  megatron_llama_config.yaml, from neuronx-nemo-megatron f4743ce) with a tiny
  Llama's sizes (conf/tiny_llama.yaml's: 2 layers, hidden 64, 4 heads), tp 2,
  pp 2 on 4 devices, and the walkthrough's data and tokenizer;
- `nnm_tiny_llama/`: an NNM checkpoint of that model as NNM saves one at tp 2
  pp 2 (tp_rank_XX_pp_rank_XXX/<name>.ckpt, with AdamW state, the LR schedule,
  step 3 and 24 consumed samples; three steps of random gradients), written by
  tests/interop/nnm_fixture.py,
  whose layout the interop tests check against NNM's grouping and converter.

The files are committed; CI does not run this script. The vocabulary is the
byte tokenizer's 264 ids, padded to 272 rows at tp 2 as NNM pads
(make_vocab_size_divisible_by 8 x tp 2).
"""
import os
import shutil
import sys

from omegaconf import OmegaConf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "interop"))
from nnm_fixture import lr_scheduler_state, make_nnm  # noqa: E402

cfg = OmegaConf.load(os.path.join(HERE, "..", "configs", "megatron_llama_config.yaml"))
cfg.name = "tiny_llama"
cfg.trainer.devices = 4
cfg.trainer.max_steps = 40
cfg.trainer.val_check_interval = 40
cfg.exp_manager.checkpoint_callback_params.every_n_train_steps = 20
m = cfg.model
m.micro_batch_size, m.global_batch_size = 4, 8
m.tensor_model_parallel_size, m.pipeline_model_parallel_size = 2, 2
m.encoder_seq_length, m.num_layers, m.hidden_size, m.ffn_hidden_size = 64, 2, 64, 172
m.num_attention_heads, m.init_method_std = 4, 0.02
m.tokenizer = {"library": "byte"}
m.data.data_prefix = [1.0, "data/text_document"]
m.optim.lr, m.optim.sched.warmup_steps, m.optim.sched.constant_steps, m.optim.sched.min_lr = 3e-3, 2, 0, 3e-4
OmegaConf.save(cfg, os.path.join(HERE, "nnm_tiny_llama.yaml"))

out = os.path.join(HERE, "nnm_tiny_llama")
shutil.rmtree(out, ignore_errors=True)
c = dict(hidden=64, ffn=172, heads=4, kv_heads=4, layers=2, vocab=272, seq=64, gpt=False)
sched = lr_scheduler_state(3, 3e-3, 2, 0, 40, 3e-4)
# Three AdamW steps of one process, then cut as NNM saves the same run at tp 2
# pp 2 (so replicated norms are equal on every tp rank, as NNM keeps them).
full, _ = make_nnm(None, c, steps=3, step=3, gbs=8, lr=3e-3, weight_decay=0.01, sched=sched, seed=7, write=False)
make_nnm(out, c, tp=2, pp=2, step=3, gbs=8, lr=3e-3, weight_decay=0.01, sched=sched, from_full=full[(0, 0)])
print("wrote", out, "and nnm_tiny_llama.yaml")

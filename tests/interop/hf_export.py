"""ckpt-export --format hf against a Hugging Face-convention model written here.

train_reference_dump builds a small model from its seed, writes its weights
(NxDT names) and the logits the training core computes for a batch. The
weights become a tag (as NxD lays one out, no manifest), ckpt-export writes
the Hugging Face folder, and the forwards below, written from HF's published
modeling rules (not from shardkit's code), load the exported .bin and must
give the training core's logits:
  - LlamaForCausalLM (transformers' modeling_llama.py): q/k/v/o projections,
    rotate_half RoPE with inv_freq = 1 / theta^(2i/d), repeat_kv for GQA,
    RMSNorm, SwiGLU down(silu(gate(x)) * up(x)), lm_head;
  - GPT2LMHeadModel (modeling_gpt2.py): Conv1D (x @ W + b, W stored
    [in, out]), c_attn split into q, k, v over all heads, LayerNorm,
    activation "gelu" (erf), learned positions, lm_head tied to wte.
The safetensors files are parsed by hand (8-byte header length, JSON header,
offsets) and must hold the same tensors; a sharded export's index must map
every tensor to the shard that holds it.
"""
import json
import math
import os
import shutil
import struct
import subprocess
import unittest

import numpy as np
import torch

from canon import BIN, EXPORT, IMPORT, TOKENIZE, TRAIN, TRAIN_DUMP, TempDirTest, VERIFY

RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def rms_norm(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def causal_attention(q, k, v):
    T, hd = q.shape[-2], q.shape[-1]
    att = q @ k.transpose(-2, -1) / math.sqrt(hd)
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return torch.softmax(att, dim=-1) @ v


def llama_logits(sd, cfg, tokens):
    H, nh, G, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    hd, eps = H // nh, cfg["rms_norm_eps"]
    B, T = tokens.shape
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms_norm(x, sd[p + "input_layernorm.weight"], eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, G, hd).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, G, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // G, dim=1), v.repeat_interleave(nh // G, dim=1)  # repeat_kv
        a = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, H)
        x = x + a @ sd[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, sd["model.norm.weight"], eps)
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return x @ head.T


def gpt2_logits(sd, cfg, tokens):
    H, nh, L, eps = cfg["n_embd"], cfg["n_head"], cfg["n_layer"], cfg["layer_norm_epsilon"]
    self_ = cfg["activation_function"]
    assert self_ == "gelu"
    hd = H // nh
    B, T = tokens.shape
    ln = lambda x, n: torch.nn.functional.layer_norm(x, (H,), sd[n + ".weight"], sd[n + ".bias"], eps)
    conv1d = lambda x, n: x @ sd[n + ".weight"] + sd[n + ".bias"]
    x = sd["transformer.wte.weight"][tokens] + sd["transformer.wpe.weight"][torch.arange(T)]
    for i in range(L):
        p = f"transformer.h.{i}."
        q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(H, dim=2)
        heads = lambda t: t.view(B, T, nh, hd).transpose(1, 2)
        a = causal_attention(heads(q), heads(k), heads(v)).transpose(1, 2).reshape(B, T, H)
        x = x + conv1d(a, p + "attn.c_proj")
        m = torch.nn.functional.gelu(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc"))
        x = x + conv1d(m, p + "mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    head = sd["transformer.wte.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return x @ head.T


def read_safetensors(path):
    """{name: tensor} parsed by hand from the format's definition."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    assert (8 + n) % 8 == 0, "the data start is 8-byte aligned"
    body = data[8 + n:]
    dtypes = {"F32": (np.float32, torch.float32), "BF16": (np.int16, torch.bfloat16), "F16": (np.float16, torch.float16)}
    out, end = {}, 0
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, t = e["data_offsets"]
        self_np, self_t = dtypes[e["dtype"]]
        a = torch.from_numpy(np.frombuffer(body[b:t], dtype=self_np).copy()).reshape(e["shape"])
        out[name] = a.view(self_t) if self_t == torch.bfloat16 else a
        end = max(end, t)
    assert end == len(body), "no bytes past the last tensor"
    return out, header


class HfExport(TempDirTest):
    def setUp(self):
        super().setUp()
        for tool in (EXPORT, TRAIN_DUMP):
            # A missing binary is a failure, never a skip: a wrong SHARDKIT_BIN must not pass.
            self.assertTrue(os.path.exists(tool), f"{tool} is not built")

    def dump_tag(self, *flags):
        """The reference model's weights as a tag, and the logits it computed."""
        d = os.path.join(self.dir, "dump")
        os.makedirs(d, exist_ok=True)
        subprocess.run([TRAIN_DUMP, d, *flags], check=True, capture_output=True)
        result = torch.load(os.path.join(d, "result.pt"))
        tag = os.path.join(self.dir, "step_0")
        os.makedirs(os.path.join(tag, "model"))
        shutil.copy(os.path.join(d, "weights.pt"), os.path.join(tag, "model", RANK_FILE))
        for marker in ("checkpoint", "done"):
            with open(os.path.join(tag, marker), "w") as f:
                f.write("1")
        c = result["config"]
        fmt = ["--heads", c["heads"], "--kv_heads", c["kv_heads"], "--vocab_size", c["vocab"], "--make_vocab_size_divisible_by", 1]
        return tag, result, [str(x) for x in fmt]

    def export(self, tag, fmt, *extra):
        out = os.path.join(self.dir, "hf")
        r = subprocess.run([EXPORT, tag, out, "--format", "hf", *fmt, *extra], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "config.json")) as f:
            return out, json.load(f)

    def check_logits(self, flags, forward, arch):
        tag, result, fmt = self.dump_tag(*flags)
        out, cfg = self.export(tag, fmt, "--bin")
        self.assertEqual(cfg["architectures"], [arch])
        sd = torch.load(os.path.join(out, "pytorch_model.bin"))
        got = forward({k: v.float() for k, v in sd.items()}, cfg, result["tokens"].long())
        want = result["logits"]
        self.assertEqual(got.shape, want.shape)
        err = (got - want).abs().max().item()
        self.assertLess(err, 1e-5, f"max |logit difference| {err}")
        # The safetensors file holds the same tensors.
        st, header = read_safetensors(os.path.join(out, "model.safetensors"))
        self.assertEqual(list(st), list(sd))
        self.assertEqual(header["__metadata__"], {"format": "pt"})
        for k in sd:
            self.assertEqual(st[k].dtype, sd[k].dtype, k)
            self.assertTrue(torch.equal(st[k], sd[k]), k)
        return tag, fmt, sd

    def test_llama_logits(self):
        self.check_logits([], llama_logits, "LlamaForCausalLM")

    def test_llama_gqa_logits(self):
        _, _, sd = self.check_logits(["--kv-heads", "2"], llama_logits, "LlamaForCausalLM")
        self.assertEqual(tuple(sd["model.layers.0.self_attn.k_proj.weight"].shape), (16, 32))

    def test_llama_rope_theta_and_eps_are_the_trained_models(self):
        # Llama-3's rope base and another epsilon: config.json says what the model was trained with.
        tag, result, fmt = self.dump_tag("--rope-theta", "500000", "--eps", "1e-6")
        out, cfg = self.export(tag, fmt + ["--rope_theta", "500000", "--layernorm_epsilon", "1e-6"], "--bin")
        self.assertEqual((cfg["rope_theta"], cfg["rms_norm_eps"]), (500000.0, 1e-6))
        sd = {k: v.float() for k, v in torch.load(os.path.join(out, "pytorch_model.bin")).items()}
        tokens = result["tokens"].long()
        err = (llama_logits(sd, cfg, tokens) - result["logits"]).abs().max().item()
        self.assertLess(err, 1e-5)
        # The defaults would describe another model: the difference the test guards is far above its tolerance.
        wrong = dict(cfg, rope_theta=10000.0, rms_norm_eps=1e-5)
        self.assertGreater((llama_logits(sd, wrong, tokens) - result["logits"]).abs().max().item(), 1e-4)
        # Without the hints a tag that records neither says what it assumed.
        shutil.rmtree(out)
        r = subprocess.run([EXPORT, tag, out, "--format", "hf", *fmt], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("rope_theta 10000 assumed", r.stderr)

    def test_a_trained_tag_records_what_the_export_needs(self):
        # shardkit-train records the rotary base (NxDT megatron's position_freq_base), the epsilon and
        # the sequence length in the manifest; the export takes them from there.
        os.makedirs(os.path.join(self.dir, "data"))
        subprocess.run([TOKENIZE, "/usr/share/common-licenses/GPL-3", os.path.join(self.dir, "data", "text_document")], check=True,
                       capture_output=True)
        conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf", "tiny_llama.yaml")
        subprocess.run([TRAIN, conf, "exp_manager.explicit_log_dir=run", "trainer.max_steps=1", "+model.position_freq_base=500000",
                        "model.layernorm_epsilon=1e-6"], cwd=self.dir, check=True, capture_output=True)
        tag = os.path.join(self.dir, "run", "checkpoints")
        out, cfg = self.export(tag, [])
        self.assertEqual((cfg["rope_theta"], cfg["rms_norm_eps"], cfg["max_position_embeddings"]), (500000.0, 1e-6, 64))

    def test_partial_rotary_is_refused(self):
        tag, _, fmt = self.dump_tag("--rotary", "0.5")
        out = os.path.join(self.dir, "hf")
        r = subprocess.run([EXPORT, tag, out, "--format", "hf", *fmt, "--rotary_percentage", "0.5"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("rotary_percentage is 0.5", r.stderr)
        self.assertFalse(os.path.exists(out))

    def test_safetensors_only_by_default(self):
        # As transformers saves: no second copy of the weights unless --bin asks for torch's format.
        tag, _, fmt = self.dump_tag()
        out, _ = self.export(tag, fmt)
        self.assertEqual(sorted(os.listdir(out)), ["config.json", "model.safetensors"])

    def test_gpt2_logits(self):
        self.check_logits(["--gpt"], gpt2_logits, "GPT2LMHeadModel")

    def test_bf16_shards_and_index(self):
        tag, result, fmt = self.dump_tag("--mixed")
        whole, _ = self.export(tag, fmt, "--bin")
        one = torch.load(os.path.join(whole, "pytorch_model.bin"))
        self.assertEqual(one["model.norm.weight"].dtype, torch.bfloat16)
        shards = os.path.join(self.dir, "sharded")
        r = subprocess.run([EXPORT, tag, shards, "--format", "hf", *fmt, "--max_shard_size", "20K", "--bin"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        for index, stem, load in (("pytorch_model.bin.index.json", "pytorch_model-", torch.load),
                                  ("model.safetensors.index.json", "model-", lambda p: read_safetensors(p)[0])):
            with open(os.path.join(shards, index)) as f:
                idx = json.load(f)
            files = sorted({v for v in idx["weight_map"].values()})
            self.assertGreater(len(files), 1)
            self.assertTrue(all(x.startswith(stem) and f"-of-{len(files):05d}." in x for x in files), files)
            merged = {}
            for x in files:
                part = load(os.path.join(shards, x))
                for k in part:
                    self.assertEqual(idx["weight_map"][k], x)
                merged.update(part)
            self.assertEqual(sorted(merged), sorted(one))
            self.assertEqual(idx["metadata"]["total_size"], sum(t.numel() * t.element_size() for t in one.values()))
            for k in one:
                self.assertTrue(torch.equal(merged[k], one[k]), k)

    def import_back(self, flags, layout, drop):
        """Export to HF, drop one weights format, import at `layout`: the same logical weights."""
        tag, _, fmt = self.dump_tag(*flags)
        out, _ = self.export(tag, fmt, "--bin")
        for name in os.listdir(out):
            if name.startswith(drop):
                os.remove(os.path.join(out, name))
        dst = os.path.join(self.dir, "imported.ckpt")
        r = subprocess.run([IMPORT, "--format", "hf", out, dst, *layout, "--make_vocab_size_divisible_by", "8"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(os.path.join(dst, "optim")))
        with open(os.path.join(dst, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual((m["grid"]["tp"], m["grid"]["pp"]), (int(layout[1]), int(layout[3])))
        v = subprocess.run([VERIFY, dst, "--against", tag, *fmt], capture_output=True, text=True)
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
        return dst

    def test_hf_import_llama_gqa_from_safetensors_at_tp2_pp2(self):
        self.import_back(["--kv-heads", "2"], ["--tp", "2", "--pp", "2"], "pytorch_model")

    def test_hf_import_gpt2_from_bin_at_tp2(self):
        self.import_back(["--gpt"], ["--tp", "2", "--pp", "1"], "model.safetensors")

    def test_hf_import_memory_does_not_grow_with_the_model(self):
        # 192 MiB of float32 weights imported with peak RSS under half of that: the mapped input's
        # pages are released as each chunk is written (before, the whole model stayed resident).
        from bad_input import hf_tensors, write_safetensors
        cfg = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=4,
                   vocab_size=8000)
        src = os.path.join(self.dir, "hfmodel")
        os.makedirs(src)
        tensors = hf_tensors(cfg)
        size = sum(t.numel() * 4 for t in tensors.values())
        write_safetensors(os.path.join(src, "model.safetensors"), tensors)
        del tensors
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama"), f)
        # The tool's own VmHWM (--json): a child's ru_maxrss would carry over this torch-holding process's.
        r = subprocess.run([IMPORT, "--format", "hf", src, os.path.join(self.dir, "t"), "--tp", "2", "--pp", "2", "--memory_budget", "64M",
                            "--json"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        peak = json.loads(r.stdout)["peak_rss"]
        self.assertGreater(size, 190 << 20)
        self.assertLess(peak, size / 2, f"peak RSS {peak >> 20} MiB for {size >> 20} MiB of weights")

    def test_hf_import_refuses_what_it_cannot_hold(self):
        tag, _, fmt = self.dump_tag()
        out, cfg = self.export(tag, fmt)
        dst = os.path.join(self.dir, "x.ckpt")
        for what, edit, pattern in (
                ("arch", lambda c: c.update(architectures=["MistralForCausalLM"]), r"architecture 'MistralForCausalLM'"),
                ("shape", lambda c: c.update(intermediate_size=c["intermediate_size"] * 2), r"tensor 'model.layers.0.mlp.gate_proj.weight' is"),
                ("bias", lambda c: c.update(attention_bias=True), r"a Llama with biases")):
            bad = dict(cfg)
            edit(bad)
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(bad, f)
            r = subprocess.run([IMPORT, "--format", "hf", out, dst, "--tp", "1", "--pp", "1"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, what + ": " + r.stderr)
            self.assertRegex(r.stderr, pattern)
            self.assertFalse(os.path.exists(dst), what)

    def test_unsupported_architecture_is_refused(self):
        tag, _, fmt = self.dump_tag("--bias")  # llama-style with biases: no HF class holds it as is
        out = os.path.join(self.dir, "hf")
        r = subprocess.run([EXPORT, tag, out, "--format", "hf", *fmt], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("no Hugging Face architecture takes its weights", r.stderr)
        self.assertFalse(os.path.exists(out))
        self.assertEqual([n for n in os.listdir(self.dir) if "partial" in n], [])


if __name__ == "__main__":
    unittest.main()

"""The training core's forward and backward against PyTorch (llm.c's test_gpt2
in spirit): the same Megatron Llama in torch, built from the weights the C++
core wrote, on the same batch; logits, loss and every parameter gradient must
agree to fp32 precision."""
import os
import unittest

import torch

from canon import TRAIN_DUMP, TempDirTest, run

REL_TOL = 1e-4


def rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, rot):
    """Megatron's non-interleaved rotary embedding on the first `rot` dims; x: [B, h, T, hd]."""
    T = x.shape[2]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], -1).float()
    cos, sin = emb.cos(), emb.sin()
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rotated * sin, xp], -1)


def forward(params, cfg, tokens):
    B, T = tokens.shape
    H, nh, G, L = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["layers"]
    hd = H // nh
    p = lambda n: params[n]
    x = p("language_model.embedding.word_embeddings.weight")[tokens]
    for l in range(L):
        pre = f"language_model.encoder.layers.{l}."
        h = rms_norm(x, p(pre + "input_layernorm.weight"))
        if G == nh:  # fused per-head [q_h; k_h; v_h]
            qkv = (h @ p(pre + "self_attention.query_key_value.weight").T).view(B, T, nh, 3, hd)
            q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        else:  # query, and key_value as per-group [k_g; v_g]
            q = (h @ p(pre + "self_attention.query.weight").T).view(B, T, nh, hd)
            kv = (h @ p(pre + "self_attention.key_value.weight").T).view(B, T, G, 2, hd)
            k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
        q, k = rope(q, cfg["rotary_dim"]), rope(k, cfg["rotary_dim"])
        if G != nh:
            k = k.repeat_interleave(nh // G, dim=1)
            v = v.repeat_interleave(nh // G, dim=1)
        scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, H)
        x = x + y @ p(pre + "self_attention.dense.weight").T
        h = rms_norm(x, p(pre + "post_attention_layernorm.weight"))
        gate, up = (h @ p(pre + "mlp.dense_h_to_4h.weight").T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ p(pre + "mlp.dense_4h_to_h.weight").T
    x = rms_norm(x, p("language_model.encoder.final_layernorm.weight"))
    return x @ p("language_model.output_layer.weight").T


class TrainingCoreMatchesTorch(TempDirTest):
    def check(self, *flags):
        run(TRAIN_DUMP, self.dir, *flags)
        params = torch.load(os.path.join(self.dir, "weights.pt"), weights_only=True)
        res = torch.load(os.path.join(self.dir, "result.pt"), weights_only=True)
        params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        tokens, targets = res["tokens"].long(), res["targets"].long()
        logits = forward(params, res["config"], tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()

        def close(name, ours, ref):
            err = (ours - ref).abs().max().item()
            scale = ref.abs().max().item()
            self.assertLessEqual(err, REL_TOL * max(scale, 1e-6), f"{name}: max error {err:g} vs scale {scale:g}")

        close("logits", res["logits"], logits.detach())
        close("loss", res["loss"], loss.detach())
        self.assertEqual(sorted(res["grads"]), sorted(params))
        for name, p in params.items():
            close(name, res["grads"][name], p.grad)
        return loss.item()

    def test_mha_fused_qkv(self):
        self.check()

    def test_gqa_query_and_key_value(self):
        self.check("--kv-heads", "2")

    def test_partial_rotary(self):
        self.check("--rotary", "0.5")


if __name__ == "__main__":
    unittest.main()

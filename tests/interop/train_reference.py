"""The training core's forward and backward against PyTorch (llm.c's test_gpt2
in spirit): the same Megatron Llama in torch, built from the weights the C++
core wrote, on the same batch; logits, loss and every parameter gradient must
agree to fp32 precision."""
import math
import os
import unittest

import numpy as np
import torch

from canon import TRAIN_DUMP, TempDirTest, run
from megatron_partition import nxdt_order

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


def dropout_keep(key, site, n, p):
    """The training core's dropout mask (libtrain/layers.h): element i of the stream
    of (key, site) is kept when the top 24 bits of splitmix64(stream + i) reach p."""
    def mix(z):
        with np.errstate(over="ignore"):
            z = z + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return z ^ (z >> np.uint64(31))

    stream = mix(mix(np.array([key], dtype=np.uint64)) ^ np.uint64(site))
    with np.errstate(over="ignore"):
        u = (mix(stream + np.arange(n, dtype=np.uint64)) >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    return torch.from_numpy(u >= np.float32(p))


def dropout(key, p):
    """drop(x, layer, site): Megatron-placed dropout with the core's masks; layer -1 is the embeddings."""
    def drop(x, layer, site):
        if p == 0:
            return x
        s = (1 << 64) - 1 if layer < 0 else layer * 4 + site
        return x * dropout_keep(key, s, x.numel(), p).view(x.shape) / (1 - np.float32(p))
    return drop


def forward(params, cfg, tokens, drop=lambda x, layer, site: x, mlp=None):
    """Megatron's decoder: Llama style by default; LayerNorm, GeLU, biases (present in params),
    learned positions (when their table is present) and a tied output layer by cfg; `drop`
    applies dropout where Megatron does; `mlp(h, layer)`, when given, is every layer's MLP
    block (an MoE layer: benchmarks/train_moe.py)."""
    B, T = tokens.shape
    H, nh, G, L = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["layers"]
    hd = H // nh
    p = lambda n: params[n]

    def norm(x, prefix):
        if cfg.get("layernorm"):
            return torch.nn.functional.layer_norm(x, (H,), p(prefix + ".weight"), p(prefix + ".bias"), 1e-5)
        return rms_norm(x, p(prefix + ".weight"))

    def linear(x, prefix):
        y = x @ p(prefix + ".weight").T
        return y + p(prefix + ".bias") if prefix + ".bias" in params else y

    x = p("language_model.embedding.word_embeddings.weight")[tokens]
    if "language_model.embedding.position_embeddings.weight" in params:
        x = x + p("language_model.embedding.position_embeddings.weight")[:T]
    x = drop(x, -1, 0)
    for l in range(L):
        pre = f"language_model.encoder.layers.{l}."
        h = norm(x, pre + "input_layernorm")
        if G == nh:  # fused per-head [q_h; k_h; v_h]
            qkv = linear(h, pre + "self_attention.query_key_value").view(B, T, nh, 3, hd)
            q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        else:  # query, and key_value as per-group [k_g; v_g]
            q = linear(h, pre + "self_attention.query").view(B, T, nh, hd)
            kv = linear(h, pre + "self_attention.key_value").view(B, T, G, 2, hd)
            k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
        if cfg["rotary_dim"]:
            q, k = rope(q, cfg["rotary_dim"]), rope(k, cfg["rotary_dim"])
        if G != nh:
            k = k.repeat_interleave(nh // G, dim=1)
            v = v.repeat_interleave(nh // G, dim=1)
        scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        att = drop(scores.masked_fill(mask, float("-inf")).softmax(-1), l, 0)
        y = (att @ v).transpose(1, 2).reshape(B, T, H)
        x = x + drop(linear(y, pre + "self_attention.dense"), l, 1)
        h = norm(x, pre + "post_attention_layernorm")
        if mlp:
            x = x + drop(mlp(h, l), l, 3)
            continue
        if cfg.get("gelu"):
            act = torch.nn.functional.gelu(linear(h, pre + "mlp.dense_h_to_4h"))
        else:
            gate, up = linear(h, pre + "mlp.dense_h_to_4h").chunk(2, -1)
            act = torch.nn.functional.silu(gate) * up
        x = x + drop(linear(drop(act, l, 2), pre + "mlp.dense_4h_to_h"), l, 3)
    x = norm(x, "language_model.encoder.final_layernorm")
    out = "language_model.embedding.word_embeddings.weight" if cfg.get("tied") else "language_model.output_layer.weight"
    return x @ p(out).T


EMB = "language_model.embedding.word_embeddings.weight"
OUT = "language_model.output_layer.weight"


def nxdt_groups(params, names, decay_norms=False):
    """torch AdamW groups as NxDT's megatron models build them (NeMo's rule:
    megatron_partition.nxdt_order), weight decay 0 in the group of biases. A
    tied parameter is listed once: updated once with its summed gradient, as
    the training core does (NeMo lists it under both names, and torch's plain
    AdamW would then step it twice)."""
    order = nxdt_order(names, decay_norms)
    seen = set()
    groups = [{"params": []} for _ in range(2)]
    for n, gi in order:
        if id(params[n]) not in seen:
            seen.add(id(params[n]))
            groups[gi]["params"].append(params[n])
    groups = [g for g in groups if g["params"]]
    for gi, g in enumerate(groups):
        g["weight_decay"] = 0.1 if gi == 0 else 0.0
    return groups


def nemo_cosine(step, base, warmup, constant, max_steps, min_lr):
    """NeMo's CosineAnnealing (WarmupAnnealHoldPolicy) at 0-based step `step`."""
    decay = max_steps - (constant + warmup)

    def megatron(s):
        if warmup > 0 and s <= warmup:
            return base * s / warmup
        if s > warmup + decay:
            return min_lr
        return min_lr + 0.5 * (math.cos(math.pi * (s - warmup) / decay) + 1.0) * (base - min_lr)

    if warmup > 0 and step <= warmup:
        return megatron(step) if constant > 0 else base * (step + 1) / (warmup + 1)
    if constant > 0 and warmup + decay < step <= max_steps:
        return megatron(step)
    if step > max_steps:
        return min_lr
    if constant > 0:
        return megatron(step)
    return (base - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (max_steps - warmup))) + min_lr


def linear_with_warmup(step, base, warmup, max_steps):
    """NxDT's LinearAnnealingWithWarmUp (transformers' linear schedule with warmup)."""
    if step < warmup:
        return base * step / max(1, warmup)
    return base * max(0.0, (max_steps - step) / max(1, max_steps - warmup))


class TrainingCoreMatchesTorch(TempDirTest):
    def close(self, name, ours, ref, tol=REL_TOL):
        ours, ref = torch.as_tensor(ours).float(), torch.as_tensor(ref).float()
        err = (ours - ref).abs().max().item()
        scale = ref.abs().max().item()
        self.assertLessEqual(err, tol * max(scale, 1e-6), f"{name}: max error {err:g} vs scale {scale:g}")

    def load(self, *flags):
        run(TRAIN_DUMP, self.dir, *flags)
        params = torch.load(os.path.join(self.dir, "weights.pt"), weights_only=True)
        res = torch.load(os.path.join(self.dir, "result.pt"))
        params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        if res["config"]["tied"]:  # NxDT's GPT: one parameter under both names (NxDT gpt_model.py)
            self.assertTrue(torch.equal(params[OUT], params[EMB]))
            params[OUT] = params[EMB]
        return params, res

    def check(self, *flags, drop=lambda x, layer, site: x):
        params, res = self.load(*flags)
        tokens, targets = res["tokens"].long(), res["targets"].long()
        logits = forward(params, res["config"], tokens, drop)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        self.close("logits", res["logits"], logits.detach())
        self.close("loss", res["losses"][0], loss.detach())
        self.assertEqual(sorted(res["grads"]), sorted(params))
        for name, p in params.items():
            self.close(name, res["grads"][name], p.grad)

    def test_mha_fused_qkv(self):
        self.check()

    def test_gqa_query_and_key_value(self):
        self.check("--kv-heads", "2")

    def test_partial_rotary(self):
        self.check("--rotary", "0.5")

    def test_gpt_layernorm_gelu_biases_learned_positions_tied_output(self):
        params, _ = self.load("--gpt")
        self.assertIn("language_model.encoder.layers.1.mlp.dense_h_to_4h.bias", params)
        self.assertIn("language_model.encoder.final_layernorm.bias", params)
        self.assertEqual(params["language_model.embedding.position_embeddings.weight"].shape, (12, 32))
        self.assertEqual(params["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"].shape, (48, 32))  # unfused
        self.assertIs(params[OUT], params[EMB])  # written under both names, as NxDT's state_dict has it
        self.check("--gpt")

    def test_gpt_blocks_with_rope_gqa_and_untied_output(self):
        self.check("--layernorm", "--gelu", "--bias", "--kv-heads", "2")

    def test_dropout_at_megatrons_places_with_counter_based_masks(self):
        key, p = 12345, 0.25
        self.check("--gpt", "--dropout", str(p), "--dropout-key", str(key), drop=dropout(key, p))
        self.check("--kv-heads", "2", "--dropout", str(p), "--dropout-key", str(key), drop=dropout(key, p))
        keep = dropout_keep(key, 7, 100000, p).float().mean().item()
        self.assertAlmostEqual(keep, 1 - p, delta=0.01)

    def test_gpt_training_steps(self):
        self.train_steps(4, lambda s: nemo_cosine(s, 1e-2, 2, 0, 6, 1e-3), 0.5, "--gpt")

    def train_steps(self, steps, sched, clip, *flags, decay_norms=False):
        params, res = self.load("--steps", str(steps), "--clip", str(clip), *flags)
        names = list(params)
        groups = nxdt_groups(params, names, decay_norms)
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        tokens, targets = res["tokens"].long(), res["targets"].long()
        for step in range(steps):
            opt.zero_grad()
            logits = forward(params, res["config"], tokens)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], clip)  # each once
            lr = sched(step)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            self.close(f"loss at step {step}", res["losses"][step], loss.detach(), 1e-4)
            self.close(f"grad norm at step {step}", res["grad_norms"][step], norm, 1e-4)
            self.close(f"lr at step {step}", res["lrs"][step], lr, 1e-6)
        # Parameters and AdamW moments after the steps; optimizer ids count over group 0 then group 1.
        for n in names:
            self.close(f"{n} after {steps} steps", res["final"][n], params[n].detach(), 1e-3)
        # Ours number every name NxDT's groups list (a tied parameter under both), one id each.
        ours, ref = res["optim"], opt.state_dict()
        order = nxdt_order(names, decay_norms)
        want = [[i for i, (_, g) in enumerate(order) if g == gi] for gi in range(2)]
        self.assertEqual([g["params"] for g in ours["param_groups"]], [ids for ids in want if ids])
        self.assertEqual([g["weight_decay"] for g in ours["param_groups"]], [g["weight_decay"] for g in ref["param_groups"]])
        ref_pid = {id(q): i for i, q in enumerate(q for g in opt.param_groups for q in g["params"])}
        for pid, (n, _) in enumerate(order):
            st = ref["state"][ref_pid[id(params[n])]]
            self.assertEqual(float(ours["state"][pid]["step"]), float(st["step"]))
            self.close(f"exp_avg {n}", ours["state"][pid]["exp_avg"], st["exp_avg"], 1e-3)
            self.close(f"exp_avg_sq {n}", ours["state"][pid]["exp_avg_sq"], st["exp_avg_sq"], 1e-3)
        self.assertLess(res["losses"][-1].item(), res["losses"][0].item())

    def test_adamw_with_clipping_and_cosine_schedule(self):
        self.train_steps(6, lambda s: nemo_cosine(s, 1e-2, 2, 0, 6, 1e-3), 0.5)

    def test_cosine_schedule_with_constant_steps(self):
        self.train_steps(6, lambda s: nemo_cosine(s, 1e-2, 2, 2, 6, 1e-3), 1.0, "--constant", "2")

    def test_mixed_precision_bf16_params_fp32_master_weights(self):
        """NxDT's mixed_precision: bfloat16 parameters, float32 master weights and
        moments in ZeRO-1's layout; compute stays float32 here, as in torch below."""
        steps, clip = 3, 0.5
        run(TRAIN_DUMP, self.dir, "--mixed", "--steps", str(steps), "--clip", str(clip))
        weights = torch.load(os.path.join(self.dir, "weights.pt"), weights_only=True)
        res = torch.load(os.path.join(self.dir, "result.pt"))
        self.assertEqual({v.dtype for v in weights.values()}, {torch.bfloat16})
        names = list(weights)
        master = {n: weights[n].float().clone() for n in names}  # the master weights start as the bf16 values
        groups = nxdt_groups(master, names)
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        bf16 = dict(weights)
        tokens, targets = res["tokens"].long(), res["targets"].long()
        for step in range(steps):
            compute = {n: bf16[n].float().requires_grad_(True) for n in names}
            logits = forward(compute, res["config"], tokens)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(list(compute.values()), clip)
            for n in names:
                master[n].grad = compute[n].grad
            lr = nemo_cosine(step, 1e-2, 2, 0, 6, 1e-3)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            bf16 = {n: master[n].bfloat16() for n in names}
            self.close(f"loss at step {step}", res["losses"][step], loss.detach(), 1e-4)
            self.close(f"grad norm at step {step}", res["grad_norms"][step], norm, 1e-4)
        ours = res["optim"]
        self.assertEqual(ours["state"], {})
        self.assertEqual([g["params"] for g in ours["param_groups"]], [g["params"] for g in opt.state_dict()["param_groups"]])
        ref_state = opt.state_dict()["state"]
        order = [n for n, _ in nxdt_order(names, False)]  # optimizer ids: group 0, then group 1
        for pid, n in enumerate(order):
            self.assertEqual(ours["shape_info"][pid], list(weights[n].shape))  # a list, as NxD writes it
            self.assertIsInstance(ours["shape_info"][pid], list)
            m = ours["sharded_master_weights"][pid]
            self.assertEqual(m.dtype, torch.float32)
            self.close(f"master weight {n}", m, master[n].detach(), 1e-3)
            self.close(f"exp_avg {n}", ours["base_state"][pid]["exp_avg"], ref_state[pid]["exp_avg"], 1e-3)
            self.close(f"exp_avg_sq {n}", ours["base_state"][pid]["exp_avg_sq"], ref_state[pid]["exp_avg_sq"], 1e-3)
            self.assertEqual(float(ours["base_state"][pid]["step"]), float(steps))
            # Our bf16 parameters are exactly torch's rounding of our own master weights ...
            final = res["final"][n]
            self.assertEqual(final.dtype, torch.bfloat16)
            self.assertTrue(torch.equal(final.view(torch.int16), m.bfloat16().view(torch.int16)), n)
            # ... and rounding two nearby masters moves them apart by at most their distance plus one bf16 step.
            diff = (final.float() - bf16[n].float()).abs()
            bound = (m - master[n].detach()).abs() + torch.maximum(m.abs(), master[n].detach().abs()) * 2 ** -7
            self.assertTrue(bool((diff <= bound).all()), n)
        self.assertLess(res["losses"][-1].item(), res["losses"][0].item())

    def test_linear_annealing_with_warmup_and_one_param_group(self):
        self.train_steps(5, lambda s: linear_with_warmup(s, 1e-2, 2, 6), 1.0, "--sched", "LinearAnnealingWithWarmUp",
                         "--decay-norms", decay_norms=True)


if __name__ == "__main__":
    unittest.main()

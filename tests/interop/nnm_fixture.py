"""NNM checkpoints made by torch as FORMATS.md §3 describes them, for the
converter's tests and benchmark.

Each (tp, pp) rank is a megatron-style torch module holding its local
tensor-parallel slices and its stage's layers (numbered locally). Its
optimizer is a real torch.optim.AdamW over NeMo's two parameter groups, built
the way NeMo builds them (by module type: norms, and biases, do not decay),
and stepped, so the state and its ids are what torch produces. Alongside each
rank the fixture records what an NxDT checkpoint of it must hold: global
parameter names and, per NNM optimizer id, the parameter it belongs to.
"""
import math
import os
import sys
import types

import torch
from torch import nn


class Norm(nn.Module):  # NNM's MixedFusedRMSNorm / MixedFusedLayerNorm
    def __init__(self, h, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h) + 0.01 * torch.randn(h))
        if bias:
            self.bias = nn.Parameter(0.01 * torch.randn(h))


class Linear(nn.Module):
    def __init__(self, out, inp, bias):
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(out, inp))
        if bias:
            self.bias = nn.Parameter(0.01 * torch.randn(out))


class Weight(nn.Module):  # an embedding table
    def __init__(self, rows, cols):
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(rows, cols))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))


class CoreAttention(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(head_dim)


class Attention(nn.Module):
    def __init__(self, c, tp):
        super().__init__()
        H, hd, bias = c["hidden"], c["hidden"] // c["heads"], c["gpt"]
        if c["kv_heads"] == c["heads"]:
            self.query_key_value = Linear(3 * H // tp, H, bias)
        else:
            self.query = Linear(H // tp, H, bias)
            self.key_value = Linear(2 * c["kv_heads"] * hd // tp, H, bias)
        self.core_attention = CoreAttention(hd)
        self.dense = Linear(H, H // tp, bias)


class MLP(nn.Module):
    def __init__(self, c, tp):
        super().__init__()
        H, F, bias = c["hidden"], c["ffn"], c["gpt"]
        self.dense_h_to_4h = Linear((F if c["gpt"] else 2 * F) // tp, H, bias)
        self.dense_4h_to_h = Linear(H, F // tp, bias)


class Layer(nn.Module):
    def __init__(self, c, tp):
        super().__init__()
        self.input_layernorm = Norm(c["hidden"], c["gpt"])
        self.self_attention = Attention(c, tp)
        self.post_attention_layernorm = Norm(c["hidden"], c["gpt"])
        self.mlp = MLP(c, tp)


class Encoder(nn.Module):
    def __init__(self, c, tp, n_layers, last):
        super().__init__()
        self.layers = nn.ModuleList([Layer(c, tp) for _ in range(n_layers)])
        if last:
            self.final_layernorm = Norm(c["hidden"], c["gpt"])


class Embedding(nn.Module):
    def __init__(self, c, tp):
        super().__init__()
        self.word_embeddings = Weight(c["vocab"] // tp, c["hidden"])
        if c["gpt"]:
            self.position_embeddings = Weight(c["seq"], c["hidden"])


class LanguageModel(nn.Module):
    def __init__(self, c, tp, n_layers, first, last):
        super().__init__()
        if first:
            self.embedding = Embedding(c, tp)
        self.encoder = Encoder(c, tp, n_layers, last)
        if last and not c["gpt"]:
            self.output_layer = Weight(c["vocab"] // tp, c["hidden"])


class Chunk(nn.Module):
    """One model chunk of one rank, as NNM's GPTModel is: `language_model`,
    plus the tied `word_embeddings` copy on the last stage of a GPT model."""

    def __init__(self, c, tp, n_layers, first, last, pp):
        super().__init__()
        self.language_model = LanguageModel(c, tp, n_layers, first, last)
        if c["gpt"] and last and pp > 1:
            self.word_embeddings = Weight(c["vocab"] // tp, c["hidden"])


def nemo_param_groups(chunks):
    """NeMo's _get_params_for_weight_decay_optimization, by module type."""
    decay, no_decay = [], []
    for chunk in chunks:
        for m in chunk.modules():
            params = [(n, p) for n, p in m._parameters.items() if p is not None]
            if isinstance(m, Norm):
                no_decay += [p for _, p in params]
            else:
                decay += [p for n, p in params if n != "bias"]
                no_decay += [p for n, p in params if n == "bias"]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def split_layers(n_layers, parts):
    """Megatron's split: even, remainder to the last parts."""
    base, rem = divmod(n_layers, parts)
    return [base + (1 if i >= parts - rem else 0) for i in range(parts)]


def global_name(local_key, offset):
    """The NxDT name of a local key: layer index shifted by the chunk's offset."""
    parts = local_key.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            parts[i + 1] = str(int(parts[i + 1]) + offset)
            break
    return ".".join(parts)


class TensorReference:  # stands in for nemo.collections.nlp.parts.serialization.TensorReference
    def __init__(self, tid, shape, dtype):
        self.tid, self.shape, self.dtype = tid, shape, dtype


def _install_nemo_reference_class():
    name = "nemo.collections.nlp.parts.serialization"
    if name not in sys.modules:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        TensorReference.__module__ = name
        sys.modules[name].TensorReference = TensorReference


def save_xser(obj, path):
    """NNM's save_xser: tensors to <path>.tensors/tensor_<tid>.pt, references in <path>."""
    _install_nemo_reference_class()
    os.makedirs(path + ".tensors", exist_ok=True)
    count = [0]

    def swap(x):
        if isinstance(x, torch.Tensor):
            tid = count[0]
            count[0] += 1
            torch.save(x.detach().clone(), os.path.join(path + ".tensors", f"tensor_{tid}.pt"))
            return TensorReference(tid, x.shape, x.dtype)
        if isinstance(x, dict):
            return type(x)((k, swap(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(swap(v) for v in x)
        return x

    torch.save(swap(obj), path)


def lr_scheduler_state(step, base_lr, warmup, constant, max_steps, min_lr):
    """NeMo's CosineAnnealing scheduler state_dict after `step` steps."""
    return {"warmup_steps": warmup, "constant_steps": constant, "decay_steps": max_steps - warmup - constant,
            "min_lr": min_lr, "max_steps": max_steps, "base_lrs": [base_lr], "last_epoch": step,
            "_step_count": step + 1, "verbose": False, "_get_lr_called_within_step": False, "_last_lr": [base_lr]}


def make_nnm(root, c, tp=1, pp=1, vpp=1, zero1_dp=0, xser=False, steps=2, step=7, gbs=8, name="megatron_llama",
             last=True, seed=0, file_name=None, grads=None, lr=1e-3, weight_decay=0.1, lr_at=None, sched=None):
    """Writes an NNM checkpoint under `root` and returns what NxDT must hold:
    {(t, p): {"model": [(nxdt name, tensor)], "optim_names": [nxdt name per NNM id],
    "optimizer": state dict, "zero1": [per-dp dicts], "chunks": modules, "opt": the AdamW}}.

    c: hidden, ffn, heads, kv_heads, layers, vocab (padded), seq, gpt (bool).
    `grads(chunks, params, s)` may set real gradients for step s (default:
    random ones); `lr_at(s)` sets the learning rate of step s; `sched` is the
    lr_schedulers state to record."""
    torch.manual_seed(seed)
    consumed = float(step * gbs)
    if file_name is None:
        file_name = f"{name}--step={step}-consumed_samples={consumed}{'-last' if last else ''}.ckpt"
    per_part = split_layers(c["layers"], pp * vpp)  # chunk-major: (chunk 0: stages 0..pp-1), (chunk 1: ...)
    offsets = [sum(per_part[:i]) for i in range(len(per_part))]
    expected = {}
    for p in range(pp):
        for t in range(tp):
            torch.manual_seed(seed * 1000 + p * 100 + t)
            chunks, chunk_offsets = [], []
            for v in range(vpp):
                part = v * pp + p
                chunks.append(Chunk(c, tp, per_part[part], first=(part == 0), last=(part == pp * vpp - 1), pp=pp))
                chunk_offsets.append(offsets[part])
            groups = nemo_param_groups(chunks)
            opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
            params = [q for g in groups for q in g["params"]]
            for s in range(steps):
                if lr_at:
                    for g in opt.param_groups:
                        g["lr"] = lr_at(s)
                if grads:
                    grads(chunks, params, s)
                else:
                    for q in params:
                        q.grad = torch.randn_like(q)
                opt.step()
            # Names: the NxDT name of every parameter object, and the model in order.
            model, name_of = [], {}
            for v, chunk in enumerate(chunks):
                for k, x in chunk.state_dict(keep_vars=True).items():
                    g = global_name(k, chunk_offsets[v])
                    model.append((g, x.detach()))
                    name_of[id(x)] = g
            osd = opt.state_dict()
            entry = {"model": model, "optim_names": [name_of[id(q)] for q in params], "optimizer": osd,
                     "chunks": chunks, "opt": opt}
            ckpt = {"epoch": 0, "global_step": step, "pytorch-lightning_version": "1.8.6",
                    "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}, "state_dict": {}}},
                    "hparams_name": "cfg", "hyper_parameters": {"cfg": {"num_layers": c["layers"]}},
                    "lr_schedulers": [sched or lr_scheduler_state(step, 1e-3, 2, 0, 100, 1e-4)]}
            if vpp == 1:
                sd = {"model." + k: x for k, x in chunks[0].state_dict().items()}
                sd["untrained_buffer_names"] = ["language_model.encoder.layers.0.self_attention.core_attention.rotary_emb.inv_freq"]
                ckpt["state_dict"] = sd
            else:
                for v, chunk in enumerate(chunks):
                    ckpt[f"model{v}"] = chunk.state_dict()
            if zero1_dp:
                entry["zero1"] = [zero1_shard(osd, params, r, zero1_dp) for r in range(zero1_dp)]
            else:
                ckpt["optimizer_states"] = [osd]
            if tp == 1 and pp == 1:
                rank_dir = root
            elif pp == 1:
                rank_dir = os.path.join(root, f"mp_rank_{t:02d}")
            else:
                rank_dir = os.path.join(root, f"tp_rank_{t:02d}_pp_rank_{p:03d}")
            os.makedirs(rank_dir, exist_ok=True)
            path = os.path.join(rank_dir, file_name)
            (save_xser if xser else torch.save)(ckpt, path)
            for r in range(zero1_dp):
                stem = file_name[: -len(".ckpt")]
                zname = stem[: -len("-last")] + "-optimizer_states-last.ckpt" if stem.endswith("-last") else stem + "-optimizer_states.ckpt"
                zdir = os.path.join(rank_dir, "optim", f"dp_rank_{r:03d}")
                os.makedirs(zdir, exist_ok=True)
                (save_xser if xser else torch.save)(entry["zero1"][r], os.path.join(zdir, zname))
            expected[(t, p)] = entry
    return expected, file_name


def zero1_shard(osd, params, rank, dp):
    """torch-xla ZeRO-1's state of one data-parallel rank: each parameter's
    state zero-padded along dim 0 to a multiple of dp, chunk `rank` kept."""
    def shard(x):
        pad = (-x.shape[0]) % dp
        if pad:
            x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
        return x.chunk(dp)[rank].clone()

    base = {}
    for i, s in osd["state"].items():
        base[i] = {"step": s["step"], "exp_avg": shard(s["exp_avg"]), "exp_avg_sq": shard(s["exp_avg_sq"])}
    return {"state": {}, "param_groups": osd["param_groups"], "base_state": base,
            "shape_info": {i: q.shape for i, q in enumerate(params)}}


def nxdt_ids(names, no_decay):
    """NxDT's optimizer ids over a stage's parameters: decaying ones first,
    then norms and biases, each in model order."""
    order = [n for n in names if not no_decay[n]] + [n for n in names if no_decay[n]]
    return {n: i for i, n in enumerate(order)}

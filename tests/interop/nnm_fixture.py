"""NNM checkpoints made by torch as NNM writes them, for the converter's
tests and benchmark.

Each (tp, pp) rank is a megatron-style torch module holding its local
tensor-parallel slices and its stage's layers (numbered locally). Its
optimizer is a real torch.optim.AdamW over NNM's parameter groups, built the
way NNM builds them, and stepped, so the state and its ids are what torch
produces. Alongside each rank the fixture records what an NxDT checkpoint of
it must hold: global parameter names and, per NNM optimizer id, the parameter
and group it belongs to.

Where NNM decides by class, the fixture does too (sources are NNM's, the
aws-neuron/neuronx-nemo-megatron tree):
  - Weight-decay groups: get_params_for_weight_decay_optimization
    (nemo/collections/nlp/modules/common/megatron/utils.py) puts every
    parameter of a module that isinstance(FusedLayerNorm, FastLayerNorm,
    MixedFusedRMSNorm) (apex.normalization's classes) in the no-decay group,
    and of any other module only `bias`. Both groups are always returned.
  - NNM's Llama norm is apex.transformer.layers.layer_norm.FastRMSNorm,
    imported "as MixedFusedRMSNorm" in nemo/.../megatron/transformer.py; it
    derives from FusedRMSNormXLA, not from apex.normalization, so the check
    misses it: Llama norm weights decay and group 1 is empty.
  - GPT's MixedFusedLayerNorm subclasses apex.normalization's FusedLayerNorm,
    so GPT layernorms do not decay.
  - do_layer_norm_weight_decay: get_all_params_for_weight_decay_optimization,
    one group of everything.
  - ZeRO-1 (wrap_with_zero): Lightning's checkpoint["optimizer_states"] list is
    moved out as it is into optim/dp_rank_XXX/<stem>-optimizer_states[-last].ckpt
    (nemo/collections/nlp/parts/nlp_overrides.py,
    _remove_optimizer_states_from_checkpoint); element 0 is torch-xla
    ZeRO-1's state dict.
  - hyper_parameters: NeMo's ModelPT calls save_hyperparameters("cfg") on the
    model config, an omegaconf DictConfig, and Lightning pickles it as it is
    under checkpoint["hyper_parameters"]["cfg"] (with _parent back-references).
  - NNM asserts num_layers % pp == 0 (transformer.py) unless
    flexible_pipeline_parallel_stages is set; an uneven split is only written
    with that option, which hyper_parameters records.
"""
import math
import os
import sys
import types

import torch
from omegaconf import OmegaConf
from torch import nn

import megatron_partition


class FusedLayerNorm(nn.Module):  # apex.normalization
    def __init__(self, h, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h) + 0.01 * torch.randn(h))
        if bias:
            self.bias = nn.Parameter(0.01 * torch.randn(h))


class MixedFusedLayerNorm(FusedLayerNorm):  # apex.normalization; NNM's GPT layernorm
    pass


class FastLayerNorm(nn.Module):  # apex.contrib.layer_norm
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.bias = nn.Parameter(torch.zeros(h))


class MixedFusedRMSNorm(nn.Module):  # apex.normalization's RMSNorm (not what NNM builds)
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h) + 0.01 * torch.randn(h))


class FusedRMSNormXLA(nn.Module):  # apex.transformer.layers.layer_norm
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h) + 0.01 * torch.randn(h))


class FastRMSNorm(FusedRMSNormXLA):  # NNM's Llama norm ("as MixedFusedRMSNorm" in transformer.py)
    pass


# The classes get_params_for_weight_decay_optimization checks for.
APEX_NORM_CLASSES = (FusedLayerNorm, FastLayerNorm, MixedFusedRMSNorm)


def Norm(h, gpt):
    return MixedFusedLayerNorm(h) if gpt else FastRMSNorm(h)


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
    # NNM's CoreAttention holds rotary_emb only when position_embedding_type == 'rope'
    # (nemo/.../megatron/transformer.py, CoreAttention.__init__): Llama's, not GPT's learned positions.
    def __init__(self, head_dim, rope):
        super().__init__()
        if rope:
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
        self.core_attention = CoreAttention(hd, rope=not c["gpt"])
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


def nemo_param_groups(chunks, grouping="class"):
    """NNM's parameter groups over a rank's model chunks, in module order.

    "class": get_params_for_weight_decay_optimization, by module class;
    "one": get_all_params_for_weight_decay_optimization (do_layer_norm_weight_decay);
    "name": by name (bias, and modules named *norm), as other NeMo versions do."""
    if grouping == "one":
        return [{"params": [p for chunk in chunks for p in chunk.parameters()]}]
    decay, no_decay = [], []
    for chunk in chunks:
        if grouping == "class":
            for m in chunk.modules():
                params = [(n, p) for n, p in m._parameters.items() if p is not None]
                if isinstance(m, APEX_NORM_CLASSES):
                    no_decay += [p for _, p in params]
                else:
                    decay += [p for n, p in params if n != "bias"]
                    no_decay += [p for n, p in params if n == "bias"]
        else:
            assert grouping == "name", grouping
            for n, p in chunk.named_parameters():  # the same name rule NxDT uses
                (no_decay if megatron_partition.no_decay(n) else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def split_layers(n_layers, parts):
    """Megatron's split: even, remainder to the last parts."""
    base, rem = divmod(n_layers, parts)
    return [base + (1 if i >= parts - rem else 0) for i in range(parts)]


def global_name(local_key, offset):
    """The NxDT name of a local key: layer index shifted by the chunk's offset;
    Megatron-LM's tied copy on the last stage is NxDT's output layer."""
    if local_key == "word_embeddings.weight":
        return "language_model.output_layer.weight"
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
             last=True, seed=0, file_name=None, grads=None, lr=1e-3, weight_decay=0.1, lr_at=None, sched=None,
             grouping="class", write=True, from_full=None):
    """Writes an NNM checkpoint under `root` and returns what NxDT must hold:
    {(t, p): {"model": [(nxdt name, tensor)], "optim_names": [nxdt name per NNM id],
    "optim_groups": [group per NNM id], "optimizer": state dict, "zero1": [per-dp ZeRO-1 dicts],
    "chunks": modules, "opt": the AdamW}}.

    `grouping`: how NNM grouped the parameters (nemo_param_groups); `write`:
    False trains and returns without writing files; `from_full`: the entry
    of a one-rank run (tp=pp=1) whose trained weights and optimizer state are
    sharded into this layout instead of training, as NNM would have saved the
    same run at these degrees.

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
            groups = nemo_param_groups(chunks, grouping)
            opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
            params = [q for g in groups for q in g["params"]]
            for s in range(0 if from_full else steps):
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
            if c["gpt"] and pp == 1:  # NxDT's state_dict holds the tied embedding under the output layer's name too
                model.append(("language_model.output_layer.weight", dict(model)["language_model.embedding.word_embeddings.weight"]))
            osd = shard_from_full(from_full, chunks, chunk_offsets, groups, t, tp, c) if from_full else opt.state_dict()
            entry = {"model": model, "optim_names": [name_of[id(q)] for q in params], "optimizer": osd,
                     "optim_groups": [g for g, grp in enumerate(groups) for _ in grp["params"]],
                     "chunks": chunks, "opt": opt}
            ckpt = {"epoch": 0, "global_step": step, "pytorch-lightning_version": "1.8.6",
                    "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}, "state_dict": {}}},
                    "hparams_name": "cfg",
                    "hyper_parameters": {"cfg": OmegaConf.create(hyper_parameters(c, tp, pp, zero1_dp, grouping))},
                    "lr_schedulers": [sched or lr_scheduler_state(step, 1e-3, 2, 0, 100, 1e-4)]}
            if vpp == 1:
                sd = {"model." + k: x for k, x in chunks[0].state_dict().items()}
                sd["untrained_buffer_names"] = [] if c["gpt"] else ["language_model.encoder.layers.0.self_attention.core_attention.rotary_emb.inv_freq"]
                ckpt["state_dict"] = sd
            else:
                for v, chunk in enumerate(chunks):
                    ckpt[f"model{v}"] = chunk.state_dict()
            if zero1_dp:
                entry["zero1"] = [zero1_shard(osd, params, r, zero1_dp) for r in range(zero1_dp)]
            else:
                ckpt["optimizer_states"] = [osd]
            expected[(t, p)] = entry
            if not write:
                continue
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
                # Lightning's optimizer_states list, moved out as it is.
                (save_xser if xser else torch.save)([entry["zero1"][r]], os.path.join(zdir, zname))
    return expected, file_name


def hyper_parameters(c, tp, pp, zero1_dp, grouping):
    """The model config NNM records under hyper_parameters.cfg (the keys the converter reads)."""
    cfg = {"num_layers": c["layers"], "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
           "normalization": "layernorm" if c["gpt"] else "rmsnorm", "do_layer_norm_weight_decay": grouping == "one",
           "wrap_with_zero": bool(zero1_dp), "flexible_pipeline_parallel_stages": c["layers"] % pp != 0,
           # The model section's sizes, as NNM's YAML gives them (megatron_llama_config.yaml's keys).
           "encoder_seq_length": c["seq"], "max_position_embeddings": c["seq"], "hidden_size": c["hidden"],
           "ffn_hidden_size": c["ffn"], "num_attention_heads": c["heads"], "layernorm_epsilon": 1e-5,
           "make_vocab_size_divisible_by": 8, "position_embedding_type": "learned_absolute" if c["gpt"] else "rope",
           "activation": "gelu" if c["gpt"] else "swiglu", "has_bias": bool(c["gpt"]),
           "share_embeddings_and_output_weights": bool(c["gpt"])}
    if c["kv_heads"] != c["heads"]:
        cfg["num_kv_heads"] = c["kv_heads"]  # as NNM's megatron_llama_70b_config.yaml (absent: every head has its own KV)
    return cfg


def shard_from_full(full, chunks, offsets, groups, t, tp, c):
    """Copies tensor-parallel rank t's slices of a one-rank run's weights into
    `chunks` and returns the optimizer state dict this rank's AdamW (over
    `groups`) would hold: the same moments, sliced by the same rule."""
    full_sd = full["chunks"][0].state_dict(keep_vars=True)
    full_opt = full["opt"]
    fsd = full_opt.state_dict()
    full_id = {id(q): i for i, q in enumerate(q for g in full_opt.param_groups for q in g["params"])}
    source = {}
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            for k, x in chunk.state_dict(keep_vars=True).items():
                g = global_name(k, offsets[v])
                # GPT's tied copy on the last stage is the embedding (Megatron all-reduces their gradients).
                g_full = "language_model.embedding.word_embeddings.weight" if g == "language_model.output_layer.weight" and c["gpt"] else g
                x.copy_(megatron_partition.split(g_full, full_sd[g_full].detach(), t, tp, c))
                source[id(x)] = (g_full, full_sd[g_full])
    state, param_groups, i = {}, [], 0
    for gi, grp in enumerate(groups):
        ids = []
        for q in grp["params"]:
            name, fq = source[id(q)]
            s = fsd["state"][full_id[id(fq)]]
            state[i] = {"step": s["step"].clone(),
                        "exp_avg": megatron_partition.split(name, s["exp_avg"], t, tp, c).clone(),
                        "exp_avg_sq": megatron_partition.split(name, s["exp_avg_sq"], t, tp, c).clone()}
            ids.append(i)
            i += 1
        param_groups.append(dict(fsd["param_groups"][gi], params=ids))
    return {"state": state, "param_groups": param_groups}


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


def make_hf_converted(root, c, tp=1, pp=1, seed=0):
    """The files NNM's HF -> NNM converter writes (examples/nlp/language_modeling/
    checkpoint_conversion/convert_hf_checkpoint_to_nemo_llama.py, convert_checkpoint),
    after chkpt_merge_mlp_weights.py has joined its dense_h_to_4h and
    dense_h_to_4h_2 into one [gate_r; up_r] weight: per rank
    {"state_dict", "pytorch-lightning_version": "1.9.5", "epoch": 0, "global_step": 0}
    in model_optim_rng.ckpt; no optimizer state, no schedule, no rotary
    buffer. Returns {(t, p): [(nxdt name, tensor)]}."""
    torch.manual_seed(seed)
    per_stage = split_layers(c["layers"], pp)
    expected = {}
    for p in range(pp):
        for t in range(tp):
            chunk = Chunk(c, tp, per_stage[p], first=p == 0, last=p == pp - 1, pp=pp)
            sd = {k: v for k, v in chunk.state_dict().items() if not k.endswith("inv_freq")}
            expected[(t, p)] = [(global_name(k, sum(per_stage[:p])), v) for k, v in sd.items()]
            out = {"state_dict": {"model." + k: v for k, v in sd.items()}, "pytorch-lightning_version": "1.9.5",
                   "epoch": 0, "global_step": 0}
            rank_dir = root if tp == 1 and pp == 1 else os.path.join(
                root, f"mp_rank_{t:02d}" if pp == 1 else f"tp_rank_{t:02d}_pp_rank_{p:03d}")
            os.makedirs(rank_dir, exist_ok=True)
            torch.save(out, os.path.join(rank_dir, "model_optim_rng.ckpt"))
    return expected

"""Megatron's tensor-parallel partition of each parameter, and the merge of an
NxDT tag into one rank, stated in Python independently of the C++ code so
that tests can check it.

The rules (Megatron-LM core tensor_parallel/layers.py, as NxD implements them):
  - vocab-parallel embedding and output layer: rows (dim 0) split in rank order;
  - column-parallel `query_key_value` (per-head [q; k; v] blocks, whole heads
    per rank), `query`, `key_value` (whole KV groups per rank) and GPT's
    `dense_h_to_4h`: rows split in rank order, their biases likewise;
  - Llama's SwiGLU `dense_h_to_4h`: each rank holds [gate_r; up_r];
  - row-parallel `dense` and `dense_4h_to_h`: columns (dim 1) split, their
    biases whole;
  - everything else (norms, position embeddings, rotary buffers): whole.
NxDT numbers optimizer ids over group 0's parameters, then group 1's, each in
model order: one group with do_layer_norm_weight_decay, otherwise norm weights
and biases in group 1.
"""
import os

import torch


def kind(name, c):
    if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
        return "rows"
    module, leaf = name.rsplit(".", 1)
    last = module.rsplit(".", 1)[-1]
    if last in ("query_key_value", "query", "key_value"):
        return "rows"
    if last == "dense_h_to_4h":
        return "rows" if c["gpt"] else "gate_up"
    if last in ("dense", "dense_4h_to_h") and leaf == "weight":
        return "cols"
    return "whole"


def split(name, full, t, tp, c):
    k = kind(name, c)
    if k == "rows":
        return full.chunk(tp, 0)[t]
    if k == "cols":
        return full.chunk(tp, 1)[t]
    if k == "gate_up":
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[t], up.chunk(tp, 0)[t]])
    return full


def merge(name, parts, c):
    k = kind(name, c)
    if k == "rows":
        return torch.cat(parts, 0)
    if k == "cols":
        return torch.cat(parts, 1)
    if k == "gate_up":
        halves = [p.chunk(2, 0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    for p in parts[1:]:
        assert torch.equal(p, parts[0]), f"{name}: replicated copies differ"
    return parts[0]


def no_decay(name):
    module, leaf = name.rsplit(".", 1)
    return leaf == "bias" or module.endswith("norm")


def nemo_no_decay(name):
    """NeMo v2.1.0 get_params_for_weight_decay_optimization with no apex norm
    class (NxD's norms are not): a parameter whose own name ends in 'bias'."""
    return name.rsplit(".", 1)[-1].endswith("bias")


def nxdt_order(names, do_layer_norm_weight_decay):
    """NxDT's optimizer ids -> (name, group) for its megatron models: NeMo
    v2.1.0's rule, empty groups dropped (checked against the rule as run in
    tests/data/upstream/nxdt_megatron by upstream_tags.py)."""
    if do_layer_norm_weight_decay:
        return [(n, 0) for n in names]
    decay = [n for n in names if not nemo_no_decay(n)]
    apart = [n for n in names if nemo_no_decay(n)]
    return [(n, 0) for n in decay] + [(n, 1 if decay else 0) for n in apart]


def rank_file(t, p, d=0):
    return f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"


def is_buffer(name):
    return name.endswith("inv_freq")


def merge_tag(tag, out, c, tp, pp, dp=1, zero1=False, do_layer_norm_weight_decay=False):
    """Writes the one-rank (tp=pp=dp=1) NxDT tag equal to `tag`: model, plain
    optimizer state dict, user_content.pt and scheduler.pt, with `done`."""
    parts, order, states, groups = {}, [], {}, None
    for p in range(pp):
        for t in range(tp):
            model = torch.load(os.path.join(tag, "model", rank_file(t, p)))
            names = [n for n in model if not is_buffer(n)]
            for n, x in model.items():
                if n == "word_embeddings.weight":  # GPT's tied copy on the last stage
                    continue
                if t == 0:
                    order.append(n)
                parts.setdefault(n, []).append(x)
            ids = nxdt_order(names, do_layer_norm_weight_decay)
            shards = [torch.load(os.path.join(tag, "optim", rank_file(t, p, d))) for d in range(dp if zero1 else 1)]
            if groups is None:
                groups = shards[0]["param_groups"]
            for i, (n, _) in enumerate(ids):
                if n == "word_embeddings.weight":
                    continue
                if zero1:
                    rows = shards[0]["shape_info"][i][0]
                    s = {k: torch.cat([sh["base_state"][i][k] for sh in shards])[:rows] for k in ("exp_avg", "exp_avg_sq")}
                    s["step"] = shards[0]["base_state"][i]["step"]
                else:
                    s = shards[0]["state"][i]
                states.setdefault(n, []).append(s)
    model = {n: merge(n, parts[n], c) for n in order}
    names = [n for n in order if not is_buffer(n)]
    full_ids = nxdt_order(names, do_layer_norm_weight_decay)
    state = {}
    for i, (n, _) in enumerate(full_ids):
        s = states[n]
        state[i] = {"step": s[0]["step"], "exp_avg": merge(n, [x["exp_avg"] for x in s], c),
                    "exp_avg_sq": merge(n, [x["exp_avg_sq"] for x in s], c)}
    param_groups = []
    for g in range(2):
        ids = [i for i, (_, gi) in enumerate(full_ids) if gi == g]
        if ids:
            param_groups.append(dict(groups[g], params=ids))
    os.makedirs(os.path.join(out, "model"))
    os.makedirs(os.path.join(out, "optim"))
    torch.save(model, os.path.join(out, "model", rank_file(0, 0)))
    torch.save({"state": state, "param_groups": param_groups}, os.path.join(out, "optim", rank_file(0, 0)))
    for f in ("user_content.pt", "scheduler.pt"):
        torch.save(torch.load(os.path.join(tag, f)), os.path.join(out, f))
    for f in ("checkpoint", "done"):
        open(os.path.join(out, f), "w").close()
    return model

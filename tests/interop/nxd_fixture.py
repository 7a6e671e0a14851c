"""NxD checkpoint tags made by torch as NxD writes them, from one full logical
model and its optimizer state, at any (tp, pp, dp, ZeRO-1) layout; and the
reverse, a tag read back into the full model, for ckpt-reshard's tests.

The logical model is NxDT's megatron state dict at tp = pp = dp = 1 (names
as NxDT's megatron GPT/Llama modules have them; no rotary inv_freq buffers).
What a layout writes (sources are NxD's, aws-neuron/neuronx-distributed):
  - Files: trainer/checkpoint.py, save_checkpoint: `checkpoint` ("1") when the
    save begins, model/<_get_path("model")> from data-parallel rank 0 only
    (groups = the data-parallel group), optim/ likewise, or one file per dp
    rank when ZeRO-1 is on (_get_path("optim", dp=zero1_enabled)),
    user_content.pt from rank 0, `done` ("1") last. File names
    dp_rank_DD_tp_rank_TT_pp_rank_PP.pt. No manifest: that is shardkit's.
  - Tag-level content as NxDT writes it, checked by running NxDT's
    NLPCheckpointIO (tests/data/upstream/nxd_tags): no scheduler.pt (NxDT
    passes no scheduler to NxD), user_content.pt is the Lightning dict minus
    model and optimizer (no consumed_samples: NxDT takes it from the tag
    name), and torch_xla's container rewrite turns shape_info's torch.Size
    into lists.
  - Tensor parallelism: Megatron's partition (megatron_partition.py). With
    fewer KV heads than tp ranks, the fused `key_value` is replicated by
    shardkit's rule (ckpt/spec/partition.h): each group over m = tp / kv_heads
    consecutive ranks, rank r holding group r // m (its query heads' group).
    This is NOT NxD's layout: NxD's GQAQKVColumnParallelLinear
    (modules/qkv_linear.py, _initialize_affine_weight) tiles the heads with
    master_weight.repeat(kv_size_multiplier, 1), so its rank r holds group
    r % kv_heads, on separate weight_q/weight_k/weight_v parameters, and
    neither NNM nor NxD writes `key_value` with kv_heads < tp. These cases
    test shardkit's own rule, not interoperability.
  - Vocabulary: Megatron's _vocab_size_with_padding, rows padded to a multiple
    of make_vocab_size_divisible_by * tp. Writing a full model at a tp whose
    padded size differs drops the rows past it or appends zero rows (weights,
    master weights and moments alike).
  - Pipeline: NxD's even split with the remainder on the last stages, or
    explicit cuts (the first layer of stages 1..pp-1); layers keep their
    global numbers in names. GPT's output layer is tied to the embedding: the
    last stage of a pipeline holds the copy `word_embeddings.weight`
    (Megatron's initialize_word_embeddings), after every language_model key.
  - Optimizer: torch's AdamW state dict (its own param_groups dicts), ids in
    NxDT's order (megatron_partition.nxdt_order) over each stage's parameters.
    ZeRO-1 is torch-xla's ZeroRedundancyOptimizer.state_dict() as NxD's
    NeuronZero1Optimizer saves it: {"state": {}, "param_groups", "base_state"
    (each state padded on dim 0 to a multiple of dp, chunk d of dp),
    "shape_info" (the local tp shapes), "sharded_master_weights" when master
    weights are kept}.
"""
import collections
import os

import torch

import megatron_partition
from megatron_partition import nxdt_order, rank_file

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01


def padded_vocab(c, tp):
    """Megatron's _vocab_size_with_padding."""
    multiple = c["divisible"] * tp
    return -(-c["vocab"] // multiple) * multiple


def logical_names(c):
    """Every parameter of the tp = pp = 1 model, in module order, with its layer (-1: none)."""
    out = [("language_model.embedding.word_embeddings.weight", -1)]
    if c["gpt"]:
        out.append(("language_model.embedding.position_embeddings.weight", -1))
    leaves = ("weight", "bias") if c["gpt"] else ("weight",)
    mods = ["input_layernorm"]
    mods += ["self_attention.query_key_value"] if c["kv_heads"] == c["heads"] else ["self_attention.query", "self_attention.key_value"]
    mods += ["self_attention.dense", "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"]
    for l in range(c["layers"]):
        for m in mods:
            for leaf in leaves:
                out.append((f"language_model.encoder.layers.{l}.{m}.{leaf}", l))
    for leaf in leaves:
        out.append((f"language_model.encoder.final_layernorm.{leaf}", -1))
    if not c["gpt"]:
        out.append(("language_model.output_layer.weight", -1))
    return out


def logical_shape(name, c, vocab_rows):
    H, F, hd = c["hidden"], c["ffn"], c["hidden"] // c["heads"]
    leaf = name.rsplit(".", 1)[1]
    if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
        return (vocab_rows, H)
    if name.endswith("position_embeddings.weight"):
        return (c["seq"], H)
    module = name.rsplit(".", 1)[0].rsplit(".", 1)[1]
    rows = {"query_key_value": 3 * H, "query": H, "key_value": 2 * c["kv_heads"] * hd, "dense": H,
            "dense_h_to_4h": F if c["gpt"] else 2 * F, "dense_4h_to_h": H}.get(module, H)
    if leaf == "bias" or module.endswith("norm"):
        return (rows,)
    cols = F if module == "dense_4h_to_h" else H
    return (rows, cols)


def is_vocab(name):
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")


def make_full(c, tp=1, dtype=torch.bfloat16, master=None, step=7, gbs=8, one_group=False, seed=0):
    """The full logical model and optimizer state, vocab padded for `tp`.

    Weights in `dtype`; with `master` (default: when dtype is not float32) an
    fp32 master copy of which the weights are the rounding, as mixed
    precision keeps them; AdamW moments fp32, exp_avg_sq non-negative."""
    if master is None:
        master = dtype != torch.float32
    g = torch.Generator().manual_seed(seed)
    rows = padded_vocab(c, tp)
    params, masters, m1, m2 = collections.OrderedDict(), collections.OrderedDict(), {}, {}
    for name, _ in logical_names(c):
        shape = logical_shape(name, c, rows)
        w = torch.randn(shape, generator=g) * 0.02
        if name.endswith("norm.weight"):
            w += 1.0
        if master:
            masters[name] = w
        params[name] = w.to(dtype)
        m1[name] = torch.randn(shape, generator=g) * 1e-3
        m2[name] = torch.rand(shape, generator=g) * 1e-6
    return {"c": dict(c), "params": params, "master": masters if master else None, "exp_avg": m1, "exp_avg_sq": m2,
            "step": step, "consumed": float(step * gbs), "one_group": one_group}


def fit_vocab(x, rows):
    """A vocab tensor cut or zero-padded to `rows` rows."""
    if x.shape[0] >= rows:
        return x[:rows]
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def at_vocab(full, tp):
    """`full` with every vocab tensor fitted to the padded size of `tp`."""
    rows = padded_vocab(full["c"], tp)
    out = dict(full)
    for k in ("params", "master", "exp_avg", "exp_avg_sq"):
        if full[k] is not None:
            out[k] = type(full[k])((n, fit_vocab(x, rows) if is_vocab(n) else x) for n, x in full[k].items())
    return out


def kv_multiplier(name, c, tp):
    """kv_size_multiplier for a key_value tensor replicated over tp ranks, else 1."""
    if ".key_value." in name and c["kv_heads"] < tp:
        assert tp % c["kv_heads"] == 0, (tp, c["kv_heads"])
        return tp // c["kv_heads"]
    return 1


def split(name, full, t, tp, c):
    """Tensor-parallel rank t's slice of a logical tensor, a tensor of its own."""
    m = kv_multiplier(name, c, tp)
    if m > 1:  # whole [k_g; v_g] groups, each repeated m times, then split in rank order
        groups = full.reshape((c["kv_heads"], -1) + tuple(full.shape[1:]))
        full = groups.repeat_interleave(m, 0).reshape((-1,) + tuple(full.shape[1:]))
    return megatron_partition.split(name, full, t, tp, c).clone()


def stage_bounds(layers, pp, cuts=None):
    """First layer of every stage, then the layer count."""
    if cuts:
        assert len(cuts) == pp - 1 and list(cuts) == sorted(set(cuts)) and 0 < cuts[0] and cuts[-1] < layers, cuts
        return [0] + list(cuts) + [layers]
    base, rem = divmod(layers, pp)
    sizes = [base + (1 if i >= pp - rem else 0) for i in range(pp)]
    assert min(sizes) > 0, (layers, pp)
    return [sum(sizes[:i]) for i in range(pp + 1)]


# GPT's tied output copy as NxDT names it: the last stage's (pp = 1 included)
# language_model.output_layer.weight (NxDT gpt_model.py ties it; torch's
# state_dict keeps both names: tests/data/upstream/nxdt_megatron). Megatron-LM
# and NNM name it word_embeddings.weight, on the last stage of a pipeline only.
TIED = "language_model.output_layer.weight"
MEGATRON_LM_TIED = "word_embeddings.weight"
EMBEDDING = "language_model.embedding.word_embeddings.weight"


def stage_params(c, bounds, p, naming="nxdt"):
    """[(name in stage p's files, logical name)] in module order."""
    pp = len(bounds) - 1
    out = []
    for name, layer in logical_names(c):
        if layer >= 0:
            keep = bounds[p] <= layer < bounds[p + 1]
        elif ".embedding." in name:
            keep = p == 0
        else:  # final norm, output layer
            keep = p == pp - 1
        if keep:
            out.append((name, name))
    if c["gpt"] and p == pp - 1:
        if naming == "nxdt":
            out.append((TIED, EMBEDDING))
        elif pp > 1:
            out.append((MEGATRON_LM_TIED, EMBEDDING))
    return out


def grouped_names(names, one_group, c):
    """The names NeMo's function lists: get_all_params_for_weight_decay_optimization
    (one group) takes module.parameters(), so GPT's tied copy beside its embedding is left out."""
    if one_group and c["gpt"] and EMBEDDING in names:
        return [n for n in names if n != TIED]
    return names


def param_groups(ids_by_group):
    """The param_groups of torch's AdamW state dict (its key order), over the
    groups of NeMo's get_params_for_weight_decay_optimization as NxDT's megatron
    models build them (its dict literals, is_expert included; weight decay 0 in
    the second), empty groups left out."""
    dummies = [torch.nn.Parameter(torch.zeros(1)) for _ in ids_by_group]
    groups = [{"params": [q], "is_expert": False} if g == 0 else {"params": [q], "weight_decay": 0.0, "is_expert": False}
              for g, q in enumerate(dummies)]
    sd = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).state_dict()["param_groups"]
    return [dict(grp, params=list(ids)) for grp, ids in zip(sd, ids_by_group) if ids]


def zero1_shard(x, dp, d):
    pad = (-x.shape[0]) % dp
    if pad:
        x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
    return x.chunk(dp)[d].clone()


def tag_name(c, step, consumed, style):
    if style == "nxd":
        return f"step_{step}"
    return f"megatron_{'gpt' if c['gpt'] else 'llama'}--step={step}-consumed_samples={consumed}.ckpt"


def write_tag(parent, full, tp=1, pp=1, dp=1, zero1=False, cuts=None, master=True, style="nxdt", tag=None, naming="nxdt"):
    """Writes `full` at the layout under `parent` as NxD would save it and
    returns the tag path (`tag` names the folder, else NxDT's or NxD's
    (`style` "nxd": step_N) naming). `master`: False leaves ZeRO-1's
    sharded_master_weights out even when the model has them."""
    c = full["c"]
    full = at_vocab(full, tp)
    path = os.path.join(parent, tag or tag_name(c, full["step"], full["consumed"], style))
    os.makedirs(os.path.join(path, "model"))
    os.makedirs(os.path.join(path, "optim"))
    with open(os.path.join(path, "checkpoint"), "w") as f:
        f.write("1")
    bounds = stage_bounds(c["layers"], pp, cuts)
    step = full["step"]
    for p in range(pp):
        names = stage_params(c, bounds, p, naming)
        order = nxdt_order(grouped_names([n for n, _ in names], full["one_group"], c), full["one_group"])
        logical = dict(names)
        for t in range(tp):
            def local(kind, n):
                return split(logical[n], full[kind][logical[n]], t, tp, c)

            model = {n: local("params", n) for n, _ in names}
            torch.save(model, os.path.join(path, "model", rank_file(t, p)))
            groups = param_groups([[i for i, (_, g) in enumerate(order) if g == gi] for gi in range(2)])
            per_id = [(i, n) for i, (n, _) in enumerate(order)]
            if not zero1:
                state = {i: {"step": torch.tensor(float(step)), "exp_avg": local("exp_avg", n),
                             "exp_avg_sq": local("exp_avg_sq", n)} for i, n in per_id}
                torch.save({"state": state, "param_groups": groups}, os.path.join(path, "optim", rank_file(t, p)))
                continue
            for d in range(dp):
                osd = {"state": {}, "param_groups": groups,
                       "base_state": {i: {"step": torch.tensor(float(step)),
                                          "exp_avg": zero1_shard(local("exp_avg", n), dp, d),
                                          "exp_avg_sq": zero1_shard(local("exp_avg_sq", n), dp, d)} for i, n in per_id},
                       "shape_info": {i: list(model[n].shape) for i, n in per_id}}
                if master and full["master"] is not None:
                    osd["sharded_master_weights"] = {i: zero1_shard(local("master", n), dp, d) for i, n in per_id}
                torch.save(osd, os.path.join(path, "optim", rank_file(t, p, d)))
    if style == "nxd":  # NxD's own llama example (run_llama_nxd.py): a scheduler, free-form user content
        torch.save({"max_steps": 100, "warmup_steps": 2, "base_lrs": [LR], "last_epoch": step, "verbose": False,
                    "_step_count": step + 1, "_get_lr_called_within_step": False, "_last_lr": [LR * 0.5]},
                   os.path.join(path, "scheduler.pt"))
        torch.save({"total_steps": step, "batch_idx": step - 1, "epoch": 0, "cli_args": {}}, os.path.join(path, "user_content.pt"))
    else:
        torch.save(nxdt_user_content(step), os.path.join(path, "user_content.pt"))
    with open(os.path.join(path, "done"), "w") as f:
        f.write("1")
    return path


def nxdt_user_content(step):
    """NxDT's user content, keys in Lightning 2.5.0's order (as in tests/data/upstream/nxd_tags)."""
    progress = {"optimizer": {"step": {"total": {"ready": step, "completed": step}, "current": {"ready": step, "completed": step}}}}
    return {"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.5.0",
            "loops": {"fit_loop": {"epoch_loop.automatic_optimization.optim_progress": progress}},
            "callbacks": {}, "lr_schedulers": [{"max_steps": 100, "warmup_steps": 2, "min_lr": LR / 10, "base_lrs": [LR],
                                                "last_epoch": step, "verbose": False, "_step_count": step + 1,
                                                "_get_lr_called_within_step": False, "_last_lr": [LR * 0.5]}],
            "hparams_name": "kwargs", "hyper_parameters": {"cfg": {"num_layers": 4}}}


# Reading a tag back.

def degrees(tag):
    """(tp, pp, dp, zero1) from the rank file names and the optim files."""
    def coords(sub):
        out = set()
        for f in os.listdir(os.path.join(tag, sub)):
            parts = f[:-len(".pt")].split("_")
            if f.endswith(".pt") and len(parts) == 9:
                out.add((int(parts[2]), int(parts[5]), int(parts[8])))
        return out

    model, optim = coords("model"), coords("optim")
    tp = 1 + max(t for _, t, _ in model)
    pp = 1 + max(p for _, _, p in model)
    dp = 1 + max(d for d, _, _ in optim)
    zero1 = "base_state" in torch.load(os.path.join(tag, "optim", rank_file(0, 0)))
    assert model == {(0, t, p) for t in range(tp) for p in range(pp)}, sorted(model)
    assert optim == {(d, t, p) for d in range(dp) for t in range(tp) for p in range(pp)}, sorted(optim)
    return tp, pp, dp, zero1


def read_full(tag, c):
    """The full logical model of a tag, merged independently of the writer:
    {"params", "master" (None without), "exp_avg", "exp_avg_sq", "steps": set,
    "bounds", "groups": [param_groups per (t, p)], "grid": (tp, pp, dp, zero1)}.
    Checks on the way that replicated copies agree (norms, GPT's tied copy,
    replicated KV groups), shape_info matches the weights and ZeRO-1 padding
    rows are zero."""
    tp, pp, dp, zero1 = degrees(tag)
    parts = collections.defaultdict(lambda: collections.defaultdict(list))
    steps, groups, first_layers, has_master = set(), {}, [], set()
    tied = {}
    for p in range(pp):
        layers = set()
        for t in range(tp):
            model = torch.load(os.path.join(tag, "model", rank_file(t, p)))
            names = list(model)
            for n in names:
                if n not in (TIED, MEGATRON_LM_TIED) or not c["gpt"]:
                    parts[n]  # merged in model order
                l = megatron_layer(n)
                if l >= 0:
                    layers.add(l)
            order = nxdt_order(names, False)
            shards = [torch.load(os.path.join(tag, "optim", rank_file(t, p, d))) for d in range(dp if zero1 else 1)]
            pg = shards[0]["param_groups"]
            groups[(t, p)] = pg
            ids = [i for g in pg for i in g["params"]]
            if len(pg) == 1:
                order = nxdt_order(grouped_names(names, True, c), True)
            assert ids == list(range(len(order))), (tag, t, p, ids)
            for gi, g in enumerate(pg):
                assert g["params"] == [i for i, (_, x) in enumerate(order) if x == gi], (tag, t, p, gi)
            for sh in shards[1:]:
                assert sh["param_groups"] == pg, (tag, t, p, "param_groups differ between dp ranks")
            for i, (n, _) in enumerate(order):
                if zero1:
                    shape = shards[0]["shape_info"][i]
                    assert list(shape) == list(model[n].shape), (n, shape, model[n].shape)
                    st = {}
                    keys = ["exp_avg", "exp_avg_sq"]
                    masters = ["sharded_master_weights" in sh for sh in shards]
                    assert len(set(masters)) == 1, (tag, t, p, "sharded_master_weights in some dp ranks only")
                    for k in keys:
                        whole = torch.cat([sh["base_state"][i][k] for sh in shards])
                        assert not whole[shape[0]:].any(), (n, k, "ZeRO-1 padding is not zero")
                        st[k] = whole[:shape[0]]
                    if masters[0]:
                        whole = torch.cat([sh["sharded_master_weights"][i] for sh in shards])
                        assert not whole[shape[0]:].any(), (n, "master padding is not zero")
                        st["master"] = whole[:shape[0]]
                        has_master.add(True)
                    else:
                        has_master.add(False)
                    for sh in shards:
                        steps.add(float(sh["base_state"][i]["step"]))
                        assert sh["base_state"][i]["step"].shape == (), (n, "step is not 0-d")
                else:
                    st = dict(shards[0]["state"][i])
                    steps.add(float(st.pop("step")))
                    has_master.add(False)
                st["params"] = model[n]
                if n in (TIED, MEGATRON_LM_TIED) and c["gpt"]:
                    tied.setdefault(t, st)
                else:
                    for k, x in st.items():
                        parts[n][k].append(x)
            if c["gpt"] and TIED in names and TIED not in [n for n, _ in order]:  # no optimizer slot: its weights only
                tied.setdefault(t, {"params": model[TIED]})
        first_layers.append(min(layers) if layers else None)
    assert len(has_master) == 1, (tag, "master weights on some ranks only")
    out = {"params": collections.OrderedDict(), "master": collections.OrderedDict() if True in has_master else None,
           "exp_avg": {}, "exp_avg_sq": {}, "steps": steps, "groups": groups, "grid": (tp, pp, dp, zero1)}
    for n, kinds in parts.items():
        for k, xs in kinds.items():
            m = kv_multiplier(n, c, tp)
            if m > 1:
                for i in range(0, tp, m):
                    for j in range(1, m):
                        assert torch.equal(xs[i], xs[i + j]), (n, k, "replicated KV copies differ")
                xs = xs[::m]
            (out["params"] if k == "params" else out[k])[n] = megatron_partition.merge(n, xs, c)
    for t, st in tied.items():  # GPT's tied copy: the embedding's slice
        for k, x in st.items():
            want = split(EMBEDDING, out["params" if k == "params" else k][EMBEDDING], t, tp, c)
            assert torch.equal(x, want) and x.dtype == want.dtype, (TIED, k, t)
    out["bounds"] = first_layers + [c["layers"]]
    return out


def megatron_layer(name):
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1

#!/usr/bin/env python3
"""Regenerate megatron_groups.json: how NxDT builds its Megatron-style GPT / Llama models and
their optimizer parameter groups, observed by running the upstream code (unmodified) on CPU.

Needs the upstream sources (NOT vendored here) and Debian's torch 1.13 (/usr/bin/python3):
    SHARDKIT_NXD_SRC=<neuronx-distributed @ fbac349b>/src
    SHARDKIT_NXDT_SRC=<neuronx-distributed-training @ 9169aa03>/src
    SHARDKIT_NEMO_SRC=<NeMo @ v2.1.0>            (holds nemo/)
    SHARDKIT_XLA_SRC=<pytorch/xla @ v2.9.0>      (holds torch_xla/)
    nice -n 19 /usr/bin/python3 generate.py

Every upstream file that ran is checked against the git blob id it has at those commits
(EXPECTED_BLOBS); a mismatch stops the run.  See README.md for what was stubbed.
"""

import json
import os
import sys
import types
import warnings

import torch

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import megatron_env as me  # noqa: E402

ue = me.ue

# git blob ids at the pinned commits (git ls-tree); every upstream file that runs must match.
EXPECTED_BLOBS = {
    "nxdt": {
        "neuronx_distributed_training/models/megatron/gpt_model.py": "74836fd3793b09472c97fa398e8173cd47e6f4d8",
        "neuronx_distributed_training/models/megatron/language_model.py": "4d04f86f810c1b1e06e36e9229af4783ddd6cb31",
        "neuronx_distributed_training/models/megatron/transformer.py": "726718270b892971ebea183b8b0c1a8ce77eae32",
        "neuronx_distributed_training/models/megatron/module.py": "05ce5cfcae35bc477ab8e8dc35e14088920dffbe",
        "neuronx_distributed_training/models/megatron/fused_layer_norm.py": "42fc067f50ba403c193bb3b8e7e351fb9bf202c3",
        "neuronx_distributed_training/models/megatron/rotary_pos_embedding.py":
            "17cdc6a66f658d7bdf795a676bcef85e972645b2",
        "neuronx_distributed_training/lightning_modules/model/megatron/megatron_gpt_model.py":
            "bdb5b33eb73cb9b9a4e38ef2a5e470e4f03ed6da",
        "../examples/conf/megatron_gpt_config.yaml": "3b968c3ab79c119fb90a2595e8dbd90ea9a0669b",
        "../examples/conf/megatron_llama_7B_config.yaml": "a6b2bb57c63d405f1f7a02563cc6773e315cfdce",
    },
    "nxd": {
        "neuronx_distributed/parallel_layers/layers.py": "442204bbab8b38ebe4fdf74ba1efaa7d80e2a7c2",
        "neuronx_distributed/parallel_layers/layer_norm.py": "ef636b3532520fe647c58f23e9ef16ad8ddbc219",
        "neuronx_distributed/parallel_layers/layers_utils.py": "1975c0b2ec5eb3afdfe8256691bf6bb2076e33d5",
        "neuronx_distributed/parallel_layers/utils.py": "65f395a86460f64297870a8aafe613fd9eabf7bb",
        "neuronx_distributed/parallel_layers/random.py": "4c7d63d3dc9d5fac157aa68453bdb4d9c7241293",
        "neuronx_distributed/parallel_layers/grads.py": "a772ea83f5bfd56ac1a392ecf17515f41f756242",
        "neuronx_distributed/modules/rms_norm.py": "f6823ae11ed772f0fac472e8cf4c55f5c9376785",
        "neuronx_distributed/utils/__init__.py": "9e7425ff3ed1a166a333434d353aa151890ca4a6",
        "neuronx_distributed/utils/logger.py": "2e8c1287bd1ef128ac84a51f945a5572118133e3",
        "neuronx_distributed/utils/random.py": "ba68215c94a8825b2b69a735c0a5430404d598d1",
        "neuronx_distributed/utils/utils.py": "a84f47c6dfff3b64281b5b139138e34340ca6a00",
        "neuronx_distributed/utils/model_utils.py": "bce4838663987b24a2d6dd2f6f17fa8da198e509",
        "neuronx_distributed/parallel_layers/checkpointing.py": "6eac7bfdf3877123b2d8f2fdc0508f5bba5cc162",
        "neuronx_distributed/trainer/model.py": "168d5c440ed28f8b94421c0130f55c7c7a6fd90e",
        "neuronx_distributed/trainer/optimizer.py": "0942317e5cdca7ce21ead1c34cdc9febcf94e692",
        "neuronx_distributed/trainer/trainer.py": "52d0a8d2927f6e161834d36e7197c44b7143999c",
        "neuronx_distributed/optimizer/zero_redundancy_optimizer.py": "07d1bffd5bcd44831d6793f85a721779f033db13",
    },
    "nemo": {
        "nemo/collections/nlp/modules/common/megatron/utils.py": "b0a6f755a9cc27b0eaf3589e3f84079c583f5b40",
        "nemo/collections/nlp/modules/common/megatron/module.py": "a4efb299216603d01bc22d9f1753696dc4d837a4",
        "nemo/collections/nlp/modules/common/megatron/layer_type.py": "550b81379b391dc7353b9d02a6233e23aaeb0f65",
        "nemo/collections/nlp/modules/common/megatron/fused_bias_dropout_add.py":
            "d42f14d03e05ed7bc74c62904a68cfb0c12fd39c",
        "nemo/collections/nlp/modules/common/megatron/fused_bias_gelu.py": "b4d25e79551f71c433a9db50502ee05ebc29216b",
        "nemo/collections/nlp/modules/common/megatron/fused_bias_geglu.py": "010034157b6b08526070267f929f624144924eca",
        "nemo/collections/nlp/modules/common/megatron/layer_norm_1p.py": "3d14c355eee16a76e4e5d6bd3fa86ae0407a1b4d",
    },
    "xla": {
        "torch_xla/distributed/zero_redundancy_optimizer.py": "25cfdd977402df639a2030e05af8d45534a1aea4",
    },
}

SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, encoder_seq_length=16,
             max_position_embeddings=16)
VOCAB = 64  # padded vocab (divisible by make_vocab_size_divisible_by 8 x tp for tp 1 and 2)
MODELS = {
    # name: (NxDT example config, overrides beyond SIZES)
    "gpt": ("megatron_gpt_config.yaml", {"num_kv_heads": 4}),
    # 7B config with num_kv_heads < heads, as the 70B config of the same family does (64 / 8)
    "llama": ("megatron_llama_7B_config.yaml", {"num_kv_heads": 2}),
}


# --------------------------------------------------------------------------- config

class Cfg(dict):
    """Enough of OmegaConf's DictConfig for `cfg.model.get(key, default)`."""

    def __getattr__(self, k):
        v = self[k]
        return Cfg(v) if isinstance(v, dict) else v


def _num(v):
    # OmegaConf reads `1e-5` as a float, PyYAML (YAML 1.1) as a string
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def conf_path(name):
    return os.path.join(os.path.dirname(me.nxdt_src()), "examples", "conf", name)


def load_config(name, overrides, tp):
    import yaml
    with open(conf_path(name)) as f:
        raw = yaml.safe_load(f)
    model = {k: _num(v) for k, v in raw["model"].items()}
    model.update(SIZES)
    model.update(overrides)
    ds = dict(raw["distributed_strategy"])
    ds["tensor_model_parallel_size"] = tp
    ds["pipeline_model_parallel_size"] = 1
    return Cfg(model=model, distributed_strategy=ds, precision=raw.get("precision", {}),
               exp_manager=raw.get("exp_manager", {})), raw


def build(ns, cfg, tp, tp_rank, seed=1234):
    me.set_tp(tp, tp_rank)
    torch.manual_seed(seed)
    self_ = types.SimpleNamespace(config=cfg, padded_vocab_size=VOCAB, is_resuming_from_checkpoint=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ns.provider(self_)  # NxDT ModelModule.model_provider_func, unmodified


# --------------------------------------------------------------------------- records

def aliases(model):
    """id(tensor) -> every module path holding it (parameters and buffers; named_modules without
    de-duplication)."""
    out = {}
    for mn, mod in model.named_modules(remove_duplicate=False):
        for pn, p in list(mod._parameters.items()) + list(mod._buffers.items()):
            if p is not None:
                name = f"{mn}.{pn}" if mn else pn
                out.setdefault(id(p), [])
                if name not in out[id(p)]:
                    out[id(p)].append(name)
    return out


def persistent_flags(model):
    out = {}
    for mn, mod in model.named_modules(remove_duplicate=False):
        for bn, b in mod._buffers.items():
            if b is not None:
                out[f"{mn}.{bn}" if mn else bn] = bn not in mod._non_persistent_buffers_set
    return out


def describe_state(model):
    sd = model.state_dict(keep_vars=True)
    al = aliases(model)
    params = {id(p) for _, p in model.named_parameters()}
    rows = []
    for k, v in sd.items():
        rows.append({"key": k, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                     "kind": "parameter" if id(v) in params else "buffer",
                     "same_object_as": [n for n in al.get(id(v), []) if n != k]})
    bufs_all = persistent_flags(model)
    return {
        "state_dict": rows,
        "named_parameters": [n for n, _ in model.named_parameters()],
        "named_buffers_dedup": [n for n, _ in model.named_buffers()],
        "buffers_all_paths": [{"name": n, "persistent": p} for n, p in bufs_all.items()],
        "param_count_unique": len(list(model.parameters())),
        "state_dict_param_keys": sum(1 for r in rows if r["kind"] == "parameter"),
    }


def describe_groups(groups, al):
    out = []
    for g in groups:
        out.append({"options": {k: v for k, v in g.items() if k != "params"},
                    "params": [al[id(p)] for p in g["params"]]})
    return out


def run_setup(ns, wrapped, flag):
    self_ = types.SimpleNamespace(config=Cfg(model={"do_layer_norm_weight_decay": flag}), model=wrapped)
    ns.setup(self_)  # NxDT MegatronGPTModel.setup_optimizer_param_groups, unmodified
    return self_._optimizer_param_groups


def fake_grads(model, seed):
    """A deterministic gradient for every parameter, through autograd (so AccumulateGrad hooks fire)."""
    g = torch.Generator().manual_seed(seed)
    loss = 0.0
    for p in model.parameters():  # unique parameters
        loss = loss + (p * torch.randn(p.shape, generator=g)).sum()
    loss.backward()


def summarize_state(state):
    return {str(k): {kk: (list(vv.shape) if torch.is_tensor(vv) and vv.dim() > 0 else
                          (vv.item() if torch.is_tensor(vv) else vv))
                     for kk, vv in v.items()} for k, v in state.items()}


def adamw_run(ns, model, groups_fn, al):
    groups = groups_fn()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01)
    warns = sorted({str(x.message).split(";")[0] for x in w})
    model.zero_grad(set_to_none=True)
    fake_grads(model, 7)
    opt.step()
    sd = opt.state_dict()
    id_to_names = {}
    for g_obj, g_sd in zip(opt.param_groups, sd["param_groups"]):
        for p, i in zip(g_obj["params"], g_sd["params"]):
            id_to_names[str(i)] = al[id(p)]
    # id -> names, from torch's own numbering rule applied to the groups
    return {"construct_warnings": warns, "param_groups": sd["param_groups"], "state_keys": sorted(sd["state"]),
            "state": summarize_state(sd["state"]), "id_to_names": dict(sorted(id_to_names.items(),
                                                                              key=lambda kv: int(kv[0])))}


class _XlaTaggedCpu(str):
    """Device stand-in: torch reads it as the device string "cpu"; `.type` answers "xla" so that
    torch_xla ZeroRedundancyOptimizer._shard_parameters' `assert self.device.type == 'xla'` holds,
    and it compares equal to the CPU device the parameters are on."""
    type = "xla"

    def __eq__(self, other):
        return str(other) == "cpu"

    __hash__ = str.__hash__


def zero1_class(ns):
    base = ns.zero.NeuronZero1Optimizer

    class NeuronZero1OptimizerOnCpu(base):
        """NxD NeuronZero1Optimizer unchanged, except that the `device` attribute torch_xla's
        _shard_parameters sets from the first parameter is replaced by _XlaTaggedCpu."""

        @property
        def device(self):
            return self.__dict__.get("_cpu_device")

        @device.setter
        def device(self, d):
            self.__dict__["_cpu_device"] = None if d is None else _XlaTaggedCpu("cpu")

    return NeuronZero1OptimizerOnCpu


class AdamWDifferentiableKw(torch.optim.AdamW):
    """torch.optim.AdamW that accepts `differentiable=False`, as torch >= 2.0's AdamW does.  Needed
    only by the reload probe: torch 1.13's Optimizer.__setstate__ (run by load_state_dict) adds
    defaults['differentiable'] = False, which torch_xla's init_zero then passes back to
    AdamW(**defaults); torch 1.13's AdamW has no such keyword."""

    def __init__(self, params, differentiable=False, **kw):
        assert not differentiable
        super().__init__(params, **kw)


def zero1_run(ns, model, groups_fn, save_master_weights, fp32_grad_acc):
    cls = zero1_class(ns)
    init = ns.initialize_optimizer_from_class
    init.__globals__["NeuronZero1Optimizer"] = cls
    nxd_config = {
        # as NxDT lightning_modules/model/base.py _initialize_nxd_config builds it (L117-L145)
        "optimizer_config": {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        "mixed_precision_config": {"use_master_weights": fp32_grad_acc, "use_fp32_grad_acc": fp32_grad_acc,
                                   "use_master_weights_in_ckpt": save_master_weights},
        "sequence_parallel": True,
    }
    logging_level = me.logging.getLogger().level
    me.logging.getLogger().setLevel(me.logging.ERROR)  # "Not saving master weights ..." warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        zopt = init(nxd_config, AdamWDifferentiableKw, groups_fn(), lr=1e-3, weight_decay=0.01)
    me.logging.getLogger().setLevel(logging_level)
    warns = sorted({str(x.message).split(";")[0] for x in w})
    nxd_opt = ns.nxd_optim.NxDOptimizer(zopt, nxd_config)
    before = nxd_opt.state_dict()
    model.zero_grad(set_to_none=True)
    fake_grads(model, 7)
    zopt.step()  # torch_xla ZeroRedundancyOptimizer.step (NxD _clip_grad_norm), dp = 1
    sd = nxd_opt.state_dict()  # NxDOptimizer.state_dict -> NeuronZero1Optimizer.state_dict
    rec_load = None
    if save_master_weights:
        rec_load = zero1_reload_probe(zopt, sd)
    for p in model.parameters():
        for a in ("main_grad",):
            if hasattr(p, a):
                delattr(p, a)
    zopt.remove_hooks()
    return {
        "zero1_kwargs_effective": {"save_master_weights": zopt.save_master_weights,
                                   "use_grad_acc_hook": zopt.use_grad_acc_hook,
                                   "higher_cc_precision": zopt.higher_cc_precision,
                                   "grad_clipping": zopt.grad_clipping,
                                   "sharding_groups": zopt.sharding_groups,
                                   "optimizer_dtype": str(zopt.optimizer_dtype).replace("torch.", "")},
        "construct_warnings": warns,
        "state_dict_keys": list(sd.keys()),
        "param_groups": sd["param_groups"],
        "state_keys": sorted(sd["state"]),
        "base_state_keys_before_step": sorted(before["base_state"]),
        "base_state_keys": sorted(sd["base_state"]),
        "base_state": summarize_state(sd["base_state"]),
        "base_optimizer_param_groups_ids": [g["params"] for g in zopt.base_optimizer.state_dict()["param_groups"]],
        "shape_info": {str(k): list(v) for k, v in sd["shape_info"].items()},
        "sharded_master_weights": ({str(k): list(v.shape) for k, v in sd["sharded_master_weights"].items()}
                                   if "sharded_master_weights" in sd else None),
        "reload_probe": rec_load,
    }


def zero1_reload_probe(zopt, sd):
    """Feed the state_dict just taken back through NeuronZero1Optimizer.load_state_dict (torch_xla
    ZeroRedundancyOptimizer.load_state_dict, dp = 1) and record which shard objects of the
    base optimizer own Adam state afterwards.  Structure only: on CPU, torch_xla's
    `param.data.to("cpu")` does not copy, so shards alias the model parameters and values say
    nothing about the XLA behaviour."""
    positions = {}
    pos = 0
    for g in zopt.param_groups:
        for p in g["params"]:
            positions.setdefault(id(p), []).append(pos)
            pos += 1
    dups = [v for v in positions.values() if len(v) > 1]
    if not dups:
        return {"duplicate_positions": []}
    (a, b), = dups
    zopt.load_state_dict(sd)
    base = zopt.base_optimizer
    shards = [s for g in base.param_groups for s in g["params"]]
    orphan = sorted(k for k in base.state if not torch.is_tensor(k))
    after_sd = base.state_dict()
    return {
        "duplicate_positions": [a, b],
        "saved_base_state_has": {str(a): a in sd["base_state"], str(b): b in sd["base_state"]},
        "after_load_shard_has_state": {f"position {i}": shards[i] in base.state for i in (a, b)},
        "after_load_shards_with_state": sum(1 for s in shards if s in base.state),
        "after_load_orphan_int_keys_in_base_state": orphan,
        "after_load_base_state_dict_state_keys": sorted(after_sd["state"]),
    }


def same_groups(a, b):
    return [[id(p) for p in g["params"]] for g in a] == [[id(p) for p in g["params"]] for g in b] and \
        [{k: v for k, v in g.items() if k != "params"} for g in a] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b]


def model_record(ns, name):
    conf, over = MODELS[name]
    cfg, raw = load_config(conf, over, 1)
    model = build(ns, cfg, 1, 0)
    al = aliases(model)
    wrapped = ns.nxd_model.NxDModel(model, {"pipeline_parallel_size": 1})
    rec = {
        "config_file": "examples/conf/" + conf,
        "config_overrides": dict(SIZES, **over, padded_vocab_size=VOCAB, tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1),
        "config_model_keys_used": {k: cfg.model.get(k) for k in (
            "normalization", "position_embedding_type", "activation", "has_bias",
            "share_embeddings_and_output_weights", "transformer_block_type", "num_kv_heads",
            "use_cpu_initialization", "do_layer_norm_weight_decay", "activations_checkpoint_granularity")},
        "sequence_parallel": cfg.distributed_strategy.get("sequence_parallel"),
        "zero1": cfg.distributed_strategy.get("zero1"),
        "precision": raw.get("precision", {}).get("type"),
        "module_classes": sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()}),
        "model": describe_state(model),
    }
    sd_w = list(wrapped.state_dict().keys())
    rec["nxd_model_wrapper_pp1"] = {
        "wrapper": "NxD trainer/model.py NxDModel(model, {'pipeline_parallel_size': 1})",
        "state_dict_keys_equal_unwrapped": sd_w == list(model.state_dict().keys()),
        "named_parameters_equal_unwrapped": [n for n, _ in wrapped.named_parameters()] ==
        [n for n, _ in model.named_parameters()],
        "modules_equal_unwrapped_minus_root": [id(m) for m in wrapped.modules()] == [id(m) for m in model.modules()],
    }
    rec["groups"] = {}
    for flag in (False, True):
        key = f"do_layer_norm_weight_decay={str(flag).lower()}"
        gw = run_setup(ns, wrapped, flag)
        gu = run_setup(ns, model, flag)
        fn = ("nemo get_all_params_for_weight_decay_optimization" if flag
              else "nemo get_params_for_weight_decay_optimization")
        entry = {
            "function": fn,
            "called_with": "NxDModel wrapper (as NxDT's self.model)",
            "returned_type": type(gw).__name__,
            "same_as_unwrapped_model": same_groups(gw, gu),
            "groups": describe_groups(gw, al),
            "adamw": adamw_run(ns, model, lambda: run_setup(ns, wrapped, flag), al),
        }

        if name == "gpt":
            entry["zero1"] = {}
            for fp32acc in (True, False):
                for smw in (False, True):
                    k = f"use_fp32_grad_acc={str(fp32acc).lower()},save_master_weights={str(smw).lower()}"
                    entry["zero1"][k] = zero1_run(ns, model, lambda: run_setup(ns, wrapped, flag), smw, fp32acc)
        rec["groups"][key] = entry
    # tensor parallel 2: per-rank local shapes (real NxD layer init with a tp-2 parallel_state stand-in)
    rec["tp2"] = {}
    cfg2, _ = load_config(conf, over, 2)
    for r in range(2):
        m2 = build(ns, cfg2, 2, r)
        d = m2.state_dict()
        g2 = run_setup(ns, ns.nxd_model.NxDModel(m2, {"pipeline_parallel_size": 1}), False)
        al2 = aliases(m2)
        rec["tp2"][f"tp_rank_{r}"] = {
            "state_dict": [{"key": k, "shape": list(v.shape)} for k, v in d.items()],
            "tensor_parallel_attrs": {n: {"partition_dim": getattr(p, "partition_dim", None),
                                          "partition_stride": getattr(p, "partition_stride", None),
                                          "num_partitions": getattr(p, "num_partitions", None)}
                                      for n, p in m2.named_parameters() if getattr(p, "tensor_model_parallel", False)},
            "groups_do_layer_norm_weight_decay=false_equal_tp1_names":
                describe_groups(g2, al2) == rec["groups"]["do_layer_norm_weight_decay=false"]["groups"],
        }
    me.set_tp(1, 0)
    return rec


def check_blobs(ns):
    roots = {"nxd": me.nxd_src(), "nxdt": me.nxdt_src(), "nemo": me.nemo_src(), "xla": me.xla_src()}
    ran = {r: {} for r in roots}
    for root, rel, path in me.upstream_files_loaded():
        ran[root][rel] = ue.git_blob_sha1(path)
    for rel in ("neuronx_distributed_training/lightning_modules/model/megatron/megatron_gpt_model.py",
                "../examples/conf/megatron_gpt_config.yaml", "../examples/conf/megatron_llama_7B_config.yaml"):
        ran["nxdt"][rel] = ue.git_blob_sha1(os.path.normpath(os.path.join(roots["nxdt"], rel)))
    ran["nxd"]["neuronx_distributed/trainer/trainer.py"] = ue.git_blob_sha1(
        os.path.join(roots["nxd"], "neuronx_distributed/trainer/trainer.py"))
    ran["nxd"]["neuronx_distributed/utils/__init__.py"] = ue.git_blob_sha1(
        os.path.join(roots["nxd"], "neuronx_distributed/utils/__init__.py"))
    bad = []
    for root, files in ran.items():
        for rel, blob in files.items():
            exp = EXPECTED_BLOBS[root].get(rel)
            if exp != blob:
                bad.append(f"{root}:{rel} blob {blob} expected {exp}")
    if bad:
        raise SystemExit("upstream trees are not at the pinned commits:\n  " + "\n  ".join(bad))
    return {r: dict(sorted(f.items())) for r, f in ran.items()}


def main():
    ns = me.load()
    out = {
        "upstream": {
            "nxdt": {"repo": "aws-neuron/neuronx-distributed-training", "commit": me.NXDT_COMMIT},
            "nxd": {"repo": "aws-neuron/neuronx-distributed", "commit": me.NXD_COMMIT},
            "nemo": {"repo": "NVIDIA/NeMo", "tag": me.NEMO_TAG, "commit": me.NEMO_COMMIT},
            "xla": {"repo": "pytorch/xla", "tag": me.XLA_TAG, "commit": me.XLA_COMMIT},
            "functions_compiled_verbatim": ns.functions_run,
        },
        "torch": torch.__version__,
        "models": {},
    }
    for name in MODELS:
        out["models"][name] = model_record(ns, name)
        print(f"{name}: done", file=sys.stderr)
    out["upstream"]["files_ran_git_blobs"] = check_blobs(ns)
    with open(os.path.join(HERE, "megatron_groups.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

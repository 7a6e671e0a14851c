#!/usr/bin/python3
"""Megatron-style Mixtral tags: NxDT's models/megatron GPTModel (ParallelTransformer
with NeuronSwitchMLP on NxD's MoE modules), built by NxDT's own
ModelModule.model_provider_func from examples/conf/megatron_mixtral_8x7b_config.yaml
at tiny sizes; otherwise as generate.py (same upstream commits, mesh, ZeRO-1,
save_checkpoint, gathering, reports, local changes).

Environment: generate.py's, plus what ../nxdt_megatron/megatron_env.py needs:
  SHARDKIT_NXD_SRC=$NXD_SRC SHARDKIT_NXDT_SRC=$NXDT_SRC SHARDKIT_XLA_SRC=$TORCH_XLA_SRC
  SHARDKIT_NEMO_SRC=<NeMo v2.1.0 tree with nemo/collections/nlp/modules/common/megatron>

Stand-ins beyond generate.py's: megatron_env's apex, einops/transformers and NeMo
ones (its _apex_stubs, _misc_stubs, _nemo_stubs: real NeMo megatron files), used
as they are; its torch_xla and NxD stand-ins are NOT used (generate.py's run real
NxD with the simulated mesh).  No scheduler: the lr stays 3e-4 (NeMo's
lr_scheduler.py needs hydra, which megatron_env's real NeMo packages do not stub).
"""

import os
import sys
import types
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import generate as G  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "nxdt_megatron"))
sys.path.insert(0, os.path.join(HERE, "..", "hf_llama"))
import megatron_env as me  # noqa: E402
import upstream_env as ue  # noqa: E402

VOCAB = 64
CONFIG = "megatron_mixtral_8x7b_config.yaml"
SIZES = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=4, num_kv_heads=2,
             encoder_seq_length=32, max_position_embeddings=32)
MOE = dict(num_experts=4, top_k=2, frequency=1, capacity_factor=2.0)


def megatron_setup(ep):
    nxd_config = G.nxd_setup(ep)
    import torch.utils.checkpoint  # noqa: F401  (transformer.py reads it without importing it)

    me._apex_stubs()
    me._misc_stubs()
    me._nemo_stubs()
    nx = os.path.join(os.environ["NXDT_SRC"], "neuronx_distributed_training")
    ue._real_pkg("neuronx_distributed_training", nx)
    for sub in ("models", "models/megatron", "lightning_modules", "lightning_modules/model",
                "lightning_modules/model/megatron", "utils"):
        ue._real_pkg("neuronx_distributed_training." + sub.replace("/", "."), os.path.join(nx, sub))
    import importlib

    gpt = importlib.import_module("neuronx_distributed_training.models.megatron.gpt_model")
    transformer = importlib.import_module("neuronx_distributed_training.models.megatron.transformer")
    nemo_utils = importlib.import_module("nemo.collections.nlp.modules.common.megatron.utils")
    G.nxd_stubs.rebind()
    G.enable_spmd_rank(transformer, ep)
    mgm = "neuronx_distributed_training/lightning_modules/model/megatron/megatron_gpt_model.py"
    provider, _, _ = ue.upstream_function(mgm, "ModelModule.model_provider_func", root="nxdt", GPTModel=gpt.GPTModel)
    groups_fn, _, _ = ue.upstream_function(
        mgm, "MegatronGPTModel.setup_optimizer_param_groups", root="nxdt",
        get_all_params_for_weight_decay_optimization=nemo_utils.get_all_params_for_weight_decay_optimization,
        get_params_for_weight_decay_optimization=nemo_utils.get_params_for_weight_decay_optimization)
    G.nxd_stubs._note("megatron_env (../nxdt_megatron): _apex_stubs, _misc_stubs, _nemo_stubs",
                      "apex enums/softmax/norm stand-ins, einops/transformers.utils stubs, real NeMo megatron files",
                      "transformer.py and NeMo's MegatronModule import them at module level")
    return nxd_config, provider, groups_fn


def config():
    import yaml

    path = os.path.join(os.environ["NXDT_SRC"], "..", "examples", "conf", CONFIG)
    with open(path) as f:
        raw = yaml.safe_load(f)
    model = {k: _num(v) for k, v in raw["model"].items()}
    model.update(SIZES)
    model["moe"] = dict(model["moe"], **MOE)
    ds = dict(raw["distributed_strategy"], tensor_model_parallel_size=G.TP, pipeline_model_parallel_size=1)
    return me_cfg(model=model, distributed_strategy=ds, precision=raw.get("precision", {}),
                  exp_manager=raw.get("exp_manager", {}))


def _num(v):
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None if v == "None" else v
    return v


class me_cfg(dict):  # noqa: N801  (enough of DictConfig for cfg.model.get(...))
    def __getattr__(self, k):
        v = self[k]
        return me_cfg(v) if isinstance(v, dict) else v


def model_and_groups(provider, groups_fn, cfg, ep):
    from neuronx_distributed.parallel_layers import parallel_state as ps

    cfg["distributed_strategy"]["expert_model_parallel_size"] = ep
    self_ = types.SimpleNamespace(config=cfg, padded_vocab_size=VOCAB, is_resuming_from_checkpoint=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = provider(self_)
    G.set_values(model, ep)
    holder = types.SimpleNamespace(model=model, config=cfg)
    groups_fn(holder)
    groups = list(holder._optimizer_param_groups)
    del ps
    return model, (G.without_frozen(groups) if ep > 1 else groups)


MOE_RULE = "NxDT Megatron: 1-based layer_number % moe.frequency == 0 (transformer.py ParallelTransformerLayer)"


def probe_spmd(provider, cfg, transformer, out):
    """ep 2 without local change 1, recorded."""
    real = transformer.ExpertMLPs.func
    transformer.ExpertMLPs = real
    try:
        G.SIM.set_rank(0)
        provider(types.SimpleNamespace(config=cfg, padded_vocab_size=VOCAB, is_resuming_from_checkpoint=False))
        print("without local change 1: the model builds (unexpected)", file=out)
    except Exception as e:  # noqa: BLE001
        print(f"without local change 1 (enable_spmd_rank): {type(e).__name__}: {e}", file=out)
    transformer.ExpertMLPs = G.functools.partial(real, enable_spmd_rank=True)


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, choices=[1, 2], required=True)
    ap.add_argument("--moe-frequency", type=int, default=1, help="as generate.py's")
    ap.add_argument("--tp", type=int, default=2, help="as generate.py's")
    ap.add_argument("--dp", type=int, default=2, help="as generate.py's")
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args()
    ep, out, freq = args.ep, sys.stdout, args.moe_frequency
    G.set_mesh(args.tp, args.dp)
    default_mesh = (args.tp, args.dp) == (2, 2)
    MOE["frequency"] = freq
    nxd_config, provider, groups_fn = megatron_setup(ep)
    cfg = config()
    cfg["distributed_strategy"]["expert_model_parallel_size"] = ep
    writes = G.TAGS_GEN.record_writes()
    if ep > 1 and freq == 1 and default_mesh:
        probe_spmd(provider, cfg, sys.modules["neuronx_distributed_training.models.megatron.transformer"], out)
    old = G.TAGS_GEN.set_env(G.ROUTE["env"])
    trained = G.SIM.run_threaded(lambda r: G.train(*model_and_groups(provider, groups_fn, cfg, ep), nxd_config, None))
    for gi, g in enumerate(trained[0][3]):
        print(f"NeMo get_params_for_weight_decay_optimization group {gi}: "
              f"{ {k: v for k, v in g.items() if k != 'params'} }, {len(g['params'])} params", file=out)
    G.save_and_report(G.stem_of("megatron", ep, freq), trained, ep, args.out, writes, out, MOE_RULE,
                      config={"model": dict(cfg["model"]), "padded_vocab_size": VOCAB},
                      containers=(False, True) if freq == 1 and default_mesh else (False,))
    G.TAGS_GEN.set_env(old)


if __name__ == "__main__":
    main()

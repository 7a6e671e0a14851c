#!/usr/bin/python3
"""The HF MixtralForCausalLM layout of the fixture's model, and the checks that
tie it to upstream.  Dev-time (needs generate.py's environment); writes
hf_reference/ and prints hf_reference.out.txt's content.

For each full state (hf_ep1_full_state.pt, hf_ep2_full_state.pt):
  hf_reference/epE/pytorch_model.bin + config.json: HF names and orientation,
      block_sparse_moe.gate.weight = router (E, H);
      experts.e.w1.weight = gate_up_proj[e][:, :I].T  (I, H)
      experts.e.w3.weight = gate_up_proj[e][:, I:].T  (I, H)
      experts.e.w2.weight = down_proj[e].T            (H, I)
      the rest unchanged.

Checks (printed):
  1. NxD's inference converter (examples/inference/mixtral/neuron_modeling_mixtral.py,
     convert_mixtral_to_neuron_state_dict; the function only, taken from the
     file with ast, because the file imports the inference package `modules`,
     not in the repository) turns the HF layout back into the full state bit
     for bit.
  2. NxD's training converter (examples/training/mixtral/convert_checkpoints.py,
     CheckpointConverterMixtral, run unmodified) on the same folders: the shapes
     it gives, against NxD's.
  3. Numeric: NxDT's MoE layer (initialize_mixtral_moe_layer -> NxD RouterTopK,
     ExpertMLPs, MoE; tp 1, ep 1, training mode) holding layer 0's weights, on
     a few tokens, equals HF's Mixtral sparse-MoE block forward written below
     from HF's MixtralSparseMoeBlock with the HF weights, within float tolerance.
     Tokens and both outputs are saved in hf_reference/moe_check.pt.
"""

import ast
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import generate  # noqa: E402  (sets torch threads, loads the stub modules)
import torch  # noqa: E402
from hf_moe import hf_sparse_moe  # noqa: E402

OUT = os.path.join(HERE, "hf_reference")
TOKENS = 6


def hf_state(full, cfg):
    """NxD full state -> HF MixtralForCausalLM state dict (HF key order)."""
    m, inter = full["model"], cfg["intermediate_size"]
    hf = {"model.embed_tokens.weight": m["model.embed_tokens.weight"]}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for x in ("q_proj", "k_proj", "v_proj", "o_proj"):
            hf[p + f"self_attn.{x}.weight"] = m[p + f"self_attn.{x}.weight"]
        hf[p + "block_sparse_moe.gate.weight"] = m[p + "mlp.router.linear_router.weight"]
        gate_up, down = m[p + "mlp.expert_mlps.mlp_op.gate_up_proj.weight"], m[p + "mlp.expert_mlps.mlp_op.down_proj.weight"]
        for e in range(cfg["num_local_experts"]):
            hf[p + f"block_sparse_moe.experts.{e}.w1.weight"] = gate_up[e][:, :inter].t().contiguous()
            hf[p + f"block_sparse_moe.experts.{e}.w2.weight"] = down[e].t().contiguous()
            hf[p + f"block_sparse_moe.experts.{e}.w3.weight"] = gate_up[e][:, inter:].t().contiguous()
        hf[p + "input_layernorm.weight"] = m[p + "input_layernorm.weight"]
        hf[p + "post_attention_layernorm.weight"] = m[p + "post_attention_layernorm.weight"]
    hf["model.norm.weight"] = m["model.norm.weight"]
    hf["lm_head.weight"] = m["lm_head.weight"]
    assert len(hf) == len(m) - 2 * cfg["num_hidden_layers"] + 3 * cfg["num_local_experts"] * cfg["num_hidden_layers"]
    return {k: v.clone() for k, v in hf.items()}


def hf_config(cfg):
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "rope_theta", "initializer_range", "hidden_act",
            "max_position_embeddings", "sliding_window", "tie_word_embeddings", "num_local_experts",
            "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")
    c = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": "float32"}
    c.update({k: cfg[k] for k in keys})
    return c


def inference_converter():
    """convert_mixtral_to_neuron_state_dict from NxD's inference example, the
    function alone (ast), run with torch and gc as its globals."""
    path = os.path.join(os.environ["NXD_SRC"], "..", "examples", "inference", "mixtral", "neuron_modeling_mixtral.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "convert_mixtral_to_neuron_state_dict"]
    ns = {"torch": torch, "gc": __import__("gc")}
    exec(compile(ast.Module(body=fn, type_ignores=[]), path, "exec"), ns)
    return ns["convert_mixtral_to_neuron_state_dict"]


def check_inference_converter(full, hf, cfg, out):
    conv = inference_converter()
    # the inference model's names have no "model." prefix (NeuronBaseModel)
    sd = {k[len("model."):] if k.startswith("model.") else k: v.clone() for k, v in hf.items()}
    nc = types.SimpleNamespace(glu_mlp=True, hf_config=types.SimpleNamespace(**cfg))
    got = conv(sd, nc)
    bad = []
    for name, want in full["model"].items():
        key = name[len("model."):] if name.startswith("model.") else name
        if key not in got or not (got[key].shape == want.shape and torch.equal(got[key], want)):
            bad.append(name)
    print(f"  inference converter (HF -> NxD): {len(full['model']) - len(bad)}/{len(full['model'])} tensors equal "
          f"the full state bit for bit" + (f"; differ: {bad}" if bad else ""), file=out)
    return not bad


def check_training_converter(full, hf, cfg, out):
    """Runs the unmodified class; only its two hooks are called, on the same
    dicts the converter's run() would hand them (full states, HF names)."""
    root = os.path.join(os.environ["NXD_SRC"], "neuronx_distributed")
    # nxd_stubs serves neuronx_distributed.pipeline as a placeholder package; the
    # converter imports the real pipeline/partition.py, loaded here unmodified
    generate.nxd_stubs._load_source("neuronx_distributed.pipeline.partition",
                                    os.path.join(root, "pipeline", "partition.py"))
    generate.nxd_stubs._pkg_shell("neuronx_distributed.scripts", os.path.join(root, "scripts"))
    from neuronx_distributed.scripts import checkpoint_converter  # noqa: F401  (real module)

    path = os.path.join(os.environ["NXD_SRC"], "..", "examples", "training", "mixtral", "convert_checkpoints.py")
    mod = generate.nxd_stubs._load_source("nxd_training_mixtral_convert", path)
    conv = mod.CheckpointConverterMixtral()
    args = types.SimpleNamespace(config=os.path.join(OUT, f"ep{full['ep']}", "config.json"))
    to_nxd = conv.pre_process_full_state_before_tp_conversion({k: v.clone() for k, v in hf.items()}, args)
    p = "model.layers.0.mlp.expert_mlps.mlp_op."
    inter, hidden = cfg["intermediate_size"], cfg["hidden_size"]
    print(f"  training converter HF -> NxD (pre_process_full_state_before_tp_conversion), layer 0 keys: "
          f"{sorted(k[len(p):] for k in to_nxd if k.startswith(p))}", file=out)
    for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        print(f"    {k}: {list(to_nxd[p + k].shape)}", file=out)
    print(f"    NxD's model has gate_up_proj.weight {list(full['model'][p + 'gate_up_proj.weight'].shape)} and "
          f"down_proj.weight {list(full['model'][p + 'down_proj.weight'].shape)} (E, H, 2I) / (E, I, H)", file=out)
    # NxD -> HF: what the converter's post-process makes of NxD's orientation
    # (gate/up halves of gate_up_proj under the converter's own key names)
    nxd = {k: v.clone() for k, v in full["model"].items()}
    for layer in range(cfg["num_hidden_layers"]):
        q = f"model.layers.{layer}.mlp.expert_mlps.mlp_op."
        gu = nxd.pop(q + "gate_up_proj.weight")
        nxd[q + "gate_proj.weight"], nxd[q + "up_proj.weight"] = gu[..., :inter].contiguous(), gu[..., inter:].contiguous()
    back = conv.post_process_full_state_after_tp_conversion(nxd, args)
    e0 = "model.layers.0.block_sparse_moe.experts.0."
    shapes = {w: list(back[e0 + w + ".weight"].shape) for w in ("w1", "w2", "w3")}
    print(f"  training converter NxD -> HF (post_process_full_state_after_tp_conversion), expert 0: {shapes}; "
          f"HF's: w1 [{inter}, {hidden}], w2 [{hidden}, {inter}], w3 [{inter}, {hidden}]", file=out)
    transposed = all(torch.equal(back[e0 + w + ".weight"], hf[e0 + w + ".weight"].t()) for w in ("w1", "w2", "w3"))
    print(f"    its w1/w2/w3 equal HF's transposed: {transposed}", file=out)
    return transposed


def check_forward(mm, full, hf, cfg, out):
    torch.manual_seed(0)
    layer = mm.initialize_mixtral_moe_layer(generate.mixtral_stubs.MixtralConfig(**cfg))
    p = "model.layers.0.mlp."
    sd = {k[len(p):]: v for k, v in full["model"].items() if k.startswith(p)}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not unexpected and all("spmd" in k for k in missing), (missing, unexpected)
    layer.train()
    g = torch.Generator()
    g.manual_seed(38)
    x = torch.randn(TOKENS, 1, cfg["hidden_size"], generator=g)  # (S, B, H): NxD's MoE layout without sequence parallel
    with torch.no_grad():
        nxd_out, nxd_logits = layer(x)[0], layer(x)[1]
    h = "model.layers.0.block_sparse_moe."
    E = cfg["num_local_experts"]
    w = {n: [hf[h + f"experts.{e}.{n}.weight"] for e in range(E)] for n in ("w1", "w2", "w3")}
    hf_out, hf_logits = hf_sparse_moe(x.reshape(TOKENS, -1), hf[h + "gate.weight"], w["w1"], w["w2"], w["w3"],
                                      cfg["num_experts_per_tok"])
    diff = (nxd_out.reshape(TOKENS, -1) - hf_out).abs().max().item()
    ldiff = (nxd_logits.reshape(TOKENS, -1) - hf_logits).abs().max().item()
    ok = torch.allclose(nxd_out.reshape(TOKENS, -1), hf_out, rtol=1e-5, atol=1e-7)
    print(f"  MoE forward, layer 0, {TOKENS} tokens: NxD output {list(nxd_out.shape)}, max |NxD - HF| = {diff:.3g} "
          f"(router logits {ldiff:.3g}); allclose(rtol 1e-5, atol 1e-7): {ok}; output max |value| "
          f"{hf_out.abs().max().item():.3g}", file=out)
    torch.save({"tokens": x.reshape(TOKENS, -1).clone(), "nxd_output": nxd_out.reshape(TOKENS, -1).clone(),
                "hf_output": hf_out.clone(), "nxd_router_logits": nxd_logits.reshape(TOKENS, -1).clone(),
                "layer": 0}, os.path.join(OUT, f"ep{full['ep']}", "moe_check.pt"))
    return ok


def main():
    out = sys.stdout
    generate.mixtral_stubs.install(1, 1, 1)
    nxd_stubs = generate.nxd_stubs
    nxd_stubs.install_nxdt(os.environ["NXDT_SRC"], os.environ["LIGHTNING_UTILITIES_SRC"], os.environ["NEMO_SRC"])
    mm = generate.mixtral_stubs.import_nxdt_modeling_mixtral()
    ok = True
    for ep in (1, 2):
        full = torch.load(os.path.join(HERE, f"hf_ep{ep}_full_state.pt"))
        cfg = full["config"]
        d = os.path.join(OUT, f"ep{ep}")
        os.makedirs(d, exist_ok=True)
        hf = hf_state(full, cfg)
        torch.save(hf, os.path.join(d, "pytorch_model.bin"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(hf_config(cfg), f, indent=1)
            f.write("\n")
        print(f"hf_reference/ep{ep} (from hf_ep{ep}_full_state.pt): {len(hf)} tensors", file=out)
        ok &= check_inference_converter(full, hf, cfg, out)
        ok &= check_training_converter(full, hf, cfg, out)
        ok &= check_forward(mm, full, hf, cfg, out)
    print(f"result: {'OK' if ok else 'FAILED'}", file=out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Reference forward and backward of ONE MoE layer, computed by NxD's real MoE
modules as NxDT's HF Mixtral builds them.  Dev-time; writes moe_dropless.pt,
moe_capacity.pt and prints generate.out.txt's content.  Issue #39.

Upstream (read-only, imported from the paths below, never copied here), the
commits and environment of ../nxd_mixtral/generate.py (whose stubs this reuses):
  NxD   aws-neuron/neuronx-distributed            fbac349b61a3adbb123c2983835af692840ff62f
  NxDT  aws-neuron/neuronx-distributed-training   9169aa03f39efd4eb02da63891a7ed98defb1714

What runs (no upstream line changed):
  layer   NxDT models/hf_models/modeling_mixtral.py initialize_mixtral_moe_layer
          -> NxD modules/moe RouterTopK (softmax in fp64, top-k on the logits),
          ExpertMLPs (glu_mlp, silu, normalize_top_k_affinities), MoE; tp 1,
          ep 1, training mode, float32.
  aux     NxD modules/moe/loss_function.py load_balancing_loss_func on the
          layer's router logits, times router_aux_loss_coef, added to the loss
          as NxDT's MixtralForCausalLM.forward adds it.
  loss    L = sum(output * G) + coef * aux for a fixed upstream gradient G;
          L.backward() gives the gradients of the input and of every weight.

The two cases (the settings of NxDT's four Mixtral example configs, read from
examples/conf/*mixtral*.yaml and NxDT lightning_modules/model/hf_models/
mixtral_model.py, which copies moe.capacity_factor into the config):
  dropless  capacity_factor 0.0 (the *_dropless_config.yaml: dropless True,
            capacity_factor 0.0).  ExpertMLPsV2.forward (training) takes
            forward_blockwise for capacity_factor <= 0, which on CPU (no NKI
            kernel) runs forward_all_experts: every token through its top-k
            experts, none dropped.  The non-dropless configs' capacity_factor
            2.0 equals num_experts / top_k at 8 experts top 2 (and here, 4 / 2),
            which validate_routed_experts_configs turns into None = full
            capacity = forward_all_experts as well: the same numbers.
  capacity  capacity_factor 1.0 < E / k: forward_capacity_factor with expert
            capacity C = min(T, ceil(T * k * cf / E)); tokens past C in an
            expert (in token order: cumsum of the top-k mask over tokens) are
            dropped from it, and the surviving affinities renormalized.

All four configs set normalize_top_k_affinities True, output_router_logits True,
router_aux_loss_coef 0.02, top_k 2.  This is the HF style's layer (RouterTopK,
softmax); the Megatron style's NeuronSwitchMLP is not covered here.

Command: see README.md.
"""

import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MIXTRAL = os.path.join(HERE, "..", "nxd_mixtral")
sys.path.insert(0, MIXTRAL)

import generate as mixtral_generate  # noqa: E402  (sets torch threads, loads the stub modules)
import torch  # noqa: E402

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 12, 16, 32, 4, 2
AUX_COEF = 0.02
CASES = {"dropless": 0.0, "capacity": 1.0}


def config(capacity_factor):
    return dict(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                hidden_act="silu", capacity_factor=capacity_factor, normalize_top_k_affinities=True,
                initializer_range=0.02, sequence_parallel_enabled=False, router_aux_loss_coef=AUX_COEF,
                output_router_logits=True)


def fixed_values():
    """Weights, input and upstream gradient from one seeded generator.  The
    router is scaled up so that routing is uneven enough for the capacity case
    to drop tokens."""
    g = torch.Generator()
    g.manual_seed(39)
    return {
        "router": torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5,
        "gate_up_proj": torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g) * 0.25,
        "down_proj": torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * 0.25,
        "input": torch.randn(TOKENS, HIDDEN, generator=g),
        "output_grad": torch.randn(TOKENS, HIDDEN, generator=g),
    }


def watch_paths(expert_mlps):
    """Records which ExpertMLPsV2 forward paths run (instance attributes that
    call the class's own methods; observation only)."""
    ran = []
    for name in ("forward_all_experts", "forward_capacity_factor", "forward_blockwise"):
        method = getattr(expert_mlps, name)
        setattr(expert_mlps, name, lambda *a, _m=method, _n=name, **k: (ran.append(_n), _m(*a, **k))[1])
    return ran


def watch_combine_weights(expert_mlps):
    """Keeps what get_expert_affinities_masked returns (the combine weights
    after drops and normalization: its nonzeros are the kept choices), the
    same way (observation only)."""
    seen = []
    method = expert_mlps.get_expert_affinities_masked
    expert_mlps.get_expert_affinities_masked = lambda *a, **k: (seen.append(method(*a, **k)), seen[-1])[1]
    return seen


def run_case(mm, lf, name, capacity_factor, v, out):
    layer = mm.initialize_mixtral_moe_layer(mixtral_generate.mixtral_stubs.MixtralConfig(**config(capacity_factor)))
    sd = {"router.linear_router.weight": v["router"], "expert_mlps.mlp_op.gate_up_proj.weight": v["gate_up_proj"],
          "expert_mlps.mlp_op.down_proj.weight": v["down_proj"]}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    layer.train()
    eff = layer.expert_mlps.routed_experts_mlp_config.capacity_factor
    ran = watch_paths(layer.expert_mlps)
    combine_seen = watch_combine_weights(layer.expert_mlps)
    x = v["input"].clone().reshape(1, TOKENS, HIDDEN).requires_grad_(True)  # (B, S, H): training layout without SP
    output, router_logits = layer(x)[:2]
    aux = lf.load_balancing_loss_func(router_logits, EXPERTS, TOP_K)
    loss = (output.reshape(TOKENS, HIDDEN) * v["output_grad"]).sum() + AUX_COEF * aux
    loss.backward()
    params = dict(layer.named_parameters())
    # which (token, expert) choices the capacity rule keeps, restated from
    # forward_capacity_factor, checked against NxD's own combine weights
    top = torch.topk(router_logits.detach(), TOP_K).indices
    mask = torch.zeros(TOKENS, EXPERTS)
    for k in range(TOP_K):
        mask[torch.arange(TOKENS), top[:, k]] = 1
    cap = TOKENS if eff is None or eff <= 0 else min(TOKENS, math.ceil(TOKENS * TOP_K * eff / EXPERTS))
    kept = mask * (torch.cumsum(mask, 0) <= cap)
    # forward_blockwise computes them once before falling back to
    # forward_all_experts, which computes them again: the same tensor
    assert combine_seen and all(torch.equal(c, combine_seen[-1]) for c in combine_seen), len(combine_seen)
    combine = combine_seen[-1].detach().clone()
    assert torch.equal((combine != 0).float(), kept), "NxD's kept choices differ from the rule restated here"
    dropped = int((mask - kept).sum())
    record = {
        "capacity_factor": float(capacity_factor),  # settings as Python numbers
        "effective_capacity_factor": -1.0 if eff is None else float(eff),
        "expert_capacity": int(cap),
        "aux_loss_coef": float(AUX_COEF),
        "router.weight": v["router"].clone(),
        "gate_up_proj.weight": v["gate_up_proj"].clone(),
        "down_proj.weight": v["down_proj"].clone(),
        "input": v["input"].clone(),
        "output_grad": v["output_grad"].clone(),
        "output": output.detach().reshape(TOKENS, HIDDEN).clone(),
        "router_logits": router_logits.detach().clone(),
        "expert_index": top.clone(),
        "combine_weights": combine,
        "kept_mask": (combine != 0).float(),
        "aux_loss": aux.detach().clone(),
        "input.grad": x.grad.reshape(TOKENS, HIDDEN).clone(),
        "router.weight.grad": params["router.linear_router.weight"].grad.clone(),
        "gate_up_proj.weight.grad": params["expert_mlps.mlp_op.gate_up_proj.weight"].grad.clone(),
        "down_proj.weight.grad": params["expert_mlps.mlp_op.down_proj.weight"].grad.clone(),
    }
    path = os.path.join(HERE, f"moe_{name}.pt")
    torch.save(record, path)
    print(f"{name}: capacity_factor {capacity_factor} (ExpertMLPs keeps {eff}), path "
          f"{' -> '.join(ran)} (get_expert_affinities_masked called {len(combine_seen)}x), "
          f"expert capacity {cap}, choices dropped {dropped} of {TOKENS * TOP_K}; "
          f"tokens with both choices dropped {int(((mask - kept).sum(1) == TOP_K).sum())}, "
          f"with one {int(((mask - kept).sum(1) == 1).sum())}", file=out)
    print(f"  top-k experts per token: {top.tolist()}", file=out)
    print(f"  kept per token: {kept.int().tolist()}", file=out)
    print(f"  aux loss {aux.item():.9g}, output max |value| {output.abs().max().item():.4g}", file=out)
    for k, t in record.items():
        print(f"  {k}: " + (f"{t.dtype} {list(t.shape)}" if torch.is_tensor(t) else repr(t)), file=out)
    return dropped


def main():
    mixtral_generate.mixtral_stubs.install(1, 1, 1)
    nxd_stubs = mixtral_generate.nxd_stubs
    nxd_stubs.install_nxdt(os.environ["NXDT_SRC"], os.environ["LIGHTNING_UTILITIES_SRC"], os.environ["NEMO_SRC"])
    mm = mixtral_generate.mixtral_stubs.import_nxdt_modeling_mixtral()
    import neuronx_distributed.modules.moe.loss_function as lf  # the real module
    v = fixed_values()
    dropped = {name: run_case(mm, lf, name, cf, v, sys.stdout) for name, cf in CASES.items()}
    assert dropped["dropless"] == 0 and dropped["capacity"] > 0, dropped
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""HF transformers' Mixtral sparse-MoE block forward, restated in torch (torch
1.13 has no transformers).  Torch only: hf_reference.py and
tests/interop/nxd_mixtral_fixture.py both import it."""
import torch
import torch.nn.functional as F


def hf_sparse_moe(x, gate, w1, w2, w3, top_k):
    """HF MixtralSparseMoeBlock.forward (eval, no router jitter) on tokens x (T, H):
    router_logits = gate(x); routing_weights = softmax(logits, dim=1, dtype=float);
    topk(top_k); routing_weights /= their sum; cast to x.dtype; each chosen expert e
    adds routing_weight * w2(act(w1(x)) * w3(x)) (MixtralBlockSparseTop2MLP, act silu).
    gate (E, H); w1[e], w3[e] (I, H); w2[e] (H, I).  Returns (output, router_logits)."""
    logits = F.linear(x, gate)
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, chosen = torch.topk(weights, top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = int(chosen[t, k])
            h = F.silu(F.linear(x[t], w1[e])) * F.linear(x[t], w3[e])
            out[t] += weights[t, k] * F.linear(h, w2[e])
    return out, logits

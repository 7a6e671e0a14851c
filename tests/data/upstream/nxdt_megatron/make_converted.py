#!/usr/bin/env python3
"""The tags loads_converted.out.txt was made from: NNM checkpoints converted by nnm2nxdt-ckpt.

    /usr/bin/python3 make_converted.py BUILD OUT

writes two NNM checkpoints under OUT/nnm (tests/interop/nnm_fixture.py: torch modules and a
stepped torch AdamW, one process's run cut into tp 2 pp 2 as NNM saves it with ZeRO-1
(wrap_with_zero; NxDT's default is ZeRO-1 too), with NNM's hyper_parameters.cfg):
  - llama: rmsnorm, SwiGLU, RoPE, 4 heads over 2 KV heads, 4 layers, NNM's own grouping;
  - gpt: layernorm, GELU, biases, learned positions, the output layer tied to the embedding,
    4 layers, regrouped as NxDT groups (--optimizer_groups nxdt);
and converts each in one pass to tp 1 pp 1 with BUILD/bin/nnm2nxdt-ckpt (no hints: the format
comes from hyper_parameters.cfg). It prints the loads_shardkit.py command that loads both into
what NxDT builds from conf/tiny_llama.yaml and conf/tiny_gpt.yaml with the fixtures' sizes.
"""
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "interop"))
from nnm_fixture import make_nnm  # noqa: E402

SIZES = dict(hidden=16, ffn=24, heads=4, layers=4, vocab=32, seq=8)
MODELS = {
    "llama": (dict(SIZES, kv_heads=2, gpt=False), "megatron_llama", "keep", "conf/tiny_llama.yaml",
              ["model.num_kv_heads=2", "distributed_strategy.zero1=True"]),
    "gpt": (dict(SIZES, kv_heads=4, gpt=True), "megatron_gpt", "nxdt", "conf/tiny_gpt.yaml",
            # fp32 as the fixture trained; NxDT's GPT keeps its LayerNorm weights apart only with this off
            ["precision.type=fp32", "model.do_layer_norm_weight_decay=False", "distributed_strategy.zero1=True"]),
}


def main():
    build, out = sys.argv[1], os.path.abspath(sys.argv[2])
    args = []
    for name, (c, run_name, groups, conf, extra) in MODELS.items():
        nnm, tags = os.path.join(out, "nnm", name), os.path.join(out, name)
        # One process's run cut as NNM saves it at tp 2 pp 2, so replicas are equal as NNM keeps them.
        full, _ = make_nnm(None, c, name=run_name, write=False)
        make_nnm(nnm, c, tp=2, pp=2, zero1_dp=1, name=run_name, from_full=full[(0, 0)])
        p = subprocess.run([os.path.join(build, "bin", "nnm2nxdt-ckpt"), "--tp", "1", "--pp", "1", "--n_layers", str(c["layers"]),
                            "--nnm_ckpt_path", nnm, "--checkpoint_dir", tags, "--optimizer_groups", groups],
                           capture_output=True, text=True)
        sys.stderr.write(p.stderr)
        if p.returncode != 0:
            raise SystemExit(f"nnm2nxdt-ckpt failed on {name} ({p.returncode})")
        (tag,) = os.listdir(tags)
        sizes = [f"model.hidden_size={c['hidden']}", f"model.ffn_hidden_size={c['ffn']}",
                 f"model.num_attention_heads={c['heads']}", f"model.num_layers={c['layers']}",
                 f"model.encoder_seq_length={c['seq']}"]
        args += ["--tag", name, conf, os.path.join(tags, tag), *sizes, *extra]
    print(shlex.join([sys.executable, os.path.join(HERE, "loads_shardkit.py"), *args]))


if __name__ == "__main__":
    main()

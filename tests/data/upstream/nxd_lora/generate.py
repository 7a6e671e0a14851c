#!/usr/bin/python3
"""Ground-truth LoRA fine-tuning tags, written by NxD's real LoRA modules and save_checkpoint.

Upstream (read-only, imported from the paths below, never copied here):
  NxD   aws-neuron/neuronx-distributed            fbac349b61a3adbb123c2983835af692840ff62f  ("Release 2.29")
        modules/lora/{model,tp_layer,layer,config}.py, modules/qkv_linear.py,
        parallel_layers/{layers,parallel_state,...}.py, trainer/checkpoint.py (save_checkpoint)
  NxDT  aws-neuron/neuronx-distributed-training   9169aa03f39efd4eb02da63891a7ed98defb1714  ("2.26.0")
        models/hf_models/modeling_llama.py (the model tree), utils/model_utils.py
        (get_param_groups_by_weight_decay); LoraConfig built as
        lightning_modules/model/hf_models/llama_model.py builds it from
        examples/conf/hf_llama3_8B_SFT_lora_config.yaml `model.peft`
  torch_xla pytorch/xla v2.9.0                     5fab7053df86c8d503b98d9e7202ca8b8d4978c7
        (utils/{utils,serialization}.py, the ToXlaTensorArena class; see ../nxd_tags)

Command (Debian 12, /usr/bin/python3 3.11, python3-torch 1.13.1):
  U=/tmp/upstream   # git archive of the three commits above, as in ../nxd_tags/generate.py
  NXD_SRC=$U/nxd/src NXDT_SRC=$U/nxdt/src TORCH_XLA_SRC=$U/xla SHARDKIT_NXD_SRC=$U/nxd/src \
  SHARDKIT_NXDT_SRC=$U/nxdt/src nice -n 19 /usr/bin/python3 generate.py > generate.out.txt

It runs itself twice in child processes: `--tp 4` (the tags, kv_replicator 2) and `--tp 1`
(kv_replicator 1: the same model unsharded, whose state is the full reference; every
initial value and synthetic gradient is drawn from full-size tensors by the upstream
layers' own CPU initialisers, and AdamW is elementwise, so the tp 1 run computes the
full tensors the tp 4 shards are cut from).

Model: NxDT's HF LlamaForCausalLM (modeling_llama.py) shrunk to hidden 32, 8 query heads,
2 KV heads, head_dim 4, ffn 48, vocab 64, 2 layers; qkv_linear True, fuse_qkv False,
sequence_parallel True (as the shipped config).  LoRA: the shipped config's peft block
(lora_rank 16, lora_alpha 32, lora_dropout 0.05, bias none, target_modules [qkv_proj],
save_lora_config_adapter True, merge_sharded_lora False).  A second model
(`all_targets`) targets qkv_proj, o_proj, gate_up_proj, down_proj so the row- and
column-parallel adapters are on disk too.

Training: 2 steps of torch.optim.AdamW (lr 1e-2 so the adapters move visibly; the
recipe's betas 0.9/0.999, weight decay 0.01 / 0.0 in NxDT's two groups), no ZeRO-1 (the
recipe's zero1: False).  Gradients are synthetic: for every trainable parameter the
gradient is the same parameter of a fresh sibling layer (same upstream class, same
constructor arguments) built under torch.manual_seed(crc32(name, step)); the upstream
initialiser makes a full master tensor and cuts this rank's part, so K/V replicas get
equal gradients as NxD's KV-group all-reduce would give them.  lora_A's initial values are
drawn the same way (LoRA's own kaiming_uniform_ draw works on the local part and so depends
on tp); lora_B starts at zero as LoRA initialises it.

Saving: for rank 0..3 in turn, NxD trainer/checkpoint.py save_checkpoint(dir, tag,
model=<LoraModel>, optimizer=<AdamW>, use_xser=...): xser (the shipped config's
save_xser: True) for the shipped-config model at tp 4, plain .pt for the rest (size), in the order save_lora_base True/merge_lora False, save_lora_base False, then
merge_lora True (the last, because LoraModel._get_lora_adapter_state_dict merges in
place and the checkpoint path never unmerges).  The merged tag's weights are NxD's own
LoraGQAQKVParallelLinear.merge() on every rank.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
UP = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(UP, "nxd_tags"))
sys.path.insert(0, os.path.join(UP, "hf_llama"))

import torch  # noqa: E402

torch.set_num_threads(1)

NXD_COMMIT = "fbac349b61a3adbb123c2983835af692840ff62f"
NXDT_COMMIT = "9169aa03f39efd4eb02da63891a7ed98defb1714"
H, NH, KVH, HD, FFN, VOCAB, LAYERS = 32, 8, 2, 4, 48, 64, 2
STEPS = 2
SEED = 4141
# the shipped config's peft block (examples/conf/hf_llama3_8B_SFT_lora_config.yaml)
PEFT = dict(lora_rank=16, lora_alpha=32, lora_dropout=0.05, bias="none", lora_verbose=False,
            load_lora_from_ckpt=False, save_lora_config_adapter=True, merge_sharded_lora=False)
MODELS = {"qkv": ["qkv_proj"], "all_targets": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
MODES = [("base_adapter", dict(save_lora_base=True, merge_lora=False)),
         ("adapter_only", dict(save_lora_base=False, merge_lora=False)),
         ("merged", dict(save_lora_base=True, merge_lora=True))]
NOTES = []


def note(name, what, why):
    NOTES.append((name, what, why))


def install(tp):
    import nxd_stubs
    import upstream_env
    mods = nxd_stubs.install(tp, 1, 1)
    real_packaging = {k: v for k, v in sys.modules.items() if k == "packaging" or k.startswith("packaging.")}
    upstream_env._make_transformers_stubs()
    sys.modules.update(real_packaging)  # keep the real packaging; only transformers is stubbed
    note("transformers (hf_llama/upstream_env.py _make_transformers_stubs)",
         "HF base classes as plain nn.Modules, LlamaConfig as a plain attribute bag",
         "transformers is not installed; NxDT's modeling_llama.py imports its base classes")
    root = os.path.join(os.environ["NXDT_SRC"], "neuronx_distributed_training")
    for sub in ("", "utils", "models", "models/hf_models"):
        name = "neuronx_distributed_training" + ("." + sub.replace("/", ".") if sub else "")
        nxd_stubs._pkg_shell(name, os.path.join(root, sub))
    note("neuronx_distributed_training packages", "package objects whose __init__.py is not executed",
         "the __init__ files register NeMo optimizers and apply patches (NeMo not available)")
    for n in ("neuronx_distributed.kernels", "neuronx_distributed.kernels.flash_attn",
              "neuronx_distributed.kernels.ring_attention_kernel"):
        nxd_stubs._new_module(n, pkg_path=[], nki_flash_attn_func=None, nki_ring_attn_func=None)
    note("neuronx_distributed.kernels.{flash_attn,ring_attention_kernel}", "modules with None kernels",
         "NKI kernels need the Neuron SDK; flash/ring attention are off in this model (forward not run)")
    real_to = torch.nn.Module.to

    def to(self, *a, **k):
        if a and isinstance(a[0], str) and a[0] == "xla":
            return self
        return real_to(self, *a, **k)

    torch.nn.Module.to = to
    note("torch.nn.Module.to('xla')", "returns the module unchanged (stays on CPU)",
         "LoraModel._replace_module moves each lora_ module to 'xla'; there is no XLA device here")
    stub_groups(nxd_stubs)
    import neuronx_distributed.modules.lora as lora
    import neuronx_distributed_training.models.hf_models.modeling_llama as ml
    import neuronx_distributed_training.utils.model_utils as mu
    nxd_stubs.rebind()
    return mods["ckpt"], lora, ml, mu


class TpGroup:
    """What the parallel layers ask of the tp process group: size() and rank()."""

    def size(self):
        return len(SIM().group_of("tp_groups"))

    def rank(self):
        return SIM().index_in("tp_groups")


def SIM():
    from nxd_stubs import SIM as sim
    return sim


def stub_groups(nxd_stubs):
    import neuronx_distributed.parallel_layers.parallel_state as ps
    patches = dict(get_tensor_model_parallel_group=lambda *a, **k: TpGroup(),
                   initialize_kv_group=lambda *a, **k: None)
    for k, v in patches.items():
        nxd_stubs._REBIND[getattr(ps, k)] = v
        setattr(ps, k, v)
    nxd_stubs.rebind()
    note("parallel_state.get_tensor_model_parallel_group", "object with size()/rank() of the simulated tp group",
         "layers.py reads the group's size and rank at construction; no process group exists")
    note("parallel_state.initialize_kv_group", "no-op",
         "it builds the KV-shared process groups (collectives only); the KV placement on disk is decided by "
         "qkv_linear.py _initialize_affine_weight from the platform (trn1 here, see nxd_stubs)")


def llama_config(ml, tp):
    cfg = sys.modules["transformers.models.llama.configuration_llama"].LlamaConfig(
        hidden_size=H, intermediate_size=FFN, num_attention_heads=NH, num_key_value_heads=KVH, head_dim=HD,
        num_hidden_layers=LAYERS, vocab_size=VOCAB, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64, initializer_range=0.02, tie_word_embeddings=False, pad_token_id=None,
        rope_scaling=None, pretraining_tp=1, use_cache=False, return_dict=False, output_attentions=False,
        output_hidden_states=False, use_return_dict=False, model_type="llama", torch_dtype=torch.float32,
        # hf_llama_model.py HFLLamaModule._get_model, shipped config values
        sequence_parallel_enabled=True, qkv_linear=True, fuse_qkv=False, kv_shared_group_size=2 if tp > 1 else 1,
        use_flash_attention=False, use_ring_attention=False, lnc=1, transpose_nki_inputs=True,
        reduce_dtype=torch.float32)
    return cfg


def sibling(mod):
    """A fresh layer of mod's upstream class with mod's constructor arguments (for gradients)."""
    from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    from neuronx_distributed.parallel_layers import ColumnParallelLinear, RowParallelLinear
    if isinstance(mod, GQAQKVColumnParallelLinear):
        return GQAQKVColumnParallelLinear(input_size=mod.input_size, output_sizes=mod.output_sizes, bias=False,
                                          gather_output=False, dtype=torch.float32,
                                          kv_size_multiplier=mod.kv_size_multiplier, fuse_qkv=mod.fuse_qkv)
    if isinstance(mod, RowParallelLinear):
        return RowParallelLinear(input_size=mod.input_size, output_size=mod.output_size, bias=False,
                                 input_is_parallel=True)
    if isinstance(mod, ColumnParallelLinear):
        return ColumnParallelLinear(input_size=mod.input_size, output_size=mod.output_size, bias=False,
                                    gather_output=False)
    assert type(mod) is torch.nn.Linear, type(mod)
    return torch.nn.Linear(mod.in_features, mod.out_features, bias=False, dtype=torch.float32)


def drawn(model, which, key):
    """(param, value) for every adapter parameter in `which`, values drawn by a sibling layer."""
    for mname, mod in model.module.named_modules():
        if not mname.endswith(which):
            continue
        torch.manual_seed(zlib.crc32(f"{mname}/{key}".encode()))
        sib = dict(sibling(mod).named_parameters())
        for pname, p in mod.named_parameters():
            assert p.requires_grad and sib[pname].shape == p.shape, (mname, pname)
            yield p, sib[pname].detach().clone()


def set_grads(model, step):
    for p, g in drawn(model, (".lora_A", ".lora_B"), step):
        p.grad = g


def redraw_lora_A(model):
    # LoraLayer.init_lora_parameters draws lora_A with kaiming_uniform_ on this rank's part
    # (a row-parallel lora_A is [r, in/tp]) from the global RNG stream, so its values depend on
    # tp; draw them again from a full master tensor so the tp 1 run is the same model.
    with torch.no_grad():
        for p, v in drawn(model, (".lora_A",), "init"):
            p.copy_(v)


def build_and_train(lora, ml, mu, tp, targets):
    torch.manual_seed(SEED)
    base = ml.LlamaForCausalLM(llama_config(ml, tp))
    torch.manual_seed(SEED + 1)
    cfg = lora.LoraConfig(target_modules=list(targets), save_lora_base=True, merge_lora=False, **PEFT)
    model = lora.LoraModel(base, cfg)
    redraw_lora_A(model)
    # NxDT base_model.py setup_optimizer_param_groups: no_decay ["bias"] + LayerNorm/norm
    # (do_layer_norm_weight_decay True in the shipped config)
    groups = mu.get_param_groups_by_weight_decay(model, ["bias", "LayerNorm", "norm"])
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def run_child(tp, out):
    from nxd_stubs import SIM
    ckpt, lora, ml, mu = install(tp)
    report = {"tp": tp, "stubs": NOTES}
    for mname, targets in MODELS.items():
        trained = {}
        for r in range(tp):
            SIM.set_rank(r)
            trained[r] = build_and_train(lora, ml, mu, tp, targets)
        report[mname] = {"param_order": [n for n, _ in trained[0][0].named_parameters()],
                         "trainable": [n for n, p in trained[0][0].named_parameters() if p.requires_grad]}
        for mode, flags in MODES:
            d = os.path.join(out, f"{mname}_tp{tp}", mode)
            for r in range(tp):
                SIM.set_rank(r)
                model, opt = trained[r]
                model.lora_config.save_lora_base = flags["save_lora_base"]
                model.lora_config.merge_lora = flags["merge_lora"]
                ckpt.save_checkpoint(d, "step_2", model=model, optimizer=opt, use_xser=(tp > 1 and mname == "qkv"))
            ckpt.finalize_checkpoint()
    SIM.set_rank(0)
    with open(os.path.join(out, f"report_tp{tp}.json"), "w") as f:
        json.dump(report, f, indent=1)


def manifest(root):
    files = {}
    for d, _, names in os.walk(root):
        for n in sorted(names):
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            if rel.startswith(("manifest.json", "generate", "README", "load_check", "report_")) or rel.endswith(".py"):
                continue
            with open(p, "rb") as f:
                b = f.read()
            files[rel] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    return dict(sorted(files.items()))


def blob(path):
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int)
    ap.add_argument("--out", default=HERE)
    a = ap.parse_args()
    if a.tp:
        return run_child(a.tp, a.out)
    for tp in (4, 1):
        # PYTHONHASHSEED: LoraConfig.__post_init__ stores list(set(target_modules)), saved in lora_config
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run([sys.executable, __file__, "--tp", str(tp), "--out", a.out], check=True, env=env)
    nxd = os.path.join(os.environ["NXD_SRC"], "neuronx_distributed")
    nxdt = os.path.join(os.environ["NXDT_SRC"], "neuronx_distributed_training")
    ran = {f"nxd/{p}": blob(os.path.join(nxd, p)) for p in (
        "modules/lora/model.py", "modules/lora/tp_layer.py", "modules/lora/layer.py", "modules/lora/config.py",
        "modules/qkv_linear.py", "parallel_layers/layers.py", "trainer/checkpoint.py")}
    ran.update({f"nxdt/{p}": blob(os.path.join(nxdt, p)) for p in (
        "models/hf_models/modeling_llama.py", "utils/model_utils.py")})
    m = {"nxd_commit": NXD_COMMIT, "nxdt_commit": NXDT_COMMIT, "git_blobs_ran": ran, "files": manifest(a.out)}
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(m, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in m.items() if k != "files"}, indent=1))
    print(f"{len(m['files'])} files, {sum(v['bytes'] for v in m['files'].values())} bytes")


if __name__ == "__main__":
    main()

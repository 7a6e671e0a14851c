#!/usr/bin/python3
"""Ground-truth NxD checkpoint tags of a VIRTUAL-PIPELINE run (pp 2, 2 virtual
stages), written by the real upstream code: NxD's pipeline wrapper NxDPPModel
(trace, auto partition, local_state_dict, local_named_parameters), NxD's
ZeRO-1 optimizer, NxD's save_checkpoint.

Upstream (read-only, imported from the paths below, never copied here):
  NxD   aws-neuron/neuronx-distributed            fbac349b61a3adbb123c2983835af692840ff62f  ("Release 2.29")
  NxDT  aws-neuron/neuronx-distributed-training   9169aa03f39efd4eb02da63891a7ed98defb1714  (not run by this file)
  torch_xla pytorch/xla v2.9.0                     5fab7053df86c8d503b98d9e7202ca8b8d4978c7
        (the 4 pure-Python pieces nxd_tags/nxd_stubs.py loads)

Exact command (Debian 12, /usr/bin/python3 3.11, python3-torch 1.13, as nxd_tags):

  U=/tmp/vp_up
  git --git-dir=<nxd.git> archive fbac349b61a3adbb123c2983835af692840ff62f | tar -x -C $U/nxd
  git --git-dir=<xla.git> archive v2.9.0 torch_xla/utils/serialization.py torch_xla/utils/utils.py \\
      torch_xla/distributed/zero_redundancy_optimizer.py torch_xla/core/xla_model.py | tar -x -C $U/xla
  NXD_SRC=$U/nxd/src TORCH_XLA_SRC=$U/xla nice -n 19 /usr/bin/python3 generate.py > generate.out.txt

Stubs: nxd_tags/nxd_stubs.py (imported, not copied) plus the few in
vpp_model.install(); all printed by `generate.py --list-stubs` and listed in
README.md.  No upstream line is changed.

Ranks: tp=2 pp=2 dp=2 (world 8), virtual_pipeline_size=2.  Each rank builds
the model and wraps it in NxDPPModel (through NxD's initialize_parallel_model)
one after another (fx tracing patches globals, so not in threads); training
(2 ZeRO-1 steps on synthetic gradients) runs one thread per rank so that the
reduce-scatter/all-gather move real data; saving calls NxD's save_checkpoint
for rank 0..7 in turn.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

import vpp_model as vm  # noqa: E402  (puts ../nxd_tags on sys.path)
import nxd_stubs  # noqa: E402
from nxd_stubs import SIM  # noqa: E402

STEPS = 2
TAG = f"step_{STEPS}"
TAGS = {"nxd_pt": False, "nxd_xser": True}  # dir -> use_xser

# NxD's own llama example route (nxd_tags ROUTES["nxd"]): bf16 model, ZeRO-1
# with fp32 master weights kept in the checkpoint.
OPTIMIZER_CONFIG = {"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": 1.0}
MIXED_PRECISION_CONFIG = {"use_master_weights": True, "use_fp32_grad_acc": True, "use_master_weights_in_ckpt": True}
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)
SCHED = dict(max_steps=10, min_lr=3e-5, warmup_steps=1, constant_steps=0)


def nxd_tags_generate():
    """nxd_tags/generate.py as a module (its report/record_writes/check_compact
    helpers are reused, not copied).  Its top level sets the interop thread
    count again, which torch allows only once: that call is skipped."""
    set_interop = torch.set_num_interop_threads
    torch.set_num_interop_threads = lambda n: None
    try:
        return nxd_stubs._load_source("nxd_tags_generate", os.path.join(HERE, "..", "nxd_tags", "generate.py"))
    finally:
        torch.set_num_interop_threads = set_interop


def build_rank(nxd_config, rank):
    """NxD's initialize_parallel_model (NxDPPModel inside NxDModel) and
    initialize_parallel_optimizer with the example's weight-decay groups."""
    import neuronx_distributed.trainer.trainer as nxd_trainer

    cfg = dict(nxd_config, pipeline_config=dict(nxd_config["pipeline_config"]))
    model = nxd_trainer.initialize_parallel_model(cfg, vm.build_model, False, torch.bfloat16)
    groups = example_param_groups(model)
    optimizer = nxd_trainer.initialize_parallel_optimizer(cfg, torch.optim.AdamW, groups, **ADAMW)
    return model, optimizer


def example_param_groups(model):
    """examples/training/llama/training_utils.py:get_param_groups_by_weight_decay,
    loaded from NXD_SRC and run unchanged."""
    path = os.path.join(os.environ["NXD_SRC"], "..", "examples", "training", "llama", "training_utils.py")
    src = open(path).read()
    import ast

    tree = ast.parse(src)
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_param_groups_by_weight_decay"]
    ns = {}
    exec(compile(ast.Module(body=fn, type_ignores=[]), path, "exec"), ns)
    return ns["get_param_groups_by_weight_decay"](model)


def train_rank(model, optimizer, sched, rank):
    from neuronx_distributed.parallel_layers import parallel_state as ps

    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    named = list(model.named_parameters())  # NxDModel -> NxDPPModel.local_named_parameters
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = 0.0
        for name, p in named:
            g = vm.tp_slice(vm.full_grad(name, vm.full_shape(name, p), step, dp_rank), vm.partition_dim_of(name, p), tp_rank)
            loss = loss + (p.float() * g).sum()
        loss.backward()
        optimizer.step()
        sched.step()


def sha(t):
    t = t.detach().reshape(-1).contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def layout_report(built, out):
    """Per pp rank: stage modules, local_state_dict (names, shapes, sha256),
    local_named_parameters order and the optimizer's param id order."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    P = lambda *a: print(*a, file=out)  # noqa: E731
    P("## layout (real NxDPPModel, virtual_pipeline_size=%d)" % vm.VPP)
    for r in range(SIM.world_size):
        SIM.set_rank(r)
        tp_r, pp_r, dp_r = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                            ps.get_data_parallel_rank())
        model, optimizer, _ = built[r]
        pp = model.module
        if r == 0:
            P(f"pipeline_cuts (NxD create_partitions over {pp.pipeline_parallel_size}*{pp.virtual_pipeline_size} "
              f"stages): {pp.pipeline_cuts}")
            for s, part in enumerate(pp.partitions):
                mods = sorted({n for n, _ in part.named_children()})
                P(f"  stage {s} -> pp rank {s % vm.PP}: children {mods}")
        if dp_r != 0:
            continue
        P(f"### rank {r} tp={tp_r} pp={pp_r} dp={dp_r}")
        P(f"  local stages: {[s for s in range(len(pp.partitions)) if s % vm.PP == pp_r]}")
        sd = pp.local_state_dict()
        P(f"  local_state_dict(): {len(sd)} entries (dict order)")
        for k, v in sd.items():
            P(f"    {k} {str(v.dtype).replace('torch.', '')} {list(v.shape)} sha256:{sha(v)}")
        names = [n for n, _ in pp.local_named_parameters()]
        ids = {id(p): n for n, p in pp.local_named_parameters()}
        P(f"  local_named_parameters(): {names}")
        osd = optimizer.state_dict()
        for gi, g in enumerate(optimizer.param_groups):
            P(f"  optimizer param_groups[{gi}] (weight_decay={g['weight_decay']}): "
              f"ids {osd['param_groups'][gi]['params']} = {[ids[id(p)] for p in g['params']]}")
    SIM.set_rank(0)
    P("")


def gather_full(built):
    """Full-size tensors (tp shards concatenated on each parameter's own
    partition_dim; ZeRO-1 shards concatenated on dim 0 over dp, padding cut)."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    per = {}  # name -> {(tp, dp): (param, state, master)}
    for r in range(SIM.world_size):
        SIM.set_rank(r)
        tp_r, dp_r = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
        model, optimizer, _ = built[r]
        osd = optimizer.state_dict()
        order = [n for g in optimizer.param_groups for n in _names_of(model, g)]
        params = dict(model.module.local_named_parameters())
        for i, name in enumerate(order):
            st = osd["base_state"][i]
            per.setdefault(name, {})[(tp_r, dp_r)] = (params[name], st, osd["sharded_master_weights"][i])
    SIM.set_rank(0)
    full = {}
    for name, d in sorted(per.items()):
        p0 = d[(0, 0)][0]
        dim = vm.partition_dim_of(name, p0)
        full[f"model/{name}"] = _cat_tp([d[(t, 0)][0].detach() for t in range(vm.TP)], dim)
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"optim/{key}/{name}"] = _cat_tp(
                [_cat_dp([d[(t, q)][1][key] for q in range(vm.DP)], p0.shape[0]) for t in range(vm.TP)], dim)
        full[f"optim/master/{name}"] = _cat_tp(
            [_cat_dp([d[(t, q)][2] for q in range(vm.DP)], p0.shape[0]) for t in range(vm.TP)], dim)
        full[f"optim/step/{name}"] = d[(0, 0)][1]["step"].clone()
    return full


def _names_of(model, group):
    ids = {id(p): n for n, p in model.module.local_named_parameters()}
    return [ids[id(p)] for p in group["params"]]


def _cat_tp(ts, dim):
    return ts[0].clone() if dim is None else torch.cat(ts, dim=dim)


def _cat_dp(ts, rows):
    return torch.cat([t.detach().cpu() for t in ts], dim=0)[:rows].clone()


def write_manifest():
    manifest = {}
    for dp, _, fs in sorted(os.walk(HERE)):
        if "__pycache__" in dp:
            continue
        for f in sorted(fs):
            if f == "manifest.json":
                continue
            p = os.path.join(dp, f)
            with open(p, "rb") as fh:
                b = fh.read()
            manifest[os.path.relpath(p, HERE)] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    with open(os.path.join(HERE, "manifest.json"), "w") as fh:
        json.dump(dict(sorted(manifest.items())), fh, indent=1)
        fh.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--list-stubs", action="store_true")
    ap.add_argument("--manifest-only", action="store_true", help="rewrite manifest.json and stop")
    args = ap.parse_args()
    if args.manifest_only:
        write_manifest()
        return

    os.environ.pop("XLA_DOWNCAST_BF16", None)
    vm.install()
    gen = nxd_tags_generate()
    import neuronx_distributed as nxd
    import neuronx_distributed.trainer.trainer as nxd_trainer
    from neuronx_distributed.parallel_layers import parallel_state as ps

    ps.initialize_model_parallel = lambda *a, **k: None
    nxd_stubs._note("parallel_state.initialize_model_parallel (generate.py, after the mesh is known)", "no-op",
                    "as in nxd_tags/generate.py")
    nxd_config = nxd_trainer.neuronx_distributed_config(
        tensor_parallel_size=vm.TP, pipeline_parallel_size=vm.PP, pipeline_config=vm.pipeline_config(),
        optimizer_config=dict(OPTIMIZER_CONFIG), mixed_precision_config=dict(MIXED_PRECISION_CONFIG),
        sequence_parallel=False,
    )
    writes = gen.record_writes()
    if args.list_stubs:
        for n, what, why, aff in nxd_stubs.STUB_NOTES:
            print(f"- **{n}**: {what}. *Why:* {why}. *Bytes on disk:* {aff}.")
        return

    lr_mod = gen.load_nxd_example_lr()
    built = SIM.run_sequential(lambda r: build_rank(nxd_config, r))
    built = {r: (m, o, lr_mod.CosineAnnealing(o, last_epoch=-1, **SCHED)) for r, (m, o) in built.items()}
    SIM.run_threaded(lambda r: train_rank(*built[r], r))

    print("# nxd_vpp generate.py: tp=%d pp=%d dp=%d vpp=%d layers=%d steps=%d" %
          (vm.TP, vm.PP, vm.DP, vm.VPP, vm.NUM_LAYERS, STEPS))
    layout_report(built, sys.stdout)
    for name, xser in TAGS.items():
        ckpt_dir = os.path.join(HERE, name)
        if os.path.exists(ckpt_dir):
            shutil.rmtree(ckpt_dir)
        nxd.trainer.checkpoint.g_iostate = None

        def save(rank):
            model, optimizer, sched = built[rank]
            nxd.save_checkpoint(
                ckpt_dir, tag=TAG, model=model, optimizer=optimizer, scheduler=sched,
                user_content={"total_steps": STEPS, "batch_idx": STEPS - 1, "epoch": 0,
                              "cli_args": {"tensor_parallel_size": vm.TP, "pipeline_parallel_size": vm.PP,
                                           "virtual_pipeline_size": vm.VPP, "use_zero1_optimizer": 1,
                                           "use_master_weight_in_ckpt": True, "save_load_xser": int(xser)}},
                use_xser=xser, num_kept_ckpts=None, async_save=False,
            )

        del writes[:]
        SIM.run_sequential(save)
        gen.check_compact(ckpt_dir)
        gen.report(name, TAG, ckpt_dir, built, list(writes), sys.stdout)

    full = gather_full(built)
    torch.save(full, os.path.join(HERE, "full_state.pt"))
    print(f"## full_state.pt: {len(full)} tensors")
    for k, v in full.items():
        print(f"  {k} {str(v.dtype).replace('torch.', '')} {list(v.shape)} sha256:{sha(v)[:16]}")
    write_manifest()


if __name__ == "__main__":
    main()

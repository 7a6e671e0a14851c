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
SCHED = dict(max_steps=10, min_lr=3e-5, warmup_steps=1, constant_steps=0)  # examples/training/llama/lr.py


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
            P(f"    {k} {str(v.dtype).replace('torch.', '')} {list(v.shape)} sha256:{vm.tensor_sha256(v)}")
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


# what manifest.json covers: the data (scripts and README are source, reviewed as such)
MANIFEST_ROOTS = ("nxd_pt", "nxd_xser", "full_state.pt", "generate.out.txt", "load_check.out.txt",
                  "converter_check.out.txt")


def write_manifest():
    manifest = {}
    for root in MANIFEST_ROOTS:
        top = os.path.join(HERE, root)
        paths = [top] if os.path.isfile(top) else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
        for p in paths:
            with open(p, "rb") as fh:
                b = fh.read()
            manifest[os.path.relpath(p, HERE)] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    with open(os.path.join(HERE, "manifest.json"), "w") as fh:  # one file a line
        fh.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(manifest.items())) + "\n}\n")


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

    nxd_config = vm.nxd_config()
    writes = gen.record_writes()
    if args.list_stubs:
        for n, what, why, aff in nxd_stubs.STUB_NOTES:
            print(f"- **{n}**: {what}. *Why:* {why}. *Bytes on disk:* {aff}.")
        return

    lr_mod = gen.load_nxd_example_lr()
    built = SIM.run_sequential(lambda r: vm.build_rank(nxd_config))
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
        print(f"  {k} {str(v.dtype).replace('torch.', '')} {list(v.shape)} sha256:{vm.tensor_sha256(v)[:16]}")
    write_manifest()


if __name__ == "__main__":
    main()

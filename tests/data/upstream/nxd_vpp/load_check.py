#!/usr/bin/python3
"""NxD's own load_checkpoint reads a virtual-pipeline tag back on every rank.
Dev-time tool (needs the upstream sources; environment as in generate.py).

  NXD_SRC=... TORCH_XLA_SRC=... nice -n 19 /usr/bin/python3 load_check.py \\
      [--tag PATH] [--tp 2 --pp 2 --dp 2 --vpp 2]

--tag defaults to this folder's nxd_xser/step_2 and nxd_pt/step_2 (both).  Any
tag of this fixture's model (vpp_model.py) at this layout can be given, e.g.
one shardkit wrote.  The model's sizes are vpp_model.py's; tp/pp/dp/vpp must
equal vpp_model.py's (other layouts would need another model build: refused).

Two loads per tag, each on all 8 simulated ranks (one thread each: NxD's xser
loader broadcasts replicated tensors with an all-reduce over dp):
  1. dict form: load_checkpoint(dir, tag, model={}, optimizer={}) -- what is
     in each rank's files (keys, dtype, shape, sha256 prefix);
  2. module form, as run_llama_nxd.py resumes: the real NxDPPModel
     (virtual_pipeline_size=VPP, built through initialize_parallel_model) and
     the real NxD ZeRO-1 optimizer, load_checkpoint(dir, tag, model=NxDModel,
     optimizer=NxDOptimizer, scheduler=None).  NxDPPModel.load_state_dict
     splits the names over its model chunks with strict=True, so a missing,
     extra or misplaced layer fails here.  Then every local_state_dict()
     tensor must equal the dict form's and the optimizer's state_dict() must
     hold the dict form's tensors (base_state and sharded_master_weights).
Exit status non-zero on any failure.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

import vpp_model as vm  # noqa: E402  (puts ../nxd_tags on sys.path)
from nxd_stubs import SIM  # noqa: E402


def short_sha(t):
    return vm.tensor_sha256(t)[:12]


def tensors(obj, path=""):
    """(path, tensor) for every tensor in obj, in traversal order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]")


def coords():
    from neuronx_distributed.parallel_layers import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()


def load_dicts(ckpt_dir, tag):
    import neuronx_distributed.trainer.checkpoint as ckpt

    def load(rank):
        model, optim = {}, {}
        uc = ckpt.load_checkpoint(ckpt_dir, tag, model=model, optimizer=optim)
        return coords(), model, optim, uc

    return SIM.run_threaded(load)


def load_modules(ckpt_dir, tag, built):
    import neuronx_distributed.trainer.checkpoint as ckpt

    def load(rank):
        model, optimizer = built[rank]
        ckpt.load_checkpoint(ckpt_dir, tag, model=model, optimizer=optimizer, scheduler=None)
        return model.module.local_state_dict(), optimizer.state_dict()

    return SIM.run_threaded(load)


def zero1_tensors(osd, keys):
    """The ZeRO-1 state's tensors under `keys` (base_state, and sharded_master_weights when saved)."""
    return [t for _, t in tensors({k: osd[k] for k in keys})]


def print_dict_form(r, coords_, model, optim, errors):
    tp_r, pp_r, dp_r = coords_
    print(f"## rank {r} (tp={tp_r} pp={pp_r} dp={dp_r}) dict form")
    if not model or not optim:
        errors.append(f"rank {r}: empty model or optimizer state")
    print(f"  model: {len(model)} keys")
    for k, v in model.items():
        print(f"  model[{k!r}]: {str(v.dtype).replace('torch.', '')} {list(v.shape)} sha256:{short_sha(v)}")
    ot = list(tensors(optim))
    base, masters = optim.get("base_state", {}), optim.get("sharded_master_weights", {})
    print(f"  optim: {len(ot)} tensors; param_groups ids {[g['params'] for g in optim.get('param_groups', [])]}")
    for i, st in base.items():  # one line per optimizer id
        m = masters.get(i)
        shown = f"{str(m.dtype).replace('torch.', '')} {list(m.shape)} {short_sha(m)}" if m is not None else "none"
        print(f"  optim id {i}: step {st['step'].item():g}; exp_avg {list(st['exp_avg'].shape)} "
              f"sha256:{short_sha(st['exp_avg'])}; exp_avg_sq {short_sha(st['exp_avg_sq'])}; master {shown}")
    if len(ot) != 3 * len(base) + len(masters):
        errors.append(f"rank {r}: optimizer tensors other than step/exp_avg/exp_avg_sq/master: {len(ot)}")


def compare_module_form(r, sd, osd, model, optim, errors):
    """After NxD's load into the real modules: the same keys and tensors as the files."""
    before = len(errors)
    if list(sd) != list(model):
        errors.append(f"rank {r}: NxDPPModel.local_state_dict() keys {list(sd)} != file keys {list(model)}")
    bad = [k for k in sd if k in model and not torch.equal(sd[k].float(), model[k].float())]
    if bad:
        errors.append(f"rank {r}: model tensors differ after the module load: {bad}")
    keys = [k for k in ("base_state", "sharded_master_weights") if k in optim]
    want, got = zero1_tensors(optim, keys), zero1_tensors(osd, keys)
    if len(want) != len(got) or any(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(want, got)):
        errors.append(f"rank {r}: optimizer state after the module load differs from the files")
    print(f"## rank {r} module form: local_state_dict {len(sd)} keys, optimizer {len(got)} tensors: "
          f"{'equal to the files' if len(errors) == before else 'DIFFERENT'}")


def check_tag(tag_path, built):
    ckpt_dir, tag = os.path.dirname(tag_path), os.path.basename(tag_path)
    shown = os.path.relpath(tag_path, HERE) if tag_path.startswith(HERE) else tag_path
    print(f"# load_check {shown}: tp={vm.TP} pp={vm.PP} dp={vm.DP} vpp={vm.VPP}")
    errors = []
    try:
        dicts = load_dicts(ckpt_dir, tag)
    except BaseException as e:  # noqa: BLE001
        print(f"FAILED (dict form): {type(e).__name__}: {e}")
        return 1
    for r in sorted(dicts):
        coords_, model, optim, uc = dicts[r]
        print_dict_form(r, coords_, model, optim, errors)
        if r == 0:
            print(f"  user_content: {uc!r}")
    try:
        mods = load_modules(ckpt_dir, tag, built)
    except BaseException as e:  # noqa: BLE001
        print(f"FAILED (module form, real NxDPPModel + ZeRO-1 optimizer): {type(e).__name__}: {e}")
        return 1
    for r in sorted(mods):
        compare_module_form(r, *mods[r], dicts[r][1], dicts[r][2], errors)
    for e in errors:
        print(f"ERROR: {e}")
    print(f"# result: {'OK' if not errors else 'FAILED'}")
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", action="append", help="tag directory (default: this folder's two tags)")
    for k in ("tp", "pp", "dp", "vpp"):
        ap.add_argument(f"--{k}", type=int, default=getattr(vm, k.upper()))
    args = ap.parse_args()
    if (args.tp, args.pp, args.dp, args.vpp) != (vm.TP, vm.PP, vm.DP, vm.VPP):
        print(f"load_check.py: only tp={vm.TP} pp={vm.PP} dp={vm.DP} vpp={vm.VPP} (vpp_model.py) is built here",
              file=sys.stderr)
        return 2
    tags = args.tag or [os.path.join(HERE, "nxd_xser", "step_2"), os.path.join(HERE, "nxd_pt", "step_2")]

    vm.install()
    vm.nxd_stubs._note("AdamWTorch2Args (load_check.py)", "torch.optim.AdamW that drops the `differentiable` keyword",
                       "see vpp_model.AdamWTorch2Args: a torch 1.13 vs 2.x difference in ZeRO-1 load_state_dict")
    config = vm.nxd_config()
    status = 0
    for t in tags:
        built = SIM.run_sequential(lambda r: vm.build_rank(config, vm.AdamWTorch2Args))  # fresh model and optimizer per tag
        status |= check_tag(os.path.abspath(t.rstrip("/")), built)
    return status


if __name__ == "__main__":
    sys.exit(main())

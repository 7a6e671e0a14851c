#!/usr/bin/python3
"""Load a checkpoint tag with NxD's own load_checkpoint, every rank, and print
what each rank got.  Dev-time tool (needs the upstream sources; see
generate.py for the environment variables and the upstream commits).

  NXD_SRC=... TORCH_XLA_SRC=... [NXDT_SRC=... LIGHTNING_UTILITIES_SRC=... NEMO_SRC=...] \\
      nice -n 19 /usr/bin/python3 load_check.py <checkpoint_dir>/<tag> [--via nxd|nxdt] [--tp N --pp N --dp N]

--via nxd  (default) calls neuronx_distributed.trainer.checkpoint.load_checkpoint(
           dir, tag, model={}, optimizer={}) on every rank: the dict form NxDT uses.
--via nxdt calls NxDT's NLPCheckpointIO.load_checkpoint(dir/tag, load_type_xser)
           (which calls the same NxD function, then builds the Lightning dict).

Topology: tp and pp are read from the model/ file names, dp from the highest
optim/dp_rank_XX (1 if only dp_rank_00 exists); override with --tp/--pp/--dp.

Ranks run one thread each (NxD's xser loader broadcasts replicated tensors
with an all-reduce between data-parallel ranks, so ranks cannot run one after
another); the report is printed per rank in rank order.  For each tensor:
dtype, shape and the first 16 hex digits of sha256 over its raw bytes
(row-major).  Exit status is non-zero when any rank fails or loads nothing.
"""

import argparse
import hashlib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

import nxd_stubs  # noqa: E402
from nxd_stubs import SIM  # noqa: E402


def sha(t):
    t = t.detach().reshape(-1).contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _has_tensor(o):
    if isinstance(o, torch.Tensor):
        return True
    if isinstance(o, dict):
        return any(_has_tensor(v) for v in o.values())
    if isinstance(o, (list, tuple)):
        return any(_has_tensor(v) for v in o)
    return False


def describe(obj, path=""):
    """Flatten obj into lines: tensors with dtype/shape/checksum, other leaves by repr."""
    out = []
    if isinstance(obj, torch.Tensor):
        out.append(f"{path}: tensor {str(obj.dtype).replace('torch.', '')} {list(obj.shape)} sha256:{sha(obj)}")
    elif isinstance(obj, dict) and not _has_tensor(obj) and len(repr(obj)) < 400:
        out.append(f"{path}: {obj!r}")
    elif isinstance(obj, dict):
        if not obj:
            out.append(f"{path}: {type(obj).__name__}{{}}")
        for k, v in obj.items():
            out.extend(describe(v, f"{path}[{k!r}]"))
    elif isinstance(obj, (list, tuple)) and any(isinstance(x, (torch.Tensor, dict, list, tuple)) for x in obj):
        for i, v in enumerate(obj):
            out.extend(describe(v, f"{path}[{i}]"))
    else:
        out.append(f"{path}: {type(obj).__name__} {obj!r}")
    return out


def infer_topology(tag_path):
    tps, pps, dps = set(), set(), set()
    pat = re.compile(r"dp_rank_(\d+)_(?:ep_rank_\d+_)?tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
    for sub in ("model", "optim"):
        d = os.path.join(tag_path, sub)
        if not os.path.isdir(d):
            continue
        for f in os.listdir(d):
            m = pat.match(f)
            if m:
                dp_, tp_, pp_ = map(int, m.groups())
                tps.add(tp_)
                pps.add(pp_)
                if sub == "optim":
                    dps.add(dp_)
    return (max(tps) + 1 if tps else 1, max(pps) + 1 if pps else 1, max(dps) + 1 if dps else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tag_path")
    ap.add_argument("--via", choices=["nxd", "nxdt"], default="nxd")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--dp", type=int)
    args = ap.parse_args()

    tag_path = os.path.abspath(args.tag_path.rstrip("/"))
    ckpt_dir, tag = os.path.dirname(tag_path), os.path.basename(tag_path)
    tp, pp, dp = infer_topology(tag_path)
    tp, pp, dp = args.tp or tp, args.pp or pp, args.dp or dp

    mods = nxd_stubs.install(tp, pp, dp, with_nxdt=(args.via == "nxdt"))
    import neuronx_distributed as nxd
    from neuronx_distributed.parallel_layers import parallel_state as ps

    xser = mods["ckpt"].create_checkpoint_storage(ckpt_dir).is_checkpoint_xser(tag)

    def load(rank):
        if args.via == "nxd":
            model, optim = {}, {}
            uc = nxd.load_checkpoint(ckpt_dir, tag, model=model, optimizer=optim)
            got = {"model": model, "optimizer": optim, "user_content": uc}
        else:
            io = mods["nlp_overrides"].NLPCheckpointIO(async_save=False, weight_init_only=False, ptl_version="2.5.0")
            ck = io.load_checkpoint(tag_path, load_type_xser=xser)
            got = {"model": ck.pop("state_dict"), "optimizer": ck.pop("optimizer_states"), "user_content": ck}
        coords = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
        return coords, got

    print(f"# load_check {os.path.relpath(tag_path, HERE) if tag_path.startswith(HERE) else tag_path}")
    print(f"# via={args.via} tp={tp} pp={pp} dp={dp} xser={xser} world={tp * pp * dp}")
    try:
        res = SIM.run_threaded(load)
    except BaseException as e:  # noqa: BLE001
        print(f"FAILED: {type(e).__name__}: {e}")
        return 1

    status = 0
    uc0 = None
    for r in sorted(res):
        (tp_r, pp_r, dp_r), got = res[r]
        print(f"## rank {r} (tp={tp_r} pp={pp_r} dp={dp_r})")
        model, optim, uc = got["model"], got["optimizer"], got["user_content"]
        if not model:
            print("  ERROR: empty model state")
            status = 1
        if os.path.isdir(os.path.join(tag_path, "optim")) and not optim:
            print("  ERROR: empty optimizer state")
            status = 1
        n_mt = sum(1 for v in model.values() if isinstance(v, torch.Tensor))
        print(f"  model: {type(model).__name__} with {len(model)} keys, {n_mt} tensors")
        for line in describe(model, "  model"):
            print(line)
        ol = describe(optim, "  optim")
        n_ot = sum(1 for line in ol if ": tensor " in line)
        print(f"  optim: {type(optim).__name__} with {n_ot} tensors")
        for line in ol:
            print(line)
        if r == 0 or uc != uc0:
            keys = list(uc.keys()) if isinstance(uc, dict) else uc
            print(f"  user_content keys: {keys}")
        uc0 = uc
    # ranks of one dp group must see identical model shards
    by_mp = {}
    for r, ((tp_r, pp_r, dp_r), got) in res.items():
        by_mp.setdefault((tp_r, pp_r), []).append((dp_r, got["model"]))
    for (tp_r, pp_r), lst in sorted(by_mp.items()):
        ref = lst[0][1]
        for dp_r, m in lst[1:]:
            if m.keys() != ref.keys() or any(not torch.equal(m[k], ref[k]) for k in m):
                print(f"ERROR: model shards differ between dp ranks for tp={tp_r} pp={pp_r}")
                status = 1
    print(f"# result: {'OK' if status == 0 else 'FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main())

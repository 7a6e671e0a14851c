#!/usr/bin/python3
"""Read a Mixtral tag back with NxD's own load_checkpoint on every rank, into
NxDT's real MixtralForCausalLM (built as generate.py builds it) and a dict
optimizer state, as NxDT does.  Dev-time tool: needs the upstream sources and
environment of generate.py (see README.md).  Any tag path works, so a tag
shardkit wrote can be checked the same way.

  load_check.py <checkpoint_dir>/<tag> [--ep N] [--dp N] [--full FULL_STATE.pt] [--weights_only]

Topology: tp from the model/ file names, ep from their ep_rank_EE (1 if none),
dp from the highest optim/dp_rank_XX; --ep / --dp override.  The mesh runs at
that tp and dp (generate.py's set_mesh), so tp 1 dp 4 ep 2 tags load too.  The model is
NxDT's HF Mixtral at generate.py's sizes (MODEL there).

Ranks run one thread each (NxD's xser loader all-reduces between data-parallel
ranks).  Printed per rank: each loaded tensor (dtype, shape, sha256 prefix,
via ../nxd_tags/load_check.py's describe).  With --full, the loaded model
parameters and ZeRO-1 moments of all ranks are gathered with generate.py's
gather_full_state (NxD's partition functions) and must equal the full state
bit for bit.  With --weights_only (a tag without optim/, as shardkit's
--weights_only writes it), load_checkpoint gets optimizer=None and --full
compares the model alone.  Exit status non-zero on any failure or difference.
"""

import argparse
import os
import re
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import generate  # noqa: E402  (also loads ../nxd_tags helpers and sets torch to one thread)
import torch  # noqa: E402
from nxd_stubs import SIM  # noqa: E402


LC = generate.load_nxd_tags_module("load_check.py")  # describe, infer_topology


def infer_ep(tag_path):
    eps = {int(m.group(1)) for f in os.listdir(os.path.join(tag_path, "model"))
           for m in [re.search(r"_ep_rank_(\d+)_", f)] if m}
    return max(eps) + 1 if eps else 1


def compare(full, got, out, weights_only=False):
    """Loaded (gathered) against the full state, per section (the model alone with weights_only)."""
    model = [n for n, want in full["model"].items() if not torch.equal(got["model"][n], want)]
    if weights_only:
        full = dict(full, optimizer={})
    moments = [f"{n}.{k}" for n, st in full["optimizer"].items() for k in ("exp_avg", "exp_avg_sq")
               if not torch.equal(got["optimizer"][n][k], st[k])]
    total = 2 * len(full["optimizer"])
    print(f"# full-state check: model {len(full['model']) - len(model)}/{len(full['model'])} tensors equal bit for bit"
          f"{' (differ: ' + ', '.join(model) + ')' if model else ''}; optimizer moments {total - len(moments)}/{total} "
          f"equal bit for bit{' (differ: ' + ', '.join(moments) + ')' if moments else ''}", file=out)
    return not model and not moments


def model_builder(style, ep, moe_frequency):
    """() -> (model, optimizer param groups), as the generator of that style builds them."""
    if style == "hf":
        mm, _, _, _ = generate.setup(ep)
        return lambda: generate.hf_model_and_groups(mm, ep)
    import generate_megatron as gm

    gm.MOE["frequency"] = moe_frequency
    _, provider, groups_fn = gm.megatron_setup(ep)
    cfg = gm.config()
    cfg["distributed_strategy"]["expert_model_parallel_size"] = ep
    return lambda: gm.model_and_groups(provider, groups_fn, cfg, ep)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tag_path")
    ap.add_argument("--ep", type=int)
    ap.add_argument("--dp", type=int)
    ap.add_argument("--full", help="a gathered full state (hf_epE_full_state.pt) the tag must equal")
    ap.add_argument("--weights_only", action="store_true", help="no optimizer files: load and compare the model alone")
    ap.add_argument("--moe-frequency", type=int, default=1, help="the model's, as the generators' option")
    ap.add_argument("--style", choices=["hf", "megatron"], default="hf",
                    help="the model to load into: NxDT's HF MixtralForCausalLM or its Megatron GPTModel "
                         "(generate_megatron.py's; needs its environment)")
    args = ap.parse_args()
    tag_path = os.path.abspath(args.tag_path.rstrip("/"))
    ckpt_dir, tag = os.path.dirname(tag_path), os.path.basename(tag_path)
    tp, _, dp = LC.infer_topology(tag_path)
    ep, dp = args.ep or infer_ep(tag_path), args.dp or dp
    generate.set_mesh(tp, dp)  # the tag's mesh (world tp x dp), as generate.py --tp --dp runs it
    generate.MODEL["moe_frequency"] = args.moe_frequency
    build = model_builder(args.style, ep, args.moe_frequency)
    import neuronx_distributed as nxd

    xser = nxd.trainer.checkpoint.create_checkpoint_storage(ckpt_dir).is_checkpoint_xser(tag)
    old = generate.TAGS_GEN.set_env(generate.ROUTE["env"])

    errors = {}

    def load(rank):
        model, groups = build()
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype.is_floating_point:
                    p.fill_(float("nan"))  # whatever is not loaded shows
        optim = {}
        try:
            nxd.load_checkpoint(ckpt_dir, tag, model=model, optimizer=None if args.weights_only else optim, strict=(ep == 1))
        except Exception as e:  # noqa: BLE001
            errors[rank] = f"{type(e).__name__}: {generate._relative(str(e)).replace(HERE + '/', '')}"
            raise
        model.lrs = []
        if args.weights_only:  # no optimizer state: gather_full_state gathers none
            return model, types.SimpleNamespace(state_dict=lambda: {"base_state": {}, "shape_info": {}}), None, []
        return model, types.SimpleNamespace(state_dict=lambda: optim), None, groups

    shown = os.path.relpath(tag_path, HERE) if tag_path.startswith(HERE) else tag_path
    print(f"# load_check {shown}")
    print(f"# NxD load_checkpoint(model=NxDT {'MixtralForCausalLM' if args.style == 'hf' else 'Megatron GPTModel'}, "
          f"optimizer={'None' if args.weights_only else '{}'}) tp={tp} ep={ep} dp={dp} xser={xser}")
    try:
        res = SIM.run_threaded(load)
    except BaseException as e:  # noqa: BLE001
        print(f"FAILED: {type(e).__name__}: {e}")
        for r, msg in sorted(errors.items()):
            if not msg.startswith("BrokenBarrierError"):
                print(f"  rank {r}: {msg}")
        return 1
    generate.TAGS_GEN.set_env(old)
    status = 0
    for r in sorted(res):
        model, opt, _, _ = res[r]
        c = generate._coords(r)
        sd = model.state_dict()
        print(f"## rank {r} (tp={c['tp']} dp={c['dp']} ep={c['ep']})")
        if any(torch.isnan(v).any() for v in sd.values() if v.dtype.is_floating_point):
            print("  ERROR: a model parameter was not loaded (NaN)")
            status = 1
        for line in LC.describe(dict(sd), "  model") + LC.describe(opt.state_dict(), "  optim"):
            print(line)
    if args.full:
        try:
            got = generate.gather_full_state(res, ep)
        except (SystemExit, AssertionError) as e:
            print(f"# full-state check: the ranks' states do not assemble: {e}")
            status = 1
        else:
            if not compare(torch.load(args.full), got, sys.stdout, args.weights_only):
                status = 1
    print(f"# result: {'OK' if status == 0 else 'FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""NxD's own checkpoint converter (NxD fbac349
src/neuronx_distributed/scripts/checkpoint_converter.py:CheckpointConverterBase,
run unchanged through its documented entry point, NxDT 9169aa0
examples/checkpoint_converter_scripts/checkpoint_converter.py, as
`python3 checkpoint_converter.py <argv>`) on this fixture's virtual-pipeline
tags.  Dev-time tool; environment as generate.py plus NXDT_SRC.

  NXD_SRC=... NXDT_SRC=... TORCH_XLA_SRC=... nice -n 19 /usr/bin/python3 converter_check.py > converter_check.out.txt

1. --convert_to_full_state on nxd_pt/step_2/model and nxd_xser/step_2/model
   (--pp_size 2 --virtual_pp_size 2 --tp_size 2 --qkv_linear --fuse_qkv):
   its output, or how it fails, is recorded.
2. --convert_from_full_state --pp_size 2 --virtual_pp_size 2 on the HF full
   state of this fixture (full_state.pt's model tensors, each fused tensor cut
   into HF's q/k/v and gate/up by the rank blocks), into a temp dir: the
   converter's own virtual-pipeline partition.  Each of its rank files is
   compared with the fixture's model file (keys, order, bytes of every tensor).
Exit status non-zero when step 2 differs from the fixture (step 1's outcome is
a finding, not a failure).
"""

import contextlib
import io
import json
import os
import re
import runpy
import sys
import tempfile
import traceback
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import vpp_model as vm  # noqa: E402

CONFIG = {  # HF LlamaConfig of vpp_model.py's model (what --config reads)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": vm.HIDDEN,
    "num_attention_heads": vm.HEADS, "num_key_value_heads": vm.KV_HEADS, "num_hidden_layers": vm.NUM_LAYERS,
    "intermediate_size": vm.FFN, "vocab_size": vm.VOCAB, "torch_dtype": "bfloat16",
}
COMMON = ["--hw_backend", "trn1", "--tp_size", str(vm.TP), "--pp_size", str(vm.PP),
          "--virtual_pp_size", str(vm.VPP), "--n_layers", str(vm.NUM_LAYERS), "--kv_size_multiplier", "1",
          "--qkv_linear", "True", "--fuse_qkv", "True"]


def run_converter(argv):
    """python3 checkpoint_converter.py <argv>; its prints are echoed with the temp dir as $TMP."""
    script = os.path.join(os.environ["NXDT_SRC"], "..", "examples", "checkpoint_converter_scripts", "checkpoint_converter.py")
    said = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", [os.path.basename(script)] + argv), contextlib.redirect_stdout(said):
            runpy.run_path(script, run_name="__main__")
    finally:
        for line in said.getvalue().splitlines():
            print("  | " + re.sub(r"/tmp/[^/]+", "$TMP", line))


def hf_full_state(full):
    """full_state.pt's model tensors in HF names: weight_qkv's rank blocks [q_r; k_r; v_r]
    and gate_up's [gate_r; up_r] cut apart and concatenated per part."""
    q_rows, kv_rows = vm.HEADS * vm.HEAD_DIM // vm.TP, vm.KV_HEADS * vm.HEAD_DIM // vm.TP
    out = {}
    for key, t in full.items():
        if not key.startswith("model/"):
            continue
        name = key[len("model/"):]
        if name.endswith("qkv_proj.weight_qkv"):
            blocks = [b.split([q_rows, kv_rows, kv_rows]) for b in t.chunk(vm.TP)]
            for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                out[name.replace("qkv_proj.weight_qkv", part + ".weight")] = torch.cat([b[i] for b in blocks]).clone()
        elif name.endswith("gate_up_proj.weight"):
            blocks = [b.chunk(2) for b in t.chunk(vm.TP)]
            for i, part in enumerate(("gate_proj", "up_proj")):
                out[name.replace("gate_up_proj", part)] = torch.cat([b[i] for b in blocks]).clone()
        else:
            out[name] = t.clone()
    return out


def to_full(tmp, tag_dir, xser, common=COMMON):
    """The input dir is absolute: load_partial_xser() rebuilds the storage root as
    os.path.join(*filename.split("/")[:-3]) and the loader joins it with the
    file name again, so a relative --input_dir is read at <root>/<root>/..."""
    out = os.path.join(tmp, "to_full_" + os.path.basename(os.path.dirname(os.path.abspath(tag_dir + "/x"))))
    argv = ["--input_dir", os.path.join(os.path.abspath(tag_dir), "model"), "--output_dir", out, "--config",
            os.path.join(tmp, "config.json"), "--convert_to_full_state"] + common + (["--load_xser", "True"] if xser else [])
    print(f"$ checkpoint_converter.py {' '.join(a.replace(tmp, '$TMP').replace(HERE, '$FIXTURE') for a in argv)}")
    try:
        run_converter(argv)
    except BaseException as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)
        where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in tb if "neuronx_distributed" in f.filename]
        print(f"  FAILS: {type(e).__name__}: {e}\n  at {' <- '.join(reversed(where))}")
        return
    got = torch.load(os.path.join(out, "checkpoint.pt"))
    print(f"  exit 0: {len(got)} tensors")
    return got


def from_full(tmp, full, common=COMMON, out_name="from_full"):
    path = os.path.join(tmp, "hf_full.pt")
    torch.save(full, path)
    out = os.path.join(tmp, out_name)
    argv = ["--input_dir", path, "--output_dir", out, "--config", os.path.join(tmp, "config.json"),
            "--convert_from_full_state"] + common
    print(f"$ checkpoint_converter.py {' '.join(a.replace(tmp, '$TMP') for a in argv)}")
    run_converter(argv)
    return out


def compare_with_fixture(out):
    bad = 0
    for pp in range(vm.PP):
        for tp in range(vm.TP):
            rel = f"model/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
            theirs = torch.load(os.path.join(out, rel))
            ours = torch.load(os.path.join(HERE, "nxd_pt", "step_2", rel))
            same_order = list(theirs) == list(ours)
            diff = [k for k in ours if k not in theirs or theirs[k].dtype != ours[k].dtype
                    or not torch.equal(theirs[k], ours[k])]
            extra = [k for k in theirs if k not in ours]
            layers = sorted({int(k.split(".")[2]) for k in theirs if k.startswith("model.layers.")})
            print(f"  {rel}: layers {layers}; {len(theirs)} keys; key order {'=' if same_order else '!='} fixture; "
                  f"tensors differing from the fixture: {diff or 'none'}; extra keys: {extra or 'none'}")
            if not same_order and sorted(theirs) == sorted(ours):
                print(f"    converter order: {list(theirs)}")
            bad += bool(diff or extra)
    return bad


def main():
    vm.install()  # real trainer.checkpoint (_xser_load_data) and the torch_xla pieces the converter imports
    full = torch.load(os.path.join(HERE, "full_state.pt"))
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        print("# 1. --convert_to_full_state on the virtual-pipeline tags")
        to_full(tmp, "nxd_pt/step_2", False)
        to_full(tmp, "nxd_xser/step_2", True)
        print("# 2. --convert_from_full_state --virtual_pp_size 2 vs the fixture's model files")
        hf = hf_full_state(full)
        bad = compare_with_fixture(from_full(tmp, hf))
        print("# 3. round trip through the converter with q/k/v unfused (weight_q/_k/_v): from_full "
              "--virtual_pp_size 2, then to_full of that vp tag")
        unfused = COMMON[:COMMON.index("--fuse_qkv")]
        vp_dir = from_full(tmp, hf, unfused, "vp_unfused")
        back = to_full(tmp, vp_dir, False, unfused)
        if back is not None:
            diff = sorted(k for k in hf if k not in back or not torch.equal(back[k], hf[k]))
            extra = sorted(set(back) - set(hf))
            print(f"  to_full == the HF full state given to from_full: {'yes' if not diff and not extra else 'NO'}"
                  f" (differing {diff or 'none'}, extra {extra or 'none'})")
            bad += bool(diff or extra)
    print(f"# result: {'converter layout = fixture layout' if not bad else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

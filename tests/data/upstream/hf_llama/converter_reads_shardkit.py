"""NxD's own converter reads what shardkit writes.

For each case, shardkit writes an HF-style tag (ckpt-reshard from an upstream
fixture, or ckpt-import from the full state), then NxD's
checkpoint_converter.py --convert_to_full_state (unmodified, run through
NxDT's documented entry point as generate.py runs it) merges it, and the
merged state dict is compared with the full state the fixtures were made from.
Writes converter_reads_shardkit.json; exit 1 on an unexpected result.

    SHARDKIT_BIN=<build dir> SHARDKIT_NXD_SRC=... SHARDKIT_NXDT_SRC=... \
        /usr/bin/python3 converter_reads_shardkit.py [--write-json]

Only the converter's known failures are expected to fail: to_full splits a
fused weight_qkv into three equal parts (convert_partial_state_to_non_fused_qkv),
so layouts whose query and KV rows per rank differ cannot be merged by it.
xser tags are not run here (the converter's --load_xser needs NxD's
checkpoint storage, stubbed); NxD's load_checkpoint reading shardkit's xser
tags is recorded in ../nxd_tags/README.md.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import generate  # noqa: E402  (run_converter, the stand-ins, the commits)
import upstream_env as ue  # noqa: E402

BIN = os.environ.get("SHARDKIT_BIN", os.path.join(HERE, "..", "..", "..", "..", "build"))
TOOLS = os.path.join(BIN, "bin")
CONFIG = {"gqa": "full_gqa/config.json", "mha": "full_mha/config.json"}

def reshard(src, tp, pp, m, fused, out_flags, expect):
    """A ckpt-reshard case of a GQA fixture to tp/pp with kv_size_multiplier m, and the converter flags that merge it."""
    name = f"reshard_{src}_to_tp{tp}_pp{pp}_kv{m}_{'fused' if fused else 'split'}"
    conv = ["--hw_backend", "trn1", "--tp_size", str(tp), "--pp_size", str(pp), "--kv_size_multiplier", str(m), "--qkv_linear", "True"]
    # argparse type=bool: any value enables --fuse_qkv, so it is left out to disable it (README finding 9).
    return (name, ["ckpt-reshard", "tags/" + src, "{out}", "--model_config", CONFIG["gqa"], "--tp", str(tp), "--pp", str(pp), *out_flags],
            conv + (["--fuse_qkv", "True"] if fused else []), "gqa", expect)


# (name, shardkit command after the tool name, converter flags, full state, expected to merge)
CASES = [
    reshard("trn1_tp8_pp2_kv4_fused", 8, 1, 4, False, ["--out_fuse_qkv", "false"], True),
    reshard("trn1_tp8_pp2_kv4_split", 8, 4, 4, True, ["--out_fuse_qkv", "true"], True),
    reshard("trn1_tp8_pp2_kv4_fused", 2, 2, 1, False, ["--out_kv_size_multiplier", "1", "--out_fuse_qkv", "false"], True),
    # The converter's to_full splits weight_qkv in three equal parts: q 16 rows, k and v 8 each cannot merge.
    reshard("trn1_tp8_pp2_kv4_fused", 4, 1, 2, True, ["--out_kv_size_multiplier", "2"], False),
    ("import_mha_tp2_pp2_stride3",
     ["ckpt-import", "full_mha/checkpoint.pt", "{out}", "--format", "hf", "--model_source", "hf", "--model_config", CONFIG["mha"],
      "--tp", "2", "--pp", "2"],
     ["--hw_backend", "trn1", "--tp_size", "2", "--pp_size", "2", "--kv_size_multiplier", "1", "--coalesce_qkv", "True"], "mha", True),
]

def main():
    write = "--write-json" in sys.argv
    ue.load_checkpoint_converter()  # the stand-ins, once
    results, bad = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, tool_argv, conv_flags, full, expect in CASES:
            out = os.path.join(tmp, name)
            argv = [os.path.join(TOOLS, tool_argv[0])] + [a.format(out=out) for a in tool_argv[1:]]
            p = subprocess.run(argv, cwd=HERE, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"{name}: shardkit failed: {p.stderr}")
            merged = os.path.join(tmp, name + "_full")
            conv_argv = ["--model_style", "hf", "--input_dir", os.path.join(out, "model"), "--output_dir", merged, "--config",
                         CONFIG[full], "--n_layers", "4"] + conv_flags + ["--convert_to_full_state"]
            entry = {"case": name, "shardkit": ["<build>/tools/" + tool_argv[0]] + tool_argv[1:],
                     "converter": "checkpoint_converter.py " + " ".join(conv_argv).replace(tmp, "$TMP")}
            try:
                generate.run_converter(conv_argv)
                got = torch.load(os.path.join(merged, "checkpoint.pt"))
                want = torch.load(os.path.join(HERE, "full_" + full, "checkpoint.pt"))
                same = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
                entry["result"] = "every tensor of the full state back, bit-exact" if same else "merged, but differs"
                ok = same and expect is not False
            except Exception as e:  # the converter's own failures are recorded, not hidden
                entry["result"] = f"error {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                ok = expect is not True
            entry["as_expected"] = ok
            bad += not ok
            results.append(entry)
            print(f"{name:55s} {entry['result']}")
    if write:
        with open(os.path.join(HERE, "converter_reads_shardkit.json"), "w") as f:
            json.dump({"nxd_commit": ue.NXD_COMMIT, "nxdt_commit": ue.NXDT_COMMIT, "torch": torch.__version__, "cases": results}, f,
                      indent=1)
            f.write("\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

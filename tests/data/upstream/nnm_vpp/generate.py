#!/usr/bin/python3
"""NNM's virtual-pipeline checkpoint save, run, and NxDT's NNM -> NxDT converter
on what it writes.  Dev-time tool; nothing here is read by CI except the
committed output (generate.out.txt, manifest.json, the small tags).

Upstream (read-only, never copied here):
  NNM   aws-neuron/neuronx-nemo-megatron       f4743ce
  NxDT  aws-neuron/neuronx-distributed-training 9169aa03f39efd4eb02da63891a7ed98defb1714
  torch_xla v2.9.0 5fab7053 (TensorReference, through ../nxd_tags/nxd_stubs.py)

  U=/tmp/vp_up
  git --git-dir=<nnm.git> archive f4743ce nemo/nemo/collections/nlp nemo/nemo/core/classes/modelPT.py | tar -x -C $U/nnm
  NNM_SRC=$U/nnm NXDT_SRC=$U/nxdt/src TORCH_XLA_SRC=$U/xla nice -n 19 /usr/bin/python3 generate.py > generate.out.txt

What runs unchanged (each method compiled verbatim out of its NNM file, with
its line numbers, into a class of the same name whose other members are
restated below):
  megatron_gpt_model.py  MegatronGPTModel.on_save_checkpoint
  core/classes/modelPT.py ModelPT.state_dict
  megatron/gpt_model.py  GPTModel.state_dict_for_save_checkpoint
  megatron/language_model.py  TransformerLanguageModel.state_dict_for_save_checkpoint,
                              Embedding.state_dict_for_save_checkpoint
  megatron/module.py     MegatronModule.state_dict_for_save_checkpoint (the encoder's)
  NxDT examples/checkpoint_converter_scripts/nnm_model_ckpt_to_nxdt_model_ckpt_converter.py
                         (whole script, run as __main__)
Restated (NeMo/apex/Lightning cannot be imported here): the module tree and
the key attributes each __init__ sets (`_embedding_key = 'embedding'`, ...,
pre_process / post_process per chunk as Megatron's is_pipeline_first/last_stage
with the virtual rank, the chunk's layers as an nn.ModuleList of its local
layers, share_embeddings_and_output_weights), Lightning's dump order
(`state_dict` first, then on_save_checkpoint), and apex's build_model result
(a plain list of Float16Module-like wrappers with `.module`).  Stubs:
parallel_state.set_virtual_pipeline_model_parallel_rank (records the rank),
tqdm (not installed; a pass-through progress bar).
"""

import ast
import contextlib
import hashlib
import io
import json
import os
import runpy
import shutil
import sys
import traceback
import types
import zlib
from unittest import mock

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "nxd_tags"))
import nxd_stubs  # noqa: E402

TP, PP, VPP, LAYERS, HIDDEN, FFN, VOCAB = 2, 2, 2, 8, 8, 16, 32
NNM = "nemo/nemo/collections/nlp"


def upstream_class(name, rel, methods, bases=(nn.Module,)):
    """class `name` whose listed methods are NNM's own, compiled from `rel`."""
    path = os.path.join(os.environ["NNM_SRC"], rel)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in methods]
    assert sorted(n.name for n in body) == sorted(methods), (name, methods)
    new = ast.ClassDef(name=name, bases=[ast.Name(id=f"_base{i}", ctx=ast.Load()) for i in range(len(bases))],
                       keywords=[], body=body, decorator_list=[])
    ns = {f"_base{i}": b for i, b in enumerate(bases)}
    ns.update(parallel_state=PARALLEL_STATE, torch=torch)
    exec(compile(ast.fix_missing_locations(ast.Module(body=[new], type_ignores=[])), path, "exec"), ns)
    return ns[name]


PARALLEL_STATE = types.SimpleNamespace(vp_ranks=[])
PARALLEL_STATE.set_virtual_pipeline_model_parallel_rank = PARALLEL_STATE.vp_ranks.append


def value(name, shape):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return 0.02 * torch.randn(shape, generator=g)


def weight(owner, attr, shape, global_name):
    m = nn.Module()
    m.weight = nn.Parameter(value(global_name, shape))
    owner.add_module(attr, m)


def build_chunk(classes, tied, tp, pp, v):
    """Chunk v of pp rank pp (Megatron: stage v*PP + pp), NNM's GPTModel tree."""
    per = LAYERS // (PP * VPP)
    offset = v * (LAYERS // VPP) + pp * per  # transformer.py:ParallelTransformer.__init__
    pre, post = (v == 0 and pp == 0), (v == VPP - 1 and pp == PP - 1)
    g = classes["GPTModel"]()
    g.pre_process, g.post_process = pre, post
    g.share_embeddings_and_output_weights = tied
    g._language_model_key, g._word_embeddings_for_head_key = "language_model", "word_embeddings_for_head"
    lm = classes["TransformerLanguageModel"]()
    lm.pre_process, lm.post_process, lm.add_pooler, lm.add_decoder = pre, post, False, False
    lm._embedding_key, lm._encoder_key = "embedding", "encoder"
    g.add_module("language_model", lm)
    if pre:
        emb = classes["Embedding"]()
        emb._word_embeddings_key, emb.position_embedding_type, emb.num_tokentypes = "word_embeddings", "rope", 0
        weight(emb, "word_embeddings", (VOCAB // TP, HIDDEN), f"embedding.{tp}")
        lm.add_module("embedding", emb)
    enc = classes["MegatronModule"]()
    layers = nn.ModuleList()
    for i in range(per):
        layer = nn.Module()
        n = f"layer{offset + i}.tp{tp}"
        for attr, shape in (("input_layernorm", (HIDDEN,)), ("self_attention.query_key_value", (3 * HIDDEN // TP, HIDDEN)),
                            ("self_attention.dense", (HIDDEN, HIDDEN // TP)), ("post_attention_layernorm", (HIDDEN,)),
                            ("mlp.dense_h_to_4h", (2 * FFN // TP, HIDDEN)), ("mlp.dense_4h_to_h", (HIDDEN, FFN // TP))):
            parent = layer
            for part in attr.split(".")[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            weight(parent, attr.split(".")[-1], shape, f"{n}.{attr}")
        layers.append(layer)
    enc.add_module("layers", layers)
    if post:
        weight(enc, "final_layernorm", (HIDDEN,), f"final_layernorm.{tp}")
        if not tied:
            weight(lm, "output_layer", (VOCAB // TP, HIDDEN), f"output_layer.{tp}")
            lm._output_layer_key = "output_layer"
    lm.add_module("encoder", enc)
    if tied and post and not pre:  # MegatronModule.initialize_word_embeddings (last stage copy)
        weight(g, "word_embeddings", (VOCAB // TP, HIDDEN), f"embedding.{tp}")
    wrapper = nn.Module()  # Float16Module (megatron_amp_O2: required for a virtual pipeline)
    wrapper.add_module("module", g)
    return wrapper


def nnm_checkpoint(classes, tied, tp, pp):
    model = classes["MegatronGPTModel"]()
    model.model = [build_chunk(classes, tied, tp, pp, v) for v in range(VPP)]  # apex build_model: a plain list
    ckpt = {"epoch": 0, "global_step": 2, "pytorch-lightning_version": "1.8.6"}
    ckpt["state_dict"] = model.state_dict()  # Lightning: lightning_module_state_dict()
    del PARALLEL_STATE.vp_ranks[:]
    model.on_save_checkpoint(ckpt)  # Lightning calls the hook after building the dict
    return ckpt, list(PARALLEL_STATE.vp_ranks)


def describe(obj, path=""):
    if isinstance(obj, torch.Tensor):
        return [f"{path}: {list(obj.shape)}"]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in describe(v, f"{path}[{k!r}]")] or [f"{path}: {{}}"]
    return [f"{path}: {obj!r}"]


def run_nxdt_converter(nnm_dir, out_dir):
    script = os.path.join(os.environ["NXDT_SRC"], "..", "examples", "checkpoint_converter_scripts",
                          "nnm_model_ckpt_to_nxdt_model_ckpt_converter.py")
    argv = ["--tp", str(TP), "--pp", str(PP), "--n_layers", str(LAYERS), "--nnm_ckpt_path", nnm_dir,
            "--nxdt_ckpt_path", out_dir]
    print(f"$ nnm_model_ckpt_to_nxdt_model_ckpt_converter.py {' '.join(a.replace(HERE + '/', '') for a in argv)}")
    said = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", [os.path.basename(script)] + argv), contextlib.redirect_stdout(said):
            runpy.run_path(script, run_name="__main__")
        print("  exit 0")
    except SystemExit as e:
        print(f"  exit {e.code}")
    except BaseException as e:  # noqa: BLE001
        where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)
                 if "converter" in f.filename]
        print(f"  FAILS: {type(e).__name__}: {e}\n  at {' <- '.join(reversed(where))}")
    for line in said.getvalue().splitlines():  # without the timing
        print("  | " + line.replace(HERE + "/", "").split(" in ")[0])


def convert_and_show(nnm_dir, out):
    run_nxdt_converter(nnm_dir, out)
    for d, _, fs in sorted(os.walk(out)):
        for f in sorted(fs):
            p = os.path.join(d, f)
            obj = torch.load(p) if f.endswith(".pt") else open(p).read()
            shown = {k: f"TensorReference({v.tid})" if hasattr(v, "tid") else v for k, v in obj.items()} \
                if isinstance(obj, dict) else obj
            print(f"  {os.path.relpath(p, HERE)}: {os.path.getsize(p)} bytes: {shown!r}"[:300])


def main():
    xla = os.environ["TORCH_XLA_SRC"]
    nxd_stubs._install_torch_xla(xla)  # real torch_xla.utils.serialization.TensorReference
    sys.modules["tqdm"] = types.SimpleNamespace(tqdm=lambda **k: contextlib.nullcontext(
        types.SimpleNamespace(update=lambda n: None)))
    classes = {
        "MegatronGPTModel": upstream_class(
            "MegatronGPTModel", f"{NNM}/models/language_modeling/megatron_gpt_model.py", ["on_save_checkpoint"],
            bases=(upstream_class("ModelPT", "nemo/nemo/core/classes/modelPT.py", ["state_dict"]),)),
        "GPTModel": upstream_class("GPTModel", f"{NNM}/models/language_modeling/megatron/gpt_model.py",
                                   ["state_dict_for_save_checkpoint"]),
        "TransformerLanguageModel": upstream_class("TransformerLanguageModel", f"{NNM}/modules/common/megatron/language_model.py",
                                                   ["state_dict_for_save_checkpoint"]),
        "Embedding": upstream_class("Embedding", f"{NNM}/modules/common/megatron/language_model.py",
                                    ["state_dict_for_save_checkpoint"]),
        "MegatronModule": upstream_class("MegatronModule", f"{NNM}/modules/common/megatron/module.py",
                                         ["state_dict_for_save_checkpoint"]),
    }
    print(f"# NNM virtual-pipeline save: tp={TP} pp={PP} vpp={VPP} layers={LAYERS}")
    for name, tied in (("llama_untied", False), ("gpt_tied", True)):
        print(f"## {name} (share_embeddings_and_output_weights={tied})")
        nnm_dir = os.path.join(HERE, name, "nnm")
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        saved = True
        for tp in range(TP):
            for pp in range(PP):
                try:
                    ckpt, vp = nnm_checkpoint(classes, tied, tp, pp)
                except BaseException as e:  # noqa: BLE001
                    tb = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)
                          if "nemo" in f.filename]
                    print(f"  tp {tp} pp {pp}: NNM's save FAILS: {type(e).__name__}: {e}\n    at {' <- '.join(reversed(tb))}")
                    saved = False
                    continue
                rank_dir = os.path.join(nnm_dir, f"tp_rank_{tp:02d}_pp_rank_{pp:03d}")
                os.makedirs(rank_dir)
                torch.save(ckpt, os.path.join(rank_dir, "model_optim_rng.ckpt"))
                print(f"  tp {tp} pp {pp}: keys {list(ckpt)}; set_virtual_pipeline_model_parallel_rank calls {vp}")
                if tp == 0:
                    for line in describe({k: ckpt[k] for k in ckpt if k.startswith("model") or k == "state_dict"}, "    "):
                        print(line)
        if not saved:
            shutil.rmtree(os.path.join(HERE, name))
            print("  (nothing kept: NNM cannot save this model with virtual stages)")
            continue
        convert_and_show(nnm_dir, os.path.join(HERE, name, "nxdt"))
        # What the issue describes (exit 0, empty model files) needs a state_dict without
        # ModelPT's 'untrained_buffer_names' list: the same files with that entry removed.
        variant = os.path.join(HERE, name, "nnm_no_untrained_buffer_names")
        print(f"## {name}, variant: the same NNM files with state_dict['untrained_buffer_names'] removed "
              "(not what NNM writes)")
        for d, _, fs in sorted(os.walk(nnm_dir)):
            for f in fs:
                ck = torch.load(os.path.join(d, f))
                del ck["state_dict"]["untrained_buffer_names"]
                os.makedirs(os.path.join(variant, os.path.basename(d)))
                torch.save(ck, os.path.join(variant, os.path.basename(d), f))
        convert_and_show(variant, os.path.join(HERE, name, "nxdt_from_variant"))
    manifest = {}
    for d, _, fs in sorted(os.walk(HERE)):
        for f in sorted(fs):
            p = os.path.join(d, f)
            rel = os.path.relpath(p, HERE)
            if "/" in rel:
                with open(p, "rb") as fh:
                    b = fh.read()
                manifest[rel] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    with open(os.path.join(HERE, "manifest.json"), "w") as fh:
        fh.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(manifest.items())) + "\n}\n")


if __name__ == "__main__":
    main()

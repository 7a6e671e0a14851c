"""Writes a small seed corpus for pt_fuzz: real torch files (zip, legacy,
pickle protocols 0-5) and their raw data.pkl streams."""
import collections
import os
import sys
import zipfile

import torch

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
g = torch.Generator().manual_seed(0)
base = torch.randn(3, 4, generator=g)
objs = {
    "sd": collections.OrderedDict(w=torch.nn.Parameter(base), b=torch.zeros(2, dtype=torch.bfloat16)),
    "views": {"a": base, "b": base.t(), "c": base[1:], "n": [1, 2.5, "s", None, 2**70, b"\x00"]},
    "optim": {"state": {0: {"step": torch.tensor(3.), "exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
    "sets": {"s": {1, 2}, "f": frozenset([3]), "size": torch.Size([2, 3]), "dt": torch.float16},
}
for name, obj in objs.items():
    for proto in (2, 4, 5):
        path = os.path.join(out, f"{name}_p{proto}.pt")
        torch.save(obj, path, pickle_protocol=proto)
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("data.pkl")][0]
            with open(os.path.join(out, f"{name}_p{proto}.pkl"), "wb") as f:
                f.write(z.read(pkl))
    torch.save(obj, os.path.join(out, f"{name}_legacy.pt"), _use_new_zipfile_serialization=False)
plain = {"a": [1, 2.5, "x", None, True], "o": collections.OrderedDict(z=(1, 2))}
for proto in (0, 1):
    torch.save(plain, os.path.join(out, f"plain_p{proto}.pt"), pickle_protocol=proto)
print(f"make_seeds: {len(os.listdir(out))} seeds in {out}")

"""Bounded work on every input, and nothing opened outside the folder named
(#35, found by the bad-input sweep). Each case asserts exit 2 (ckpt-verify's
FAILED: 1), a message naming the key, file or shard, a wall time well under
what the case took before (minutes; 53 s for the index), the peak memory of
the command (os.wait4's ru_maxrss) where a case used to grow, and, for links
out of a folder, that the command opened nothing under the link's target
(strace -y: no descriptor opened there, so no file read and no folder listed)."""
import json
import os
import resource
import shutil
import subprocess
import tempfile
import threading
import time
import unittest


from bad_input import CONF, HF_LLAMA, LLAMA, make_hf
from canon import CONVERT, IMPORT, INSPECT, RESHARD, TRAIN, VERIFY, TempDirTest, run
from nnm_fixture import make_nnm
from upstream_tags import NXD_XSER

SECONDS = 10          # wall time per case: generous for a loaded 2-core machine; each takes well under 1 s
KILL_AFTER = 40       # a case still running then is killed (and fails)
PEAK_RSS_MB = 300     # peak resident memory of a command where a case used to grow (the blow-up reached 1.8 GB)
ADDRESS_SPACE = 4 << 30
STRACE = "/usr/bin/strace"


def chain(n, copies, key="a"):
    """'a0: x' and a1..a<n>, each `copies` references to the one before: a<n> expands to copies^n bytes.
    As YAML lines (about 500 bytes for 9, 10)."""
    lines = [f"{key}0: x"]
    for i in range(1, n + 1):
        lines.append(f"{key}{i}: '" + ("${" + f"{key}{i - 1}" + "}") * copies + "'")
    return lines


def first_past_a_mebibyte(copies):
    """The first key of chain(_, copies) whose expansion passes 1 MiB (the bound on one value)."""
    i = 0
    while copies ** i <= 1 << 20:
        i += 1
    return f"a{i}"


class Run:
    def __init__(self, code, out, seconds, peak_rss_mb):
        self.code, self.out, self.seconds, self.peak_rss_mb = code, out, seconds, peak_rss_mb


def measured(argv, cwd=None):
    """Runs argv with an address-space limit; returns its exit code, output, wall time and peak RSS."""
    with tempfile.TemporaryFile() as out:
        t0 = time.time()
        p = subprocess.Popen([str(a) for a in argv], cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE)))
        killer = threading.Timer(KILL_AFTER, p.kill)
        killer.start()
        _, status, usage = os.wait4(p.pid, 0)
        killer.cancel()
        took = time.time() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return Run(p.returncode, out.read().decode(errors="replace"), took, usage.ru_maxrss / 1024)


class BoundedWork(TempDirTest):
    def bounded(self, argv, names, code=2, peak_rss_mb=PEAK_RSS_MB):
        r = measured(argv, cwd=self.dir)
        what = " ".join(str(a) for a in argv)
        self.assertEqual(r.code, code, f"{what}: exit {r.code} after {r.seconds:.1f} s:\n{r.out[-2000:]}")
        for n in names:
            self.assertIn(str(n), r.out, what)
        self.assertLess(r.seconds, SECONDS, what)
        self.assertLess(r.peak_rss_mb, peak_rss_mb, what)
        return r

    def tag(self):
        tag = os.path.join(self.dir, "tags", "a.ckpt")
        run(IMPORT, "--format", "hf", make_hf(os.path.join(self.dir, "hf")), tag, "--tp", 1, "--pp", 1)
        return tag

    # -- interpolation: 1 MiB per value, 4 MiB per config ---------------------
    def test_interpolation_blow_up_in_a_job_config(self):
        cfg = os.path.join(self.dir, "blow.yaml")
        text = "\n".join(chain(9, 10)) + "\n"
        self.assertLess(len(text), 600)
        with open(cfg, "w") as f:
            f.write(text)
        key = first_past_a_mebibyte(10)
        self.assertEqual(key, "a7")
        out = os.path.join(self.dir, "out.ckpt")
        self.bounded([RESHARD, self.tag(), out, "--tp", 1, "--pp", 1, "--config", cfg],
                     [cfg, f"key '{key}': its interpolation expands past 1 MiB (the bound on one value)"])
        self.assertFalse(os.path.exists(out))

    def test_interpolation_blow_up_in_the_trainers_config_and_overrides(self):
        with open(CONF) as f:
            base = f.read()
        cfg = os.path.join(self.dir, "train.yaml")
        with open(cfg, "w") as f:
            f.write(base + "\n" + "\n".join(chain(9, 10)) + "\n")
        key = first_past_a_mebibyte(10)
        self.bounded([TRAIN, cfg], [cfg, f"key '{key}': its interpolation expands past 1 MiB"])
        # The same chain given as command-line overrides.
        overrides = ["+" + line.replace(": ", "=", 1).replace("'", "") for line in chain(9, 10, key="b")]
        self.bounded([TRAIN, CONF, *overrides], [f"key 'b7': its interpolation expands past 1 MiB"])
        # Values within the bound but many of them: the config's bound (4 MiB) ends it.
        many = ["+k=" + "x" * 1000, "+big=" + "${k}" * 1000] + [f"+c{i}=${{big}}" for i in range(8)]
        self.bounded([TRAIN, CONF, *many], ["interpolations expand the config past 4 MiB"])

    # -- safetensors header and HF index -------------------------------------
    def test_safetensors_header_of_100000_entries(self):
        hf = os.path.join(self.dir, "hf")
        os.makedirs(hf)
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(dict(HF_LLAMA, architectures=["LlamaForCausalLM"]), f)
        n = 100000
        header = {f"t{i:06d}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
        header[f"t{n - 1:06d}"]["data_offsets"] = [4 * (n - 1) - 2, 4 * (n - 1) + 2]  # overlaps its neighbour
        text = json.dumps(header).encode()
        st = os.path.join(hf, "model.safetensors")
        with open(st, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text + bytes(4 * n))
        out = os.path.join(self.dir, "out.ckpt")
        self.bounded([IMPORT, "--format", "hf", hf, out, "--tp", 1, "--pp", 1],
                     [st, f"tensors 't{n - 2:06d}' and 't{n - 1:06d}' overlap in the file"])
        self.assertFalse(os.path.exists(out))

    def test_index_naming_100000_missing_shards(self):
        hf = make_hf(os.path.join(self.dir, "hf"), shards=2)
        index = os.path.join(hf, "model.safetensors.index.json")
        with open(index) as f:
            m = json.load(f)
        # The real shards, then 100,000 names of shards that are not there; weight_map is read in key order.
        m["weight_map"].update({f"zz.{i:06d}": f"gone-{i:06d}.safetensors" for i in range(100000)})
        with open(index, "w") as f:
            json.dump(m, f)
        out = os.path.join(self.dir, "out.ckpt")
        self.bounded([IMPORT, "--format", "hf", hf, out, "--tp", 1, "--pp", 1],
                     [os.path.join(hf, "gone-000000.safetensors") + ": missing (named by " + index + " for tensor 'zz.000000')"])
        self.assertFalse(os.path.exists(out))


class NothingOutside(TempDirTest):
    """Links out of a folder are refused before anything in them is listed or read."""

    def refused(self, argv, away, names, codes=(2,)):
        """Runs argv under strace: exits with one of `codes`, names `names`, and opens nothing under `away`."""
        log = os.path.join(self.dir, "strace.log")
        t0 = time.time()
        # -y: each opened descriptor is printed with the path it resolves to, so an open through a link shows its target.
        p = subprocess.run([STRACE, "-f", "-qq", "-y", "-e", "trace=open,openat,openat2", "-o", log] + [str(a) for a in argv],
                           capture_output=True, text=True, timeout=KILL_AFTER, cwd=self.dir)
        what = " ".join(str(a) for a in argv)
        self.assertIn(p.returncode, codes, f"{what}:\n{p.stderr[-2000:]}{p.stdout[-2000:]}")
        for n in names:
            self.assertIn(str(n), p.stderr + p.stdout, what)
        self.assertLess(time.time() - t0, SECONDS * 3, what)  # strace slows it
        with open(log) as f:
            opened = [line for line in f if away in line]
        self.assertTrue(os.path.getsize(log) > 0, "strace recorded nothing")
        self.assertEqual(opened, [], f"{what} opened under {away}")

    def away(self):
        d = os.path.join(self.dir, "away")
        os.makedirs(d, exist_ok=True)
        return d

    def move_out(self, path):
        """Moves `path` into the away folder and leaves a link to it in its place."""
        target = os.path.join(self.away(), os.path.basename(path))
        shutil.move(path, target)
        os.symlink(target, path)
        return target

    def test_nnm_rank_file_and_rank_folder_linked_out(self):
        nnm = os.path.join(self.dir, "nnm")
        make_nnm(nnm, dict(LLAMA, layers=2), tp=2, pp=1)
        out = os.path.join(self.dir, "out.ckpt")
        folder = os.path.join(nnm, "mp_rank_01")
        (name,) = [n for n in os.listdir(folder) if n.endswith(".ckpt")]
        rank_file = os.path.join(folder, name)
        target = self.move_out(rank_file)
        self.refused([CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], self.away(), [rank_file, "resolves to " + target, "outside " + nnm])
        os.remove(rank_file)
        shutil.move(target, rank_file)
        target = self.move_out(folder)
        self.refused([CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out], self.away(), [folder, "outside " + nnm])
        self.assertFalse(os.path.exists(out))
        # Restored, it converts (the checks refuse links, not the checkpoint).
        os.remove(folder)
        shutil.move(target, folder)
        run(CONVERT, "--nnm_ckpt_path", nnm, "--nxdt_ckpt_path", out, "--trust_first_replica")

    def folder_linked_out_of_a_tag(self, rel):
        """NxD's xser tag with the folder `rel` moved out and linked: ckpt-reshard and ckpt-inspect
        refuse it, ckpt-verify fails it (exit 1), none opening anything under the link's target."""
        tag = os.path.join(self.dir, "step_4")
        shutil.copytree(NXD_XSER, tag)
        folder = os.path.join(tag, rel)
        self.move_out(folder)
        out = os.path.join(self.dir, "out")
        reported = [rel + ": resolves to " + os.path.join(self.away(), os.path.basename(rel)), "outside the tag"]
        self.refused([RESHARD, tag, out, "--tp", 1, "--pp", 1, "--heads", 4], self.away(), reported)  # its check of the source
        self.refused([VERIFY, tag], self.away(), reported, codes=(1,))
        # ckpt-inspect exits 1 on any error today (#35 item 7 makes bad input 2).
        self.refused([INSPECT, tag], self.away(), [folder + ": resolves to", "outside " + tag], codes=(1, 2))
        self.assertFalse(os.path.exists(out))

    def test_xser_tensors_folder_linked_out_of_a_tag(self):
        self.folder_linked_out_of_a_tag("model/dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors")

    def test_model_folder_linked_out_of_a_tag(self):
        self.folder_linked_out_of_a_tag("model")

if __name__ == "__main__":
    unittest.main()

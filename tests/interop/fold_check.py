"""The source check folded into the copy (#40): ckpt-reshard checks a source
with a manifest by the CRC-32s of what it reads anyway, reading only the
ranges it did not (ckpt/util/read_fold.h, ckpt/shard/source_check.h). Under
mpirun every rank records and rank 0 checks. The output is what the check
beside the copy gave; a byte flipped in a tensor (read by the copy, maybe by
the other rank) or in a pickle (read through a mapping: a gap the check
reads) is refused with exit 2, the file and its checksum named, nothing
written, at -np 1 and -np 2."""
import os
import subprocess
import unittest
import zipfile

from canon import RESHARD, TempDirTest, VERIFY
from nxd_fixture import make_full
from reshard import L, LLAMA, files, format_args

MPI = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
# Tensors past 64 KiB, so the copy reads them with pread (read whole below that).
MODEL = dict(LLAMA, hidden=128, ffn=256, layers=2, vocab=512)


def run(args, timeout=180):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def reshard(np, src, dst, *args):
    return run([*(MPI + ["-np", np] if np > 1 else []), RESHARD, src, dst, *args])


def record_span(path, suffix):
    """[start, end) of the data of the first zip record whose name ends with `suffix`."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix) and i.file_size > 0)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.file_size


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x40]))


class FoldedSourceCheck(TempDirTest):
    def setUp(self):
        super().setUp()
        self.assertTrue(os.path.exists(RESHARD), f"{RESHARD} is not built")
        # A source with a manifest: NxDT-style tags written by torch, resharded by us to tp 2.
        nxd = L(1, 1).write(os.path.join(self.dir, "nxd"), make_full(MODEL, tp=1))
        self.src = os.path.join(self.dir, "src")
        r = reshard(1, nxd, self.src, "--tp", 2, "--pp", 1, *format_args(MODEL))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.exists(os.path.join(self.src, "manifest.json")))
        self.rank_file = os.path.join(self.src, "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt")  # read by rank 1 at -np 2
        self.assertTrue(os.path.exists(self.rank_file), sorted(files(self.src)))

    def test_an_intact_source_gives_the_same_output_at_np_1_and_2(self):
        outs = []
        for np in (1, 2):
            dst = os.path.join(self.dir, f"out{np}")
            r = reshard(np, self.src, dst, "--tp", 1, "--pp", 2)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(os.path.exists(os.path.join(dst, "done")))
            v = run([VERIFY, dst, "--against", self.src])
            self.assertEqual(v.returncode, 0, v.stdout + v.stderr)
            outs.append(files(dst, bookkeeping=False))
        # The manifest records how many processes wrote the tag; every other byte is the same.
        self.assertNotEqual(outs[0].pop("manifest.json"), None)
        outs[1].pop("manifest.json")
        self.assertEqual(outs[0], outs[1])
        v = run([VERIFY, os.path.join(self.dir, "out1"), "--against", os.path.join(self.dir, "out2")])
        self.assertEqual(v.returncode, 0, v.stdout + v.stderr)

    def refused(self, region):
        start, end = record_span(self.rank_file, "data.pkl" if region == "pickle" else "/data/0")
        flip(self.rank_file, (start + end) // 2)
        for np in (1, 2):
            dst = os.path.join(self.dir, f"out{np}")
            r = reshard(np, self.src, dst, "--tp", 1, "--pp", 2)
            self.assertEqual(r.returncode, 2, f"{region} -np {np}: stdout {r.stdout!r} stderr {r.stderr!r}")
            damaged = r"model/dp_rank_00_tp_rank_01_pp_rank_00\.pt"
            if np == 2 and region == "pickle":
                # Every rank parses every pickle, with its zip CRC-32: rank 1 may fail first, naming the file.
                self.assertRegex(r.stderr, damaged + r"(: checksum [0-9a-f]{8} differs from the manifest's|: record 'data.pkl' fails its CRC-32 check)")
            else:
                self.assertIn("fails verification, so it is not read", r.stderr)
                self.assertRegex(r.stderr, damaged + r": checksum [0-9a-f]{8} differs from the manifest's")
            self.assertFalse(os.path.exists(dst), f"{region} -np {np}: {dst} was written")
            done = [d for d, _, names in os.walk(self.dir) if "done" in names and not d.startswith((self.src, os.path.join(self.dir, "nxd")))]
            self.assertEqual(done, [], f"{region} -np {np}: a tag was committed")

    def test_a_byte_flipped_in_a_tensor_is_refused_with_nothing_written(self):
        self.refused("tensor")

    def test_a_byte_flipped_in_a_pickle_is_refused_with_nothing_written(self):
        self.refused("pickle")


if __name__ == "__main__":
    unittest.main()

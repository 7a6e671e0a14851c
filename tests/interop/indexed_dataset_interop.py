"""Megatron mmap indexed datasets: files written the way Megatron writes them
(numpy, independently of our code) read by shardkit, and ours read back the
way Megatron reads them."""
import os
import struct
import unittest

import numpy as np

from canon import TOKENIZE, TempDirTest, run

MAGIC = b"MMIDIDX\x00\x00"
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def megatron_write(prefix, docs, dtype):
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dtype).tobytes(order="C"))
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.zeros(len(docs), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64), out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def megatron_read(prefix):
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == MAGIC
        assert struct.unpack("<Q", f.read(8))[0] == 1
        code = struct.unpack("<B", f.read(1))[0]
        n = struct.unpack("<Q", f.read(8))[0]
        struct.unpack("<Q", f.read(8))
        sizes = np.frombuffer(f.read(4 * n), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * n), dtype=np.int64)
    dtype = {v: k for k, v in CODES.items()}[code]
    data = np.memmap(prefix + ".bin", dtype=np.uint8, mode="r")
    return [np.frombuffer(data, dtype=dtype, count=s, offset=p).tolist() for s, p in zip(sizes, pointers)]


class IndexedDatasetInterop(TempDirTest):
    def test_we_read_megatron_written_files_of_every_integer_dtype(self):
        rng = np.random.default_rng(0)
        for dtype in CODES:
            with self.subTest(dtype=dtype.__name__):
                hi = min(np.iinfo(dtype).max, 50000)
                docs = [rng.integers(0, hi, size=n).tolist() for n in (5, 0, 17, 3)]
                prefix = os.path.join(self.dir, dtype.__name__)
                megatron_write(prefix, docs, dtype)
                flat = [t for d in docs for t in d]
                out = run(TOKENIZE, "--dump", prefix, "2", str(len(flat) - 2)).stdout.splitlines()
                self.assertEqual([int(t) for t in out[0].split()], flat[2:])
                self.assertEqual(out[1], f"4 sequences, {len(flat)} tokens")

    def test_megatron_reads_our_byte_tokenized_text(self):
        text = "first paragraph.\nstill first\n\n\nsecond ü\n"
        src = os.path.join(self.dir, "in.txt")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        prefix = os.path.join(self.dir, "tok")
        run(TOKENIZE, src, prefix)
        docs = megatron_read(prefix)
        raw = text.encode("utf-8")
        first = raw[: raw.index(b"\n\n") + 1]
        self.assertEqual(docs[0], list(first) + [256])
        self.assertEqual(docs[1], list(b"second \xc3\xbc\n") + [256])
        self.assertEqual(len(docs), 2)

    def test_bad_dataset_is_named(self):
        prefix = os.path.join(self.dir, "bad")
        megatron_write(prefix, [[1, 2, 3]], np.uint16)
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(2)
        p = run(TOKENIZE, "--dump", prefix, "0", "1", check=False)
        self.assertEqual(p.returncode, 2)  # bad input
        self.assertIn(prefix + ".bin: sequence 0 (3 tokens at byte 0) lies outside the 2-byte file", p.stderr)
        good = os.path.join(self.dir, "good")
        megatron_write(good, [[1, 2, 3]], np.uint16)
        for argv, message in (([os.path.join(self.dir, "missing.txt"), good + "2"], "missing.txt: cannot open"),
                              (["--dump", good, "0", "x"], "COUNT: 'x' is not a whole number")):
            p = run(TOKENIZE, *argv, check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(message, p.stderr)


if __name__ == "__main__":
    unittest.main()

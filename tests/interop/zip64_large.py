"""A checkpoint past 4 GiB needs ZIP64; torch and Python's zipfile must read ours."""
import os
import tempfile
import unittest
import zipfile

import torch

from canon import PT_CANONICAL, run

MIB = 4200  # > 4 GiB (4096 MiB), so both a size and a later offset overflow 32 bits


class Zip64(unittest.TestCase):
    def test_file_over_4gib(self):
        with tempfile.TemporaryDirectory(dir=os.environ.get("SHARDKIT_BIG_TMP")) as d:
            path = os.path.join(d, "big.pt")
            run(PT_CANONICAL, "big", path, MIB)
            self.assertGreater(os.path.getsize(path), 4 << 30)
            # Our reader, every byte and every CRC.
            self.assertEqual(run(PT_CANONICAL, "check-big", path, MIB).stdout.strip(), "ok")
            # Python's zipfile parses the ZIP64 records; check the small record past 4 GiB.
            with zipfile.ZipFile(path) as z:
                infos = {i.filename: i for i in z.infolist()}
                big = infos["big/data/0"]
                after = infos["big/data/1"]
                self.assertEqual(big.file_size, MIB << 20)
                self.assertGreater(after.header_offset, 1 << 32)
                self.assertEqual(z.read(after.filename), b"".join((1000 + i).to_bytes(8, "little") for i in range(4)))
            # torch reads it back.
            obj = torch.load(path)
            n = MIB << 20
            self.assertEqual(obj["all"].numel(), n)
            self.assertEqual(obj["tail"].storage().data_ptr(), obj["all"].storage().data_ptr())
            idx = torch.tensor([0, 1, 250, 251, n // 2, n - 1])
            self.assertEqual(obj["all"][idx].tolist(), [(int(i) * 7) % 251 for i in idx])
            self.assertEqual(obj["after"].tolist(), [1000, 1001, 1002, 1003])


if __name__ == "__main__":
    unittest.main()

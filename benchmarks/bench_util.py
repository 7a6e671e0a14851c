"""Helpers shared by the benchmarks. No torch here: timed commands fork from
the benchmark process, and a child's peak RSS counts what its parent held
before exec."""
import os
import shutil


def settle(remove=None, warm=None):
    """Removes `remove` (a file or a folder), syncs, drops the page cache
    (as root) and reads `warm` once so it is cached."""
    if remove and os.path.isdir(remove):
        shutil.rmtree(remove)
    elif remove and os.path.exists(remove):
        os.remove(remove)
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass
    if warm:
        with open(warm, "rb") as f:
            while f.read(1 << 24):
                pass

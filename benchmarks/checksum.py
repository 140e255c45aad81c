#!/usr/bin/env python
"""What the shard checksums cost (issue 12): hashing a Kimi-shaped row against writing it.

    python benchmarks/checksum.py              # one 117 MB row: 4 states x 2048 tokens x 7168 x 2 bytes
    python benchmarks/checksum.py --rows 4 --repeat 5

Every figure is a ratio against the raw write measured in the same run on the same disk
(``numpy.tofile`` + ``fsync`` of the same bytes): the hash of a shard just written, read back from
the page cache as the build's committer thread does (``hs_dataset.integrity.checksums.file_digest``:
xxh3-128), and, side by side, the same read with sha256 and blake2b (hashlib). Best of
``--repeat`` runs (a shared VM swings single runs).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hs_dataset.integrity.checksums import edges_digest, file_digest  # noqa: E402


def _hashlib_digest(path: Path, name: str) -> str:
    h = hashlib.new(name)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--states", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = ap.parse_args()
    n = a.rows * a.states * a.tokens * a.hidden
    bits = np.random.default_rng(0).integers(0, 1 << 16, n, dtype=np.uint16)
    nbytes = bits.nbytes
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = Path(d) / "shard.bin"

        def write() -> None:
            bits.tofile(path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())

        runs = {"write (tofile + fsync)": write, "xxh3-128 (file_digest)": lambda: file_digest(path),
                "first+last MiB (edges_digest)": lambda: edges_digest(path),
                "sha256": lambda: _hashlib_digest(path, "sha256"), "blake2b": lambda: _hashlib_digest(path, "blake2b")}
        best = {k: float("inf") for k in runs}
        for _ in range(a.repeat):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    raw = best["write (tofile + fsync)"]
    print(f"{a.rows} row(s) of {a.states} states x {a.tokens} tokens x {a.hidden} x 2 bytes = {nbytes / 1e6:.0f} MB")
    for name, t in best.items():
        print(f"  {name:32s} {t * 1e3:8.1f} ms  {nbytes / t / 1e9:6.2f} GB/s  {t / raw:5.2f}x the write")
    return 0


if __name__ == "__main__":
    sys.exit(main())

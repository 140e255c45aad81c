#!/usr/bin/env python3
"""How fast one process can write Kimi-width rows into a file system, by method (issue 26's builder speed).

The builder into /dev/shm moved 1.26-1.9 GB/s of states on the H200's host (16 cores), where 0.9x of the
engine's prefill at Kimi width is ~6 GB/s. Its shard writes then went through 8 MiB pieces of each write
on several threads with ``pwrite`` into one file; a buffered write holds the file's inode lock on tmpfs
and ext4, so pieces of one file may not be written in parallel at all (on the device they were not:
``hs_dataset/write/native_files.py`` writes one native file a thread since). This measures, for the
same bytes (``--rows`` rows of ``--mb`` MB, random bits, written ``--reps`` times each, the file removed
between runs):

  write        one thread, ``os.write`` of each row into one file (the baseline)
  pwrite-K     K threads, ``os.pwrite`` of 8 MiB pieces into one file (what the builder did before)
  mmap-K       the file sized first, mapped, K threads copying rows into the mapping
  files-K      K files at once, a thread each writing its rows (shard files written side by side)

Printed per method: GB/s (best of the reps) and CPU seconds per GB (every thread). The builder's
design follows the fastest method that keeps one file per shard where it can.

By default every write is of the same row, which a large last-level cache may hold. ``--ring-gib G`` writes
distinct rows instead, taken in turn from a G GiB shared mapping of a file in ``--dir`` (as the build's rows
are views of the capture ring, a /dev/shm mapping in 4 KiB pages): what the build's writes read.

    python benchmarks/file_writes.py --dir /dev/shm --threads 2,4,8 --json $OUT/file-writes.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

PIECE = 8 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _threads(k: int, work: Callable[[int], None]) -> None:
    ts = [threading.Thread(target=work, args=(j,)) for j in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def methods(source: list[np.ndarray], rows: int, path: Path, ks: list[int]) -> dict[str, Callable[[], None]]:
    """The methods over ``rows`` writes; write ``i`` is of ``source[i % len(source)]`` (rows of one size)."""
    row = source[0]
    n = row.nbytes
    total = rows * n

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for i in range(rows):
            os.write(fd, source[i % len(source)])
        os.close(fd)

    def pwrite(k: int) -> Callable[[], None]:
        def run() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            view = memoryview(row)
            pieces = [(i * n + a, view[a:a + PIECE]) for i in range(rows) for a in range(0, n, PIECE)]
            _threads(k, lambda j: [os.pwrite(fd, v, off) for off, v in pieces[j::k]])
            os.close(fd)
        return run

    def mapped(k: int) -> Callable[[], None]:
        def run() -> None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, total)
            m = mmap.mmap(fd, total)
            dst = np.frombuffer(m, dtype=np.uint8)
            _threads(k, lambda j, d=dst: [np.copyto(d[i * n:(i + 1) * n], source[i % len(source)])
                                          for i in range(j, rows, k)])
            del dst
            m.close()
            os.close(fd)
        return run

    def files(k: int) -> Callable[[], None]:
        def run() -> None:
            def one(j: int) -> None:
                fd = os.open(f"{path}.{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                for i in range(j, rows, k):
                    os.write(fd, source[i % len(source)])
                os.close(fd)
            _threads(k, one)
        return run

    out = {"write": write}
    for k in ks:
        out[f"pwrite-{k}"] = pwrite(k)
        out[f"mmap-{k}"] = mapped(k)
        out[f"files-{k}"] = files(k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--mb", type=float, default=117.4, help="bytes of one row (a 2,048-token Kimi-width row: 117.4)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--threads", default="2,4,8")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ring-gib", type=float, default=0.0,
                    help="distinct rows from a shared mapping of this size in --dir, as the build's ring (0: one row)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    row = np.random.default_rng(0).integers(0, 255, size=int(a.mb * 1e6), dtype=np.uint8)
    path = Path(a.dir) / f"hs-file-writes-{os.getpid()}"
    source, ring = [row], None  # ring: the mapping, open while its rows are written
    if a.ring_gib:
        size = int(a.ring_gib * 2**30) // row.nbytes * row.nbytes
        fd = os.open(f"{path}-ring", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, size)
        ring = mmap.mmap(fd, size)
        os.close(fd)
        os.unlink(f"{path}-ring")
        flat = np.frombuffer(ring, dtype=np.uint8)
        source = [flat[i:i + row.nbytes] for i in range(0, size, row.nbytes)]
        for r in source:
            r[:] = row  # every page touched, as the engine's copies touch the ring's
    ks = [int(k) for k in a.threads.split(",")]
    total = a.rows * row.nbytes
    res: dict[str, dict[str, float]] = {}
    for _ in range(a.reps):  # interleaved: each method once per round
        for name, run in methods(source, a.rows, path, ks).items():
            c, t = _cpu(), time.perf_counter()
            run()
            dt, cpu = time.perf_counter() - t, _cpu() - c
            for p in Path(a.dir).glob(path.name + ".*"):
                p.unlink()
            if path.exists():
                path.unlink()
            r = res.setdefault(name, {"GBps": 0.0, "cpu_s_per_GB": float("inf")})
            r["GBps"] = max(r["GBps"], round(total / dt / 1e9, 3))
            r["cpu_s_per_GB"] = min(r["cpu_s_per_GB"], round(cpu / (total / 1e9), 3))
    print(f"{a.rows} rows x {row.nbytes / 1e6:.1f} MB into {a.dir} ({len(source)} distinct), {os.cpu_count()} CPUs, "
          f"best of {a.reps}")
    for name, r in res.items():
        print(f"  {name:10s} {r['GBps']:6.2f} GB/s  {r['cpu_s_per_GB']:5.2f} CPU-s/GB")
    if a.json:
        Path(a.json).write_text(json.dumps({"dir": a.dir, "row_bytes": row.nbytes, "rows": a.rows, "cpus": os.cpu_count(),
                                            "distinct_rows": len(source), "reps": a.reps, "methods": res}, indent=1))


if __name__ == "__main__":
    main()

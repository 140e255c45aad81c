#!/usr/bin/env python3
"""What the build-time statistics (issue 30, ``hs_dataset.integrity.stats``) cost per row at Kimi-K2.5's
width, against raw baselines measured in the same run.

A row: 4 states (3 layers + final) x 2048 tokens x 7168, as bf16 (117 MB) and as fp8 e4m3 with per-token
scales (59 MB). Per row and storage dtype, best of ``--reps``:

  stats      every state counted (``row_stats``) on one thread
  memcpy     the row's bytes copied into a preallocated buffer (the least a pass over the row costs)
  write      the row's bytes written with ``tofile`` + ``fsync`` (what a build does with them, on ``--dir``)

and the ratios stats / memcpy and stats / write. A build counts rows on ``stats_workers()`` threads
(a quarter of the CPUs, 1 to 4) while it writes the next ones, so it keeps up while stats / workers
stays below the time a row takes to write; the JSON also gives the tokens per second one thread counts.

    python benchmarks/stats_overhead.py --json benchmarks/results/<date>-<machine>-stats.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hs_dataset.codec.fp8 import fp8_quantize
from hs_dataset.integrity.stats import row_stats, stats_workers

HIDDEN, TOKENS, STATES = 7168, 2048, 4
COLUMNS = ["hidden_layer_1", "hidden_layer_3", "hidden_layer_4", "hidden_final"]


def make_row(dtype: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    row: dict = {"id": "bench:0", "input_ids": np.arange(TOKENS, dtype=np.int32),
                 "loss_mask": np.ones(TOKENS, np.uint8)}
    for c in COLUMNS:
        x = (torch.randn(TOKENS, HIDDEN, generator=g) * 2).to(torch.bfloat16)
        x[:, :4] *= 1000  # massive-activation channels, as real models have
        if dtype == "bfloat16":
            row[c] = x.view(torch.int16).numpy().view(np.uint16)
        else:
            q, s = fp8_quantize(x)
            row[c], row[c + "_scale"] = q.numpy(), s.numpy()
    return row


def row_bytes(row: dict) -> list[np.ndarray]:
    return [row[k] for k in row if k.startswith("hidden_")]


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the write baseline writes")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res: dict = {"hidden": HIDDEN, "tokens": TOKENS, "states": STATES, "cpus": os.cpu_count(),
                 "stats_workers": stats_workers(), "torch_threads": torch.get_num_threads(), "reps": a.reps}
    for dtype in ("bfloat16", "fp8_e4m3"):
        row = make_row(dtype)
        arrays = row_bytes(row)
        nbytes = sum(x.nbytes for x in arrays)
        dst = [np.empty_like(x) for x in arrays]

        def copy() -> None:
            for s, d in zip(arrays, dst):
                np.copyto(d, s)

        path = Path(a.dir) / f"hs-stats-bench-{os.getpid()}.bin"

        def write() -> None:
            with open(path, "wb") as f:
                for x in arrays:
                    x.tofile(f)
                f.flush()
                os.fsync(f.fileno())

        row_stats(row, COLUMNS)  # warm: buffers, page faults
        t_stats = best(lambda: row_stats(row, COLUMNS), a.reps)
        t_copy = best(copy, a.reps)
        t_write = best(write, a.reps)
        path.unlink(missing_ok=True)
        res[dtype] = {"row_bytes": nbytes, "stats_ms": round(t_stats * 1e3, 1), "memcpy_ms": round(t_copy * 1e3, 1),
                      "write_ms": round(t_write * 1e3, 1), "stats_vs_memcpy": round(t_stats / t_copy, 2),
                      "stats_vs_write": round(t_stats / t_write, 3),
                      "tok_per_s_one_thread": round(TOKENS / t_stats)}
        print(dtype, json.dumps(res[dtype]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

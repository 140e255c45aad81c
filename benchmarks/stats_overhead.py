#!/usr/bin/env python3
"""What the build-time statistics (issue 30, ``hs_dataset.integrity.stats``) cost per row at Kimi-K2.5's
width, against raw baselines measured in the same run.

A row: 4 states (3 layers + final) x 2048 tokens x 7168, as bf16 (117 MB) and as fp8 e4m3 with per-token
scales (59 MB). Per row and storage dtype, best of ``--reps``:

  stats      every state counted (``row_stats``) from one thread (each kernel call on torch's threads)
  memcpy     the row's bytes copied into a preallocated buffer (the least a pass over the row costs)
  write      the row's bytes written with ``tofile`` + ``fsync`` (what a build does with them, on ``--dir``)

and the ratios stats / memcpy and stats / write. A build counts rows on ``stats_workers()`` threads (2)
while it writes the next ones, so it keeps up while stats / workers stays below the time a row takes to
write; the JSON also gives the tokens per second one counting thread counts.

``--threads 1,4,8`` then counts bf16 rows on that many threads at once (each its own row), the total GB/s,
for each ``--chunk`` (values a step of the kernels, ``value_stats.STEP_VALUES``: a handful of torch calls
each) and each ``--switch-ms`` (Python's GIL switch interval, 5 ms by default), with ``--busy`` threads
running Python code beside them (a build's own thread, the ring reader). Each return from a call that
released the GIL waits up to the switch interval while a busy thread runs: on the H200's host
(2026-12-03) the numpy kernels of the time (~110 calls a Kimi-width state) gave 1.37 GB/s on 8 threads
beside one busy thread at 0.5 ms, 0.32 GB/s at 5 ms.

``--gpu`` times instead what the SGLang plugin reads on the GPU per prefill pass
(``hs_dataset.codec.state_scan.scan_state`` of 4 states x ``--pass-tokens`` x 7168: NaN/Inf, statistics, and
with fp8 the quantization): the Triton kernel the plugin runs, and the PyTorch path (``kernel=False``: the
plugin's form before it, and the kernel's reference), each bf16 only and with fp8, against a device copy of
the same bytes (the least a pass over them costs), and the completion thread's ``span_stats`` of the pass's
8 requests on the CPU.

    python benchmarks/stats_overhead.py --json benchmarks/results/<date>-<machine>-stats.json
    python benchmarks/stats_overhead.py --threads 1,2,8 --switch-ms 5,0.5 --busy 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from hs_dataset.codec.fp8 import fp8_quantize
from hs_dataset.integrity import value_stats
from hs_dataset.integrity.stats import row_stats, stats_workers

STEP = value_stats.STEP_VALUES

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


def threaded(threads: int, chunk: int, switch_s: float, busy: int, rows: int) -> float:
    """Total GB/s of ``threads`` threads each counting ``rows`` bf16 rows (its own row), with ``busy`` threads
    running Python code, at ``chunk`` values a step (``value_stats.STEP_VALUES``) and the GIL switch interval
    ``switch_s``."""
    value_stats.STEP_VALUES = chunk
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    data = [make_row("bfloat16", seed=k) for k in range(threads)]
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    def count(row: dict) -> None:
        for _ in range(rows):
            row_stats(row, COLUMNS)

    spinners = [threading.Thread(target=spin) for _ in range(busy)]
    workers = [threading.Thread(target=count, args=(r,)) for r in data]
    try:
        for t in spinners:
            t.start()
        t0 = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        dt = time.perf_counter() - t0
    finally:
        stop.set()
        for t in spinners:
            t.join()
        sys.setswitchinterval(before)
        value_stats.STEP_VALUES = STEP
    return threads * rows * sum(x.nbytes for x in row_bytes(data[0])) / dt / 1e9


def gpu(a: argparse.Namespace) -> None:
    """What the plugin counts per pass on the GPU (see the module docstring), best of ``--reps``, in ms."""
    from hs_dataset.codec.state_scan import scan_state
    from hs_dataset.codec.state_stats import span_stats, token_stats

    def timed(fn) -> float:
        best_ms = float("inf")
        for _ in range(a.reps + 1):  # the first warms the kernels and the allocator
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best_ms = min(best_ms, start.elapsed_time(end))
        return best_ms

    T = a.pass_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((STATES, T, HIDDEN), device="cuda", generator=g) * 2
    x[..., :3] *= 4000  # outlier channels
    x = x.to(torch.bfloat16)
    dst = torch.empty_like(x)
    res: dict = {"gpu": torch.cuda.get_device_name(), "states": STATES, "pass_tokens": T, "hidden": HIDDEN,
                 "reps": a.reps, "copy_ms": round(timed(lambda: dst.copy_(x)), 3)}
    for kernel in (True, False):
        for fp8 in (False, True):
            res[f"scan_{'kernel' if kernel else 'pytorch'}_{'fp8' if fp8 else 'bf16'}_ms"] = round(
                timed(lambda: [scan_state(st, fp8=fp8, kernel=kernel) for st in x]), 3)
    per_token = torch.stack([token_stats(st) for st in x]).cpu()
    spans = [(i * (T // 8), T // 8) for i in range(8)]
    t = time.perf_counter()
    for _ in range(a.reps):
        for sp in spans:
            span_stats(per_token, [sp])
    res["span_stats_cpu_ms_per_pass"] = round((time.perf_counter() - t) / a.reps * 1e3, 3)
    print(json.dumps(res), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the write baseline writes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", default="", help="e.g. 1,8,12: then the threaded table (see the docstring)")
    ap.add_argument("--chunk", default=str(STEP), help="values a step of the kernels, comma separated")
    ap.add_argument("--switch-ms", default="5", help="GIL switch intervals, comma separated")
    ap.add_argument("--busy", type=int, default=0, help="threads running Python code beside the counting ones")
    ap.add_argument("--rows", type=int, default=4, help="rows each counting thread counts")
    ap.add_argument("--gpu", action="store_true", help="the plugin's per-token statistics on the GPU instead")
    ap.add_argument("--pass-tokens", type=int, default=16384, help="with --gpu: tokens of a prefill pass")
    a = ap.parse_args()
    if a.gpu:
        gpu(a)
        return
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
    for n in [int(x) for x in a.threads.split(",") if x]:
        for chunk in [int(x) for x in a.chunk.split(",")]:
            for ms in [float(x) for x in a.switch_ms.split(",")]:
                gbps = threaded(n, chunk, ms / 1e3, a.busy, a.rows)
                key = f"threads={n} chunk={chunk} switch_ms={ms} busy={a.busy}"
                res.setdefault("threaded_GBps", {})[key] = round(gbps, 2)
                print(key, f"{gbps:.2f} GB/s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What the builder's host side costs per GB of states at Kimi-K2.5's width, by stage, on this machine.

Each variant builds the same source in a fresh process into ``--dir`` (default /dev/shm) from precomputed
bf16 states (``benchmarks/storage.py``'s PrecomputedBackend: no model runs, as with an engine whose GPU
does the work), ``--samples`` samples of 2,048 tokens, layers 1, 3, 4 + final (57,344 bytes a token):

  base         the build as it is (statistics counted while it writes)
  nostats      the same without the build-time statistics (StatsCollector.add a no-op: for this measure only)
  zstd         compression=zstd (shards coded at the commit)
  parquet      file_format=parquet

Printed per variant: the build's wall time and GB/s of stored bytes, and the process's CPU seconds
(user + system, every thread) per GB. fp8 is left out: here it would be quantized on the CPU, which
the SGLang plugin does on the GPU.

``--part-size``, ``--max-shard-mib`` and ``--queue-mib`` set what decides how many shard files are written at
once (each by a thread of its own, ``hs_dataset/write/native_files.py``): parts, shards, and the bytes queued
for the writers in all. On the H200's host, 64 samples into /dev/shm with part_size 16 moved 3.87 GB/s with
2 GiB shards and 4.84 GB/s with 512 MiB ones, a 6 GiB queue changing neither
(``benchmarks/results/2026-12-04-h200-write-side-sweep.json``, from a script these options replace).

``--trees OLD,NEW`` runs each variant from each checkout (a folder holding ``hs_dataset/`` and ``benchmarks/``,
e.g. ``git archive REV hs_dataset benchmarks | tar -x -C OLD``), interleaved, and prints NEW's wall time and CPU
per GB against OLD's: a change to the write path measured before and after in one run.

    python benchmarks/build_cpu.py --json benchmarks/results/<date>-<machine>-build-cpu.json
    python benchmarks/build_cpu.py --variants base --trees /tmp/before,. --reps 3
    python benchmarks/build_cpu.py --samples 64 --variants base --part-size 16 --max-shard-mib 512
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("base", "nostats", "zstd", "parquet")


def one(variant: str, work: Path, samples: int, part_size: int = 4, max_shard_mib: int = 0, queue_mib: int = 0) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from long_context import source
    from storage import PrecomputedBackend, Shape, make_model_dir, make_states

    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.integrity.stats import StatsCollector
    from hs_dataset.write import native_files
    from hs_dataset.write.driver import build

    if queue_mib:
        native_files.QUEUE_BYTES = queue_mib << 20  # for this measure only
    if "nostats" in variant:
        StatsCollector.add = lambda self, row: None  # type: ignore[method-assign]
    tokens, hidden = 2048, 7168
    shape = Shape(hidden, 3, tokens, samples)
    model = make_model_dir(work / "model", hidden)
    backend = PrecomputedBackend(model, shape.layers(), make_states(shape))
    src = source(work / "src.jsonl", samples, tokens, seed=0)
    out = work / f"out-{variant}"
    shutil.rmtree(out, ignore_errors=True)
    sizes = {"max_shard_bytes": max_shard_mib << 20} if max_shard_mib else {}
    cfg = HiddenStatesConfig(model=str(model), layers=shape.layers(), source=str(src), max_length=tokens,
                             part_size=part_size, compression="zstd" if variant == "zstd" else "none",
                             file_format="parquet" if variant == "parquet" else "arrow", **sizes)
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    s = build(cfg, out, backend=backend, progress=False)
    dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    shards = len(list((out / "data").iterdir()))
    shutil.rmtree(out, ignore_errors=True)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    gb = s.bytes_written / 1e9
    return {"variant": variant, "part_size": part_size, "max_shard_mib": max_shard_mib or None,
            "queue_mib": native_files.QUEUE_BYTES >> 20, "shards": shards, "tokens": s.counts.tokens_written,
            "bytes_per_token": round(s.bytes_written / s.counts.tokens_written),
            "wall_s": round(dt, 2), "GBps": round(gb / dt, 3), "cpu_s_per_GB": round(cpu / gb, 2),
            "user_s": round(r1.ru_utime - r0.ru_utime, 2), "sys_s": round(r1.ru_stime - r0.ru_stime, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default="/dev/shm/hs-build-cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--part-size", type=int, default=4)
    ap.add_argument("--max-shard-mib", type=int, default=0, help="shard size (0: the config's default)")
    ap.add_argument("--queue-mib", type=int, default=0,
                    help="bytes queued for the shard writers in all (0: native_files.QUEUE_BYTES)")
    ap.add_argument("--trees", default=str(ROOT), help="checkouts to run each variant from, comma-separated "
                    "(the last against the first)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a variant, in this process
    a = ap.parse_args()
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    if a.one:
        print(json.dumps(one(a.one, work, a.samples, a.part_size, a.max_shard_mib, a.queue_mib)))
        return
    results = []
    trees = [str(Path(t).resolve()) for t in a.trees.split(",")]
    for rep in range(a.reps):
        for v in a.variants.split(","):
            # each checkout's own script and package (PYTHONPATH: nothing else wins); the order flips every rep (the first
            # build into a fresh --dir runs on colder pages)
            for tree in (trees if rep % 2 == 0 else trees[::-1]):
                env = dict(os.environ, PYTHONPATH=tree)
                r = subprocess.run([sys.executable, str(Path(tree) / "benchmarks" / "build_cpu.py"), "--one", v,
                                    "--samples", str(a.samples), "--dir", str(work), "--part-size", str(a.part_size),
                                    "--max-shard-mib", str(a.max_shard_mib), "--queue-mib", str(a.queue_mib)],
                                   capture_output=True, text=True, check=True, env=env)
                results.append(dict(json.loads(r.stdout.strip().splitlines()[-1]), tree=tree))
                x = results[-1]
                print(f"{v:12s} {x['bytes_per_token']:>7,} B/token  {x['GBps']:.2f} GB/s  {x['cpu_s_per_GB']:.2f} "
                      f"CPU-s/GB (user {x['user_s']}, sys {x['sys_s']}), {x['shards']} shards  [{tree}]", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    ratios = {}
    if len(trees) > 1:  # the last checkout against the first, per variant: median wall time and CPU per GB of each
        for v in a.variants.split(","):
            mid = {t: (statistics.median(x["wall_s"] for x in results if x["tree"] == t and x["variant"] == v),
                       statistics.median(x["cpu_s_per_GB"] for x in results if x["tree"] == t and x["variant"] == v))
                   for t in trees}
            ratios[v] = {"wall": round(mid[trees[-1]][0] / mid[trees[0]][0], 3),
                         "cpu_per_GB": round(mid[trees[-1]][1] / mid[trees[0]][1], 3)}
            print(f"{v:12s} {trees[-1]} / {trees[0]}: wall x{ratios[v]['wall']}, CPU per GB x{ratios[v]['cpu_per_GB']} "
                  "(medians)")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpus": os.cpu_count(), "samples": a.samples, "trees": trees,
                                            "ratios": ratios, "runs": results}, indent=1))


if __name__ == "__main__":
    main()

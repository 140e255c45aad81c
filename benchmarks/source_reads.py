#!/usr/bin/env python3
"""A build's source read in parts against one pass over it: JSONL and Parquet, ``--rows`` rows (1M by default).

A build reads its source part by part (``part_size`` rows, 256 by default): one call of
:func:`hs_dataset.prepare.sources.read_rows` per part when each part is captured on its own, one call over
every part's range when one capture serves them all (SGLang's stream). Both must cost about one pass
over the file: a JSONL part starts from the line offsets recorded while the rows were counted, a Parquet
part from its row group (decoded once for all the parts inside it). Measured in one process:

  one_pass     read_rows(source, [(0, None)])
  parts_one    read_rows(source, every part's range)          (one call)
  parts_each   read_rows(source, [part]) for every part       (a call each)

Each on a freshly resolved source whose rows and fingerprint were taken before the clock starts (a build
takes them once at its start; ``scan_s`` says what that cost), best of ``--repeat`` interleaved runs, as wall
and CPU seconds (on a shared machine the CPU seconds are the steadier). The ratios parts/one_pass are the
target (<= 1.2).

    python benchmarks/source_reads.py --json benchmarks/results/<date>-<machine>-source-reads.json
    python benchmarks/source_reads.py --rows 100000 --part-size 256
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from hs_dataset.prepare.source_spec import Source, resolve_source  # noqa: E402
from hs_dataset.prepare.sources import read_rows  # noqa: E402


def row(i: int) -> dict:
    return {"id": i, "conversations": [{"from": "human", "value": f"question {i}: " + "why is the sky blue? " * 3},
                                       {"from": "gpt", "value": f"answer {i}: " + "light scatters. " * 6}]}


def write_sources(folder: Path, rows: int) -> tuple[Path, Path]:
    jsonl, parquet = folder / "rows.jsonl", folder / "rows.parquet"
    block = 100_000
    with open(jsonl, "w", encoding="utf-8") as f, pq.ParquetWriter(parquet, pa.Table.from_pylist([row(0)]).schema) as w:
        for b0 in range(0, rows, block):  # Parquet: pyarrow's default row groups (up to 1Mi rows each)
            chunk = [row(i) for i in range(b0, min(b0 + block, rows))]
            f.write("".join(json.dumps(r) + "\n" for r in chunk))
            w.write_table(pa.Table.from_pylist(chunk))
    return jsonl, parquet


def fresh(path: Path) -> tuple[Source, float]:
    t = time.perf_counter()
    source = resolve_source(path)
    assert source.rows and source.fingerprint
    return source, time.perf_counter() - t


def timed(source: Source, calls: list[list[tuple[int, int | None]]]) -> tuple[float, float, int]:
    """-> (wall seconds, this process's CPU seconds, rows read)."""
    t, c, n = time.perf_counter(), time.process_time(), 0
    for ranges in calls:
        for _ in read_rows(source, ranges):
            n += 1
    return time.perf_counter() - t, time.process_time() - c, n


def measure(path: Path, part_size: int, repeat: int) -> dict:
    source, scan = fresh(path)
    n = source.rows
    parts: list[tuple[int, int | None]] = [(s, min(s + part_size, n)) for s in range(0, n, part_size)]
    out: dict = {"rows": n, "parts": len(parts), "bytes": path.stat().st_size, "scan_s": round(scan, 3)}
    variants = (("one_pass", [[(0, None)]]), ("parts_one", [parts]), ("parts_each", [[p] for p in parts]))
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeat):  # interleaved, best of each: the machine may be shared
        for name, calls in variants:
            source, _ = fresh(path)
            wall, cpu, read = timed(source, calls)
            assert read == n, (name, read, n)
            w, c = best.get(name, (wall, cpu))
            best[name] = (min(w, wall), min(c, cpu))
    for name, (wall, cpu) in best.items():
        out[f"{name}_s"], out[f"{name}_cpu_s"] = round(wall, 3), round(cpu, 3)
    for name in ("parts_one", "parts_each"):
        out[f"ratio_{name}"] = round(best[name][0] / best["one_pass"][0], 3)
        out[f"ratio_{name}_cpu"] = round(best[name][1] / best["one_pass"][1], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--part-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each variant, interleaved (best kept)")
    ap.add_argument("--dir", default=None, help="where the sources are written (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        jsonl, parquet = write_sources(Path(tmp), a.rows)
        results = {"rows": a.rows, "part_size": a.part_size, "repeat": a.repeat,
                   "jsonl": measure(jsonl, a.part_size, a.repeat), "parquet": measure(parquet, a.part_size, a.repeat)}
    print(json.dumps(results, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

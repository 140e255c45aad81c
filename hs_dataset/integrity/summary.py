"""A build's statistics (``hs_dataset.json``, ``statistics``): its parts' (:mod:`hs_dataset.integrity.stats`)
summed in part order, their flags and duplicates named by row and sample id, and compared with a recount.

``statistics`` holds: ``rows``, ``tokens``, ``masked_tokens`` and ``mask_fraction``; ``lengths`` (the
histogram: ``bin`` tokens wide from 1, ``counts``, ``min``, ``max``); per state column ``values``,
``sum``, ``sumsq``, ``mean``, ``std``, ``absmax``, ``nan``, ``inf``, ``fp8_limit`` and its share;
``flags`` (rows with NaN/Inf or saturated fp8 values: ``row``, ``id``, ``column``, ``what``); and
``duplicates``: samples whose token ids repeat an earlier row's (``same_ids``; ``same_ids_and_mask`` of
them with the same mask too: identical rows), their ``tokens`` (the prefill spent on them again), the
rows left out by ``duplicates=skip`` (``skipped``, rejects of stage ``duplicate``) and the first
:data:`LISTED` of them by row and id.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hs_dataset.integrity.stats import PartStatistics
from hs_dataset.integrity.value_stats import ColumnStats, saturation_limit
from hs_dataset.layout import DATA_DIR, DUPLICATE_STAGE
from hs_dataset.prepare.duplicates import DuplicateIndex

__all__ = ["LISTED", "REL_TOLERANCE", "build_statistics", "compare_statistics", "merge_parts", "row_ids"]

LISTED = 100  # duplicates and flags listed by id in hs_dataset.json (all are counted)
# Sums recounted on another machine (another SIMD width) round differently in float32: each may differ by
# this share of its scale (the sum of squares: itself; the sum: sqrt(values * sum of squares) >= sum |x|).
REL_TOLERANCE = 1e-5


def merge_parts(parts: list[PartStatistics]) -> PartStatistics:
    """The parts' statistics as one, in part order (flags' rows become rows of the whole build)."""
    total = PartStatistics(length_bin=parts[0].length_bin if parts else 1,
                           length_counts=[0] * len(parts[0].length_counts) if parts else [])
    for p in parts:
        for c, s in p.columns.items():
            total.columns.setdefault(c, ColumnStats()).merge(s)
        total.flags += [dict(f, row=f["row"] + total.rows) for f in p.flags]
        total.min_tokens = p.min_tokens if not total.rows else min(total.min_tokens, p.min_tokens or total.min_tokens)
        total.rows += p.rows
        total.tokens += p.tokens
        total.masked_tokens += p.masked_tokens
        total.max_tokens = max(total.max_tokens, p.max_tokens)
        total.length_counts = [a + b for a, b in zip(total.length_counts, p.length_counts)]
        total.ids_digests += p.ids_digests
        total.row_digests += p.row_digests
    return total


def row_ids(root: Path, shards: list[dict[str, Any]], rows: set[int]) -> dict[int, tuple[str, int]]:
    """``{row: (sample id, tokens)}`` of ``rows`` (rows of the whole build, in the order of ``shards``),
    read from the shards' ``id`` and ``num_tokens`` columns only (the states are not paged in)."""
    out: dict[int, tuple[str, int]] = {}
    first = 0
    for s in shards:
        n = int(s["rows"])
        wanted = sorted(r - first for r in rows if first <= r < first + n)
        if wanted:
            path = root / DATA_DIR / s["name"]
            if path.suffix == ".parquet":
                t = pq.read_table(path, columns=["id", "num_tokens"])
            else:
                with pa.memory_map(str(path)) as src:
                    t = pa.ipc.open_stream(src).read_all().select(["id", "num_tokens"])
            ids, tokens = t.column("id"), t.column("num_tokens")
            out.update((first + r, (ids[r].as_py(), int(tokens[r].as_py()))) for r in wanted)
        first += n
    return out


def build_statistics(root: Path, shards: list[dict[str, Any]], parts: list[PartStatistics], *, duplicates: str,
                     skipped: int, hidden: int) -> dict[str, Any]:
    """The ``statistics`` of ``hs_dataset.json`` from the parts' statistics (see the module docstring).

    Args:
        root: the build directory (the ids of flagged and duplicate rows are read from its shards).
        shards: its shards, in order (``hs_dataset.json``'s ``shards``).
        parts: every part's statistics, in part order.
        duplicates: the build's ``duplicates`` policy; skipped: the rejects of stage ``duplicate``.
        hidden: the states' width.
    """
    total = merge_parts(parts)
    index = DuplicateIndex()
    for r, digests in enumerate(zip(total.ids_digests, total.row_digests)):
        index.add(r, "", digests, 0)
    listed = index.found[:LISTED]
    named = row_ids(root, shards, {d.row for d in index.found} | {d.first_row for d in listed})
    return {
        "rows": total.rows, "tokens": total.tokens, "masked_tokens": total.masked_tokens,
        "mask_fraction": total.masked_tokens / total.tokens if total.tokens else 0.0,
        "lengths": {"bin": total.length_bin, "counts": total.length_counts, "min": total.min_tokens,
                    "max": total.max_tokens},
        "columns": {c: s.to_dict() for c, s in total.columns.items()},
        "fp8_limit": "values at the float8 e4m3 limit 448: fp8 storage, the stored codes at +-448 (a healthy "
                     f"token has one or a few; a row is flagged above {saturation_limit(hidden):.1%}); bf16 "
                     "storage, the values of magnitude >= 448 (what an unscaled cast to fp8 would saturate)",
        "flags": total.flags[:LISTED], "flagged": len(total.flags),
        "duplicates": {
            "policy": duplicates, "same_ids": index.same_ids, "same_ids_and_mask": index.same_rows,
            "tokens": sum(named[d.row][1] for d in index.found), "skipped": skipped, "skip_stage": DUPLICATE_STAGE,
            "rows": [{"row": d.row, "id": named[d.row][0], "first_row": d.first_row, "first_id": named[d.first_row][0],
                      "same_mask": d.same_mask} for d in listed],
        },
    }


def compare_statistics(recorded: dict[str, Any], recount: dict[str, Any]) -> list[str]:
    """Where a recount of the stored rows differs from the recorded ``statistics`` (empty: it does not).
    Counts must be equal, sums and the largest magnitude within :data:`REL_TOLERANCE` of their scale."""
    out = []
    for key in ("rows", "tokens", "masked_tokens"):
        if recorded.get(key) != recount.get(key):
            out.append(f"{key}: {recount.get(key)} stored, {recorded.get(key)} recorded")
    if recorded.get("lengths", {}).get("counts") != recount["lengths"]["counts"]:
        out.append("the length histogram differs")
    cols = recorded.get("columns") or {}
    for c, now in recount["columns"].items():
        was = cols.get(c)
        if was is None:
            out.append(f"{c}: not recorded")
            continue
        diff = [k for k in ("values", "nan", "inf", "fp8_limit") if int(was[k]) != int(now[k])]
        scale = {"sum": math.sqrt(float(was["values"]) * max(float(was["sumsq"]), 0.0))}
        diff += [k for k in ("sum", "sumsq", "absmax") if not _close(float(was[k]), float(now[k]), scale.get(k))]
        if diff:
            out.append(f"{c}: " + ", ".join(f"{k} {now[k]:.6g} stored, {was[k]:.6g} recorded" for k in diff))
    return out


def _close(a: float, b: float, scale: float | None = None) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= REL_TOLERANCE * max(abs(a), abs(b), scale or 0.0, 1e-30)

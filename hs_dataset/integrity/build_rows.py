"""A finished build's rows as stored, shard by shard, in the order ``load_dataset`` gives them (shard names sorted).

Both the teacher statistics and derived versions read rows this way: one record batch at a time (memory-mapped
Arrow IPC streams, or Parquet row groups), each row's bytes untouched.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hs_dataset.errors import NotABuildError
from hs_dataset.layout import DATA_DIR, META_FILE

__all__ = ["Batch", "build_meta", "iter_batches", "plain_columns", "shard_names"]


@dataclass
class Batch:
    """A record batch of shard ``shard``; its first row is row ``start`` of the whole version."""

    shard: str
    start: int
    batch: pa.RecordBatch


def build_meta(root: Path) -> dict[str, Any]:
    """``root``'s ``hs_dataset.json``.

    Raises:
        NotABuildError: there is none (not a finished build).
    """
    path = root / META_FILE
    if not path.is_file():
        raise NotABuildError(f"{root}: no {META_FILE}, not a finished build (build it, or download the version first)")
    return json.loads(path.read_text(encoding="utf-8"))


def shard_names(meta: dict[str, Any]) -> list[str]:
    """The recorded shards' names, in row order."""
    return sorted(str(f["name"]) for f in meta.get("shards") or [])


def iter_batches(root: Path, meta: dict[str, Any] | None = None) -> Iterator[Batch]:
    """Every record batch of ``root``'s shards, in row order (Parquet: one row group at a time)."""
    meta = meta if meta is not None else build_meta(root)
    start = 0
    for name in shard_names(meta):
        path = root / DATA_DIR / name
        if path.suffix == ".parquet":
            pf = pq.ParquetFile(str(path))
            for g in range(pf.num_row_groups):
                for b in pf.read_row_group(g).to_batches():
                    yield Batch(name, start, b)
                    start += b.num_rows
            continue
        with pa.memory_map(str(path)) as src:
            for b in pa.ipc.open_stream(src):
                yield Batch(name, start, b)
                start += b.num_rows


def plain_columns(root: Path, meta: dict[str, Any] | None = None) -> pa.Table:
    """A version's ``row`` index, ``id``, ``num_tokens`` and ``tag_*`` columns (no states read)."""
    parts = []
    for b in iter_batches(root, meta):
        keep = [c for c in b.batch.schema.names if c in ("id", "num_tokens") or c.startswith("tag_")]
        t = pa.Table.from_batches([b.batch.select(keep)])
        parts.append(t.append_column("row", pa.array(np.arange(b.start, b.start + b.batch.num_rows), pa.int64())))
    return pa.concat_tables(parts)

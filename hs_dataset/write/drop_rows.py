"""Take a rejected sample's rows back out of a part before it is committed.

A long sample is written row by row as its pieces arrive (:mod:`hs_dataset.capture.sglang.ring_client`);
when a later piece turns out bad (NaN/Inf with ``on_nonfinite=reject``, or the engine refuses the
request half-way), its first rows are already in the part's staging shards. Before the part is
committed, :func:`drop_rows` rewrites those shards without every row of such samples, so that no
partial sample is ever served, and :func:`recount` counts the part's statistics again from what is left
(the build counted the dropped rows as they were written). Rare, and local to one part: the shards are
read batch by batch and written again beside themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hs_dataset.atomic import tmp_path
from hs_dataset.integrity.scan import iter_shard_rows
from hs_dataset.integrity.stats import LENGTH_BINS, PartStatistics, StatsCollector

__all__ = ["drop_rows", "recount"]


def _keep(batch: pa.RecordBatch, ids: pa.Array) -> pa.RecordBatch:
    return batch.filter(pc.invert(pc.is_in(batch.column("id"), value_set=ids)))


def drop_rows(path: str | os.PathLike, sample_ids: set[str]) -> int:
    """Rewrite the shard at ``path`` (``.arrow`` stream or ``.parquet``) without the rows whose ``id`` is
    in ``sample_ids``; returns how many rows it dropped (0: the file is left as it is)."""
    path = Path(path)
    ids = pa.array(sorted(sample_ids), pa.string())
    tmp = tmp_path(path)
    dropped = 0
    if path.suffix == ".parquet":
        f = pq.ParquetFile(path)
        hit = any(pc.any(pc.is_in(b.column("id"), value_set=ids)).as_py() for b in f.iter_batches(columns=["id"]))
        if not hit:
            return 0
        with pq.ParquetWriter(tmp, f.schema_arrow) as w:
            for b in f.iter_batches():
                kept = _keep(b, ids)
                dropped += b.num_rows - kept.num_rows
                if kept.num_rows:
                    w.write_batch(kept)
    else:
        with pa.memory_map(str(path)) as src:
            reader = pa.ipc.open_stream(src)
            if not any(pc.any(pc.is_in(b.column("id"), value_set=ids)).as_py() for b in reader):
                return 0
        with pa.memory_map(str(path)) as src, pa.OSFile(str(tmp), "wb") as sink:
            reader = pa.ipc.open_stream(src)
            with pa.ipc.new_stream(sink, reader.schema) as w:
                for b in reader:
                    kept = _keep(b, ids)
                    dropped += b.num_rows - kept.num_rows
                    if kept.num_rows:
                        w.write_batch(kept)
    os.replace(tmp, path)
    return dropped


def recount(shards: list[str], columns: list[str], counted: dict) -> dict:
    """A part's statistics (``PartStatistics.to_dict``) counted again from its ``shards``, in order, with the
    bins of ``counted`` (what the build recorded before rows were dropped): what ``verify --stats`` recounts."""
    before = PartStatistics.from_dict(counted)
    collector: StatsCollector | None = None
    for shard in shards:
        for row in iter_shard_rows(Path(shard)):
            if collector is None:  # the states' width, for the fp8 saturation limit
                collector = StatsCollector(columns, int(row[columns[0]].shape[-1]), before.length_bin * LENGTH_BINS,
                                           workers=0)
            collector.add(row)
    if collector is None:  # every row was dropped
        return PartStatistics({c: type(s)() for c, s in before.columns.items()}, length_bin=before.length_bin,
                              length_counts=[0] * LENGTH_BINS).to_dict()
    return collector.result().to_dict()

"""``hs-dataset verify DIR --stats``: the statistics recounted from every stored row, checked against the
recorded ones, and every row that looks wrong named by its sample id.

Checksums prove the bytes are the ones written; this pass looks at what they hold. It reads every row
of every shard (one pass, a row at a time, the states through the same :func:`~hs_dataset.integrity.stats.column_stats`
the build ran) and reports, each as the fields of a :class:`~hs_dataset.integrity.verify.Problem` naming the shard,
the row, the sample id and the part to rebuild:

* a row whose token ids, loss mask, ``num_tokens`` and state rows do not all have the same length;
* a row with NaN or Inf values, or an fp8 column with more of its values at the e4m3 limit than a
  healthy row has (:func:`~hs_dataset.integrity.stats.saturation_limit`: clamped values);
* a row that repeats an earlier row's token ids where the build recorded no such duplicate;
* and, naming ``hs_dataset.json``, any recounted total (rows, tokens, mask, lengths, each column's
  sums, largest magnitude, NaN/Inf and fp8-limit counts) that differs from the recorded ``statistics``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hs_dataset.codec.rows import list_slice, state_slice
from hs_dataset.integrity.stats import PartStatistics, StatsCollector
from hs_dataset.integrity.summary import LISTED, build_statistics, compare_statistics, merge_parts
from hs_dataset.layout import DATA_DIR, DUPLICATE_STAGE, MESSAGES_COLUMN, META_FILE, SHARD_RE, scale_column, state_columns
from hs_dataset.prepare.duplicates import DuplicateIndex

__all__ = ["Found", "ScanReport", "iter_shard_rows", "raw_row", "scan_build"]

Found = tuple[str, str, "int | None"]  # (file, what is wrong, the part to rebuild): a verify Problem's fields


def _array2d(col: pa.Array, i: int) -> np.ndarray:
    """Row ``i`` of an ``Array2D((None, H))`` array as a read-only numpy view ``[T, H]``."""
    flat, width = state_slice(col, i)
    values = flat.to_numpy(zero_copy_only=True)
    return values.reshape(len(values) // width if width else 0, width)


def raw_row(batch: pa.RecordBatch, i: int) -> dict[str, Any]:
    """Row ``i`` of a shard's record batch as stored: ``id``, ``num_tokens``, ``input_ids``/``loss_mask`` and
    every state's bits (``[T, H]`` uint16 for bf16, uint8 fp8 codes with ``<column>_scale``), read-only views."""
    row: dict[str, Any] = {"id": batch.column("id")[i].as_py(), "num_tokens": int(batch.column("num_tokens")[i].as_py())}
    if MESSAGES_COLUMN in batch.schema.names:  # a regenerate build's conversation: what verify --probe retokenizes
        row[MESSAGES_COLUMN] = batch.column(MESSAGES_COLUMN)[i].as_py()
    for name in batch.schema.names:
        col = batch.column(name)
        if isinstance(col, pa.ExtensionArray) or pa.types.is_list(col.type) and pa.types.is_list(col.type.value_type):
            row[name] = _array2d(col, i)
        elif pa.types.is_list(col.type):
            row[name] = list_slice(col, i).to_numpy(zero_copy_only=True)
    return row


def iter_shard_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Every row of one shard (Arrow IPC stream, memory-mapped; or Parquet), as :func:`raw_row` gives it."""
    if path.suffix == ".parquet":
        for batch in pq.ParquetFile(str(path)).iter_batches(batch_size=1):
            yield from (raw_row(batch, i) for i in range(batch.num_rows))
        return
    with pa.memory_map(str(path)) as src:
        for batch in pa.ipc.open_stream(src):
            yield from (raw_row(batch, i) for i in range(batch.num_rows))


@dataclass
class ScanReport:
    """The recount (``statistics``, as ``hs_dataset.json`` records them) and the problems it found."""

    statistics: dict[str, Any] | None
    problems: list[Found] = field(default_factory=list)
    seconds: float = 0.0


def _shape_problem(row: dict[str, Any], columns: list[str]) -> str | None:
    n = row["num_tokens"]
    sizes = {"input_ids": len(row["input_ids"]), "loss_mask": len(row["loss_mask"])}
    sizes.update((c, row[c].shape[0]) for c in columns)
    sizes.update((scale_column(c), len(row[scale_column(c)])) for c in columns if scale_column(c) in row)
    wrong = {k: v for k, v in sizes.items() if v != n}
    if not wrong:
        return None
    return f"num_tokens is {n} but " + ", ".join(f"{k} has {v}" for k, v in wrong.items()) + " (cut short or mixed up)"


def scan_build(root: Path, meta: dict[str, Any]) -> ScanReport:
    """Recount a finished build's statistics from its stored rows and name the rows that look wrong.

    Args:
        root: the build directory (its shards pass the checksum checks already: see
            :func:`hs_dataset.integrity.verify.verify_build`).
        meta: its ``hs_dataset.json``.
    """
    t0 = time.time()
    columns = list(meta.get("columns") or state_columns(meta["layers"]))  # store_final=false: no hidden_final
    hidden, max_length = int(meta["model"]["hidden_size"]), int(meta["max_length"])
    problems: list[Found] = []
    parts: list[PartStatistics] = []
    where: list[tuple[str, int | None]] = []  # the shard and part of every row, in order
    collector: StatsCollector | None = None
    current: int | None = None
    for s in meta["shards"]:
        m = SHARD_RE.match(s["name"])
        part = int(m.group(1)) if m else None
        if collector is None or part != current:  # the build summed each part's rows, then the parts
            if collector is not None:
                parts.append(collector.result())
            collector, current = StatsCollector(columns, hidden, max_length), part
        for row in iter_shard_rows(root / DATA_DIR / s["name"]):
            where.append((s["name"], part))
            wrong = _shape_problem(row, columns)
            if wrong:
                problems.append((f"{DATA_DIR}/{s['name']}", f"row {len(where) - 1} ({row['id']}): {wrong}", part))
                continue
            collector.add(row)
    if collector is not None:
        parts.append(collector.result())
    if problems:  # rows of the wrong shape are not counted: the totals cannot match
        return ScanReport(None, problems, time.time() - t0)
    total = merge_parts(parts)
    for f in total.flags:
        name, part = where[f["row"]]
        problems.append((f"{DATA_DIR}/{name}", f"row {f['row']} ({f['id']}): {f['column']} holds {f['what']}", part))
    recorded = meta.get("statistics")
    skipped = int((meta.get("counts") or {}).get("rejects_by_stage", {}).get(DUPLICATE_STAGE, 0))
    recount = build_statistics(root, meta["shards"], parts, duplicates=(meta.get("config") or {}).get("duplicates", "keep"),
                               skipped=skipped, hidden=hidden)
    if not recorded:
        problems.append((META_FILE, "records no statistics (built by an hs_dataset without them): the recount "
                                    "has nothing to be compared with", None))
        return ScanReport(recount, problems, time.time() - t0)
    problems += _new_duplicates(total, recorded.get("duplicates") or {}, recount, where)
    diff = compare_statistics(recorded, recount)
    if diff:
        problems.append((META_FILE, "its statistics differ from the stored rows' (" + "; ".join(diff[:4])
                         + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "") + ")", None))
    return ScanReport(recount, problems, time.time() - t0)


def _new_duplicates(total: PartStatistics, recorded: dict[str, Any], recount: dict[str, Any],
                    where: list[tuple[str, int | None]]) -> list[Found]:
    """Rows repeating an earlier row's token ids that the build did not record."""
    index = DuplicateIndex()
    for r, digests in enumerate(zip(total.ids_digests, total.row_digests)):
        index.add(r, "", digests, 0)
    known = {(d["row"], d["first_row"]) for d in recorded.get("rows") or []}
    complete = int(recorded.get("same_ids", 0)) <= LISTED
    names = {d["row"]: (d["id"], d["first_id"]) for d in recount["duplicates"]["rows"]}
    out: list[Found] = []
    for d in index.found:
        if (d.row, d.first_row) in known or not complete:
            continue
        name, part = where[d.row]
        ids = names.get(d.row, ("?", "?"))
        same = "token ids and loss mask" if d.same_mask else "token ids"
        out.append((f"{DATA_DIR}/{name}", f"row {d.row} ({ids[0]}) repeats the {same} of row {d.first_row} "
                                          f"({ids[1]}), a duplicate the build did not record", part))
    if not complete and index.same_ids != int(recorded.get("same_ids", 0)):
        out.append((META_FILE, f"records {recorded.get('same_ids')} duplicates, the stored rows hold "
                               f"{index.same_ids}", None))
    return out

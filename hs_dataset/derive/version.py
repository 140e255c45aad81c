"""Derived versions: a new version made of rows of existing ones, without capturing anything again.

:func:`derive` reads one or more finished builds (or downloaded versions), keeps the rows its query selects
(:mod:`hs_dataset.derive.query`: filters on tags and statistics, a mix by weight, a sample budget, a seed),
optionally narrows each kept row's loss mask to the flattest positions of the target's distribution, and
writes a finished build: shards, ``hs_dataset.json``, ``rejects.jsonl`` (empty) and the card, which records
the source versions (their paths and the content hash of their ``hs_dataset.json``) and the query.

The contract:

* a kept row is the source row: every column's bytes as stored (the hidden states are never decoded), in the
  source's schema; each run of consecutive kept rows of a source record batch is written as one record batch
  (the run's bytes laid out as in the source); only a narrowed row differs, in ``loss_mask`` and (a teacher
  build) the teacher columns, which hold the loss-masked positions only;
* rows keep their version's order, versions follow each other in the order given;
* ``--keep-flattest F``: per version, the positions whose entropy (:mod:`hs_dataset.integrity.teacher_stats`) is
  in the top ``F`` share of its kept rows' masked positions stay masked; a row left with none is dropped;
* the new version verifies like a build (``hs-dataset verify``). Because a kept row's bytes are the source's,
  a push of a derived version next to its sources uploads little more than the new rows' boundaries (Xet
  deduplicates content-defined chunks: ``benchmarks/xet_chunks.py``).

Arrow shards only (plain or ``compression=zstd``): Parquet shards re-encode their pages, so their rows would not
keep their bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from hs_dataset.atomic import atomic_write
from hs_dataset.derive.query import Filter, mix_counts, parse_filter, row_mask, sample_rows
from hs_dataset.integrity.build_rows import build_meta, iter_batches, plain_columns
from hs_dataset.integrity.teacher_stats import (STAT_COLUMNS, iter_position_stats, load_output_embedding,
                                             read_sample_stats, stats_source, write_stats_table)
from hs_dataset.errors import ConfigError, ForeignFilesError
from hs_dataset.integrity.checksums import shard_entry
from hs_dataset.integrity.metadata import REJECTS_HASH_KEY, rejects_digest
from hs_dataset.layout import (DATA_DIR, META_FILE, README_FILE, REJECTS_FILE, SAMPLE_STATS_FILE, TEACHER_IDS_COLUMN,
                               TEACHER_LOGPROBS_COLUMN, TEACHER_LSE_COLUMN, shard_name)
from hs_dataset.write.card import render_readme

__all__ = ["DeriveSummary", "derive"]

_TEACHER = (TEACHER_IDS_COLUMN, TEACHER_LOGPROBS_COLUMN, TEACHER_LSE_COLUMN)


@dataclass
class DeriveSummary:
    """What :func:`derive` wrote: rows per source version, positions kept by the flatness selection."""

    output: str
    rows: int
    rows_per_source: list[int]
    bytes: int
    positions_masked_before: int = 0
    positions_masked_after: int = 0
    dropped_rows: int = 0
    query: dict[str, Any] = field(default_factory=dict)


def _plain_columns(root: Path, meta: dict[str, Any], need_stats: bool) -> pa.Table:
    """A version's row index, id, num_tokens and tag columns (and its statistics, when a filter needs them)."""
    table = plain_columns(root, meta)
    if need_stats:
        stats = read_sample_stats(root, table.column("id").to_pylist())
        for c in STAT_COLUMNS:
            table = table.append_column(c, stats.column(c))
    return table


def _flat_masks(root: Path, meta: dict[str, Any], rows: np.ndarray, fraction: float,
                model: str | None) -> dict[int, np.ndarray]:
    """For each of ``rows``, the loss mask narrowed to the positions in the top ``fraction`` of entropy."""
    src = stats_source(meta)
    weight = load_output_embedding(model or meta["model"]["path"]) if src == "hidden_final" else None
    wanted = set(int(r) for r in rows)
    per_row: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for row, _, where, h, _ in iter_position_stats(root, meta, src, weight):
        if row in wanted:
            per_row[row] = (where, h)
    every = np.concatenate([h for _, h in per_row.values()]) if per_row else np.zeros(0)
    cut = float(np.quantile(every, 1.0 - fraction, method="higher")) if every.size and fraction < 1 else -np.inf
    return {row: where[h >= cut] for row, (where, h) in per_row.items()}


def _narrowed(batch: pa.RecordBatch, i: int, keep: np.ndarray) -> pa.RecordBatch:
    """Row ``i`` of ``batch`` with its loss mask cut to positions ``keep`` (and the teacher columns with it)."""
    one = batch.slice(i, 1)
    mask_col = one.column("loss_mask")
    old = np.asarray(mask_col.flatten().to_numpy(zero_copy_only=False))
    new = np.zeros_like(old)
    new[keep] = 1
    arrays = dict(zip(one.schema.names, one.columns))
    arrays["loss_mask"] = pa.ListArray.from_arrays(pa.array([0, len(new)], pa.int32()), pa.array(new, pa.uint8()),
                                                   type=mask_col.type)
    if TEACHER_LSE_COLUMN in arrays:  # the teacher's rows are the masked positions: keep those still masked
        masked = np.flatnonzero(old)
        sel = pa.array(np.flatnonzero(np.isin(masked, keep)), pa.int64())
        for c in _TEACHER:
            col = arrays[c]
            storage = col.storage if isinstance(col, pa.ExtensionArray) else col
            inner = storage.flatten().take(sel)
            rebuilt = pa.ListArray.from_arrays(pa.array([0, len(inner)], pa.int32()), inner, type=storage.type)
            arrays[c] = pa.ExtensionArray.from_storage(col.type, rebuilt) if isinstance(col, pa.ExtensionArray) \
                else rebuilt
    return pa.RecordBatch.from_arrays([arrays[n] for n in one.schema.names], schema=one.schema)


def _source_record(root: Path, meta_text: str, meta: dict[str, Any], rows: int) -> dict[str, Any]:
    return {"path": str(root), "meta_xxh3_128": xxhash.xxh3_128(meta_text.encode()).hexdigest(),
            "rows": int(meta.get("counts", {}).get("rows_written") or meta.get("counts", {}).get("written", 0)),
            "rows_kept": rows, "source": meta.get("source"), "model": (meta.get("model") or {}).get("path")}


def _check_sources(roots: list[Path], metas: list[dict[str, Any]]) -> None:
    first = metas[0]
    for root, meta in zip(roots, metas):
        fmt = (meta.get("config") or {}).get("file_format", "arrow")
        if fmt != "arrow":
            raise ConfigError(f"{root}: {fmt} shards; derive keeps rows' bytes in Arrow shards only (build with "
                              "file_format=arrow)", field="file_format", value=fmt)
        if meta.get("long_rows"):
            raise ConfigError(f"{root}: samples span several rows (long_rows); derive selects whole rows only: build "
                              "with row_tokens >= max_length", field="long_rows", value=True)
        for key in ("layers", "storage_dtype", "store_final", "teacher", "columns"):
            if meta.get(key) != first.get(key):
                raise ConfigError(f"{root}: {key} is {meta.get(key)!r}, {roots[0]} has {first.get(key)!r}; a mix needs "
                                  "versions of one layout", field=key, value=meta.get(key))
        if (meta.get("model") or {}).get("hidden_size") != (first.get("model") or {}).get("hidden_size"):
            raise ConfigError(f"{root}: another hidden size than {roots[0]}; a mix needs one model's states")


def derive(sources: list[str | Path], output: str | Path, *, where: list[str] | None = None,
           weights: list[float] | None = None, budget: int | None = None, keep_flattest: float | None = None,
           seed: int = 0, model: str | None = None, command: str | None = None) -> DeriveSummary:
    """Write a derived version of ``sources`` to ``output`` (module docstring).

    Args:
        sources: finished builds or downloaded versions (folders with ``hs_dataset.json``), one layout.
        output: a new folder (absent or empty).
        where: filters, all of which a row passes (:func:`~hs_dataset.derive.query.parse_filter`).
        weights: *optional*, each version's share of the rows (default: equal shares when ``budget`` is set,
            else every row that passes).
        budget: *optional*, the number of rows to draw in all.
        keep_flattest: *optional*, the share (0, 1] of masked positions to keep masked, the flattest.
        seed: which rows a budget or mix draws.
        model: the model directory whose ``lm_head`` gives the entropy from ``hidden_final`` (default: recorded).
        command: the command line recorded in ``hs_dataset.json``.

    Raises:
        ConfigError: a bad filter, weight or share; sources of different layouts; Parquet or long-row sources.
        ForeignFilesError: ``output`` holds files already.
        NotABuildError: a source is not a finished build.
    """
    roots = [Path(s) for s in sources]
    if not roots:
        raise ConfigError("derive needs at least one source version")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise ForeignFilesError(f"{out} is not empty: derive writes a new version into an empty or new folder (pick "
                                "another --output, or remove the unfinished one a failed derive left there)")
    if keep_flattest is not None and not 0 < keep_flattest <= 1:
        raise ConfigError(f"keep_flattest={keep_flattest}: a share of positions in (0, 1]", field="keep_flattest",
                          value=keep_flattest)
    texts = [(r / META_FILE).read_text(encoding="utf-8") if (r / META_FILE).is_file() else "" for r in roots]
    metas = [build_meta(r) for r in roots]
    _check_sources(roots, metas)
    filters: list[Filter] = [parse_filter(w) for w in where or []]
    need_stats = any(f.column.startswith("stat_") for f in filters)
    candidates = []
    for r, m in zip(roots, metas):
        table = _plain_columns(r, m, need_stats)
        candidates.append(np.flatnonzero(row_mask(table, filters, str(r))))
    mix = weights if weights is not None else [1.0] * len(roots)
    counts = mix_counts([len(c) for c in candidates], mix, budget) if (weights is not None or budget is not None) \
        else [len(c) for c in candidates]
    chosen = [sample_rows(c, n, seed + i) for i, (c, n) in enumerate(zip(candidates, counts))]
    query = {"where": [str(f) for f in filters], "weights": weights, "budget": budget, "keep_flattest": keep_flattest,
             "seed": seed}
    summary = DeriveSummary(str(out), 0, [], 0, query=query)
    (out / DATA_DIR).mkdir(parents=True, exist_ok=True)
    files, rows_per_source, tokens = _write_rows(roots, metas, chosen, out, keep_flattest, model, summary)
    summary.rows, summary.rows_per_source = sum(rows_per_source), rows_per_source
    summary.bytes = sum(f["bytes"] for f in files)
    if not summary.rows:
        raise ConfigError(f"the query keeps no row of {', '.join(map(str, roots))}: {query}")
    meta = dict(metas[0])
    for stale in ("probe", "statistics"):  # the source's recount and probe are not this version's
        meta.pop(stale, None)
    meta.update(counts={"samples_in": summary.rows, "written": summary.rows, "rejected": 0, "tokens_written": tokens,
                        "rejects_by_stage": {}, "rows_written": summary.rows},
                bytes=summary.bytes, files=len(files), build_command=command, **{REJECTS_HASH_KEY: rejects_digest("")},
                derived={"sources": [_source_record(r, t, m, n) for r, t, m, n in zip(roots, texts, metas,
                                                                                       rows_per_source)],
                         "query": query}, shards=files)
    atomic_write(out / REJECTS_FILE, "")
    if keep_flattest is None and all((r / SAMPLE_STATS_FILE).is_file() for r in roots):
        _keep_stats(roots, chosen, out, meta)
    text = json.dumps(meta, indent=1)
    atomic_write(out / README_FILE, render_readme(meta, str(out)) + _card_section(meta["derived"]))
    atomic_write(out / META_FILE, text)  # last: a finished version
    return summary


def _write_rows(roots: list[Path], metas: list[dict[str, Any]], chosen: list[np.ndarray], out: Path,
                keep_flattest: float | None, model: str | None,
                summary: DeriveSummary) -> tuple[list[dict[str, Any]], list[int], int]:
    """The chosen rows into ``out/data`` shards of at most the first source's ``max_shard_bytes``."""
    limit = int((metas[0].get("config") or {}).get("max_shard_bytes", 512 * 2**20))
    compression = "zstd" if (metas[0].get("config") or {}).get("compression") == "zstd" else None
    options = pa.ipc.IpcWriteOptions(compression=compression)
    files: list[dict[str, Any]] = []
    state: dict[str, Any] = {"writer": None, "sink": None, "bytes": 0, "rows": 0}
    written, tokens = [], 0

    def close() -> None:
        if state["writer"] is not None:
            state["writer"].close()
            state["sink"].close()
            files.append(shard_entry(state["path"], rows=state["rows"]))
            state.update(writer=None, sink=None, bytes=0, rows=0)

    for root, meta, rows in zip(roots, metas, chosen):
        masks = _flat_masks(root, meta, rows, keep_flattest, model) if keep_flattest is not None else None
        wanted, n = set(int(r) for r in rows), 0
        for b in iter_batches(root, meta):
            for one in _pieces(b.batch, b.start, wanted, masks, summary):
                if state["writer"] is None:
                    state["path"] = out / DATA_DIR / shard_name(len(files), 0, "arrow")
                    state["sink"] = pa.OSFile(str(state["path"]), "wb")
                    state["writer"] = pa.ipc.new_stream(state["sink"], one.schema, options=options)
                state["writer"].write_batch(one)
                state["bytes"] += one.nbytes
                state["rows"] += one.num_rows
                tokens += int(np.sum(one.column("num_tokens").to_numpy(zero_copy_only=False)))
                n += one.num_rows
                if state["bytes"] >= limit:
                    close()
        written.append(n)
    close()
    return files, written, tokens


def _keep_stats(roots: list[Path], chosen: list[np.ndarray], out: Path, meta: dict[str, Any]) -> None:
    """The kept rows' statistics (their states and masks are the sources'), as ``out``'s ``sample_stats.parquet``."""
    parts, kinds = [], set()
    for root, rows in zip(roots, chosen):
        kinds.add(json.loads((pq.read_schema(str(root / SAMPLE_STATS_FILE)).metadata or {}).get(
            b"hs_dataset", b"{}")).get("source", "?"))
        parts.append(read_sample_stats(root).take(pa.array(rows, pa.int64())))
    table = pa.concat_tables(parts)
    ids = plain_columns(out, meta).column("id").to_pylist()
    if table.column("id").to_pylist() != ids:  # a stale source file: leave it to `verify --stats`
        return
    table = table.set_column(0, "row", pa.array(np.arange(table.num_rows), pa.int64()))
    write_stats_table(out, table, kinds.pop() if len(kinds) == 1 else "mixed")


def _pieces(batch: pa.RecordBatch, start: int, wanted: set[int], masks: dict[int, np.ndarray] | None,
            summary: DeriveSummary) -> Iterator[pa.RecordBatch]:
    """The kept rows of ``batch`` (its first row is row ``start``) as record batches: each run of consecutive kept
    rows as one slice, in the source's own layout (a column's values of the run side by side, as stored); a row
    whose mask is narrowed alone."""
    rows = [i for i in range(batch.num_rows) if start + i in wanted]
    if masks is None:
        while rows:
            run = 1
            while run < len(rows) and rows[run] == rows[0] + run:
                run += 1
            yield batch.slice(rows[0], run)
            rows = rows[run:]
        return
    for i in rows:
        keep = masks.get(start + i, np.zeros(0, np.int64))
        summary.positions_masked_before += int(np.count_nonzero(
            batch.slice(i, 1).column("loss_mask").flatten().to_numpy(zero_copy_only=False)))
        if not keep.size:
            summary.dropped_rows += 1
            continue
        summary.positions_masked_after += int(keep.size)
        yield _narrowed(batch, i, keep)


def _card_section(derived: dict[str, Any]) -> str:
    lines = ["", "## Derived version", "",
             "Rows of the versions below, their bytes as stored (`hs-dataset derive`); the query:", "",
             "```json", json.dumps(derived["query"], indent=1), "```", "", "| source | hs_dataset.json xxh3-128 | rows | kept |",
             "|---|---|---|---|"]
    lines += [f"| `{s['path']}` | `{s['meta_xxh3_128']}` | {s['rows']} | {s['rows_kept']} |" for s in derived["sources"]]
    return "\n".join(lines) + "\n"

"""Source stage, reading: raw rows from files or ``datasets`` datasets, never failing on one bad row.

:func:`iter_source` yields one :class:`~hs_dataset.records.SourceRow` per input row, without any
validation. A JSONL line that is not valid UTF-8 or not valid JSON still yields a row whose
``data`` is a :class:`BadRow`, so that samples in = written + rejected holds. Validation is the
next step, :func:`hs_dataset.prepare.conversations.parse_row`.

Supported sources:

* ``path/to/file.jsonl`` -- one JSON object per line, streamed line by line (bounded memory);
* ``path/to/file.json`` -- a list of rows, or ``{"data": [rows]}``;
* ``path/to/file.parquet`` -- streamed by row group (a damaged file stops the build with a
  ConfigError naming it; its rows are not rejects);
* ``path/to/dir`` -- a dataset saved with ``datasets.Dataset.save_to_disk`` (a saved
  ``DatasetDict`` needs ``path/to/dir:split`` unless it has one split or a ``train`` split);
* ``hf:<path_or_name>[:split]`` -- anything ``datasets.load_dataset`` can load (default split:
  ``train``, or the only split).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hs_dataset.errors import ConfigError
from hs_dataset.prepare.source_spec import (SourceSpec, dataset_name, load_json_rows, load_source_dataset, open_parquet,
                                            parquet_error, resolve_source)
from hs_dataset.records import SourceRow

__all__ = ["BadRow", "iter_source"]

_HASH_CHARS = 16
_CHUNK = 1 << 20


@dataclass(frozen=True)
class BadRow:
    """Placeholder ``SourceRow.data`` for a row that could not even be decoded.

    :func:`hs_dataset.prepare.conversations.parse_row` turns it into ``SampleError(field, reason)``.
    """

    reason: str
    field: str = "row"


# --------------------------------------------------------------------------------------------
# Source resolution
# --------------------------------------------------------------------------------------------
















# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": bytes(obj).hex()}
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return repr(obj)


def _row_hash(data: Any, raw: bytes | None = None) -> str:
    """First 16 hex digits of the sha256 of the canonical JSON of a row (or of its raw bytes)."""
    if raw is None:
        try:
            canonical = json.dumps(
                data, sort_keys=True, ensure_ascii=True, separators=(",", ":"), default=_json_default
            )
        except (TypeError, ValueError, RecursionError):  # e.g. mixed-type keys with sort_keys
            canonical = repr(data)
        raw = canonical.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:_HASH_CHARS]


def _make_row(name: str, index: int, data: Any, sample_id: str, raw: bytes | None = None) -> SourceRow:
    if sample_id == "row":
        sid = f"{name}:{index}"
    else:
        sid = _row_hash(data, raw)
    return SourceRow(sample_id=sid, index=index, data=data)


def _decode_jsonl_line(line: bytes, lineno: int) -> Any:
    """Decode one JSONL line; never raises (a problem gives a :class:`BadRow`)."""
    stripped = line.rstrip(b"\r\n")
    try:
        text = stripped.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow(
            f"line {lineno} is not valid UTF-8 (byte 0x{stripped[e.start]:02x} at byte offset "
            f"{e.start}); re-encode the file as UTF-8 or remove the line"
        )
    if text.startswith("\ufeff") and lineno == 1:
        text = text[1:]  # UTF-8 byte order mark
    if not text.strip():
        return BadRow(f"line {lineno} is blank; remove blank lines from the file")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        detail = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        return BadRow(f"line {lineno} is not valid JSON ({detail}{where}); fix or remove the line")


def _iter_jsonl(spec: SourceSpec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    with open(spec.path, "rb") as f:
        for index, line in enumerate(f):
            if stop is not None and index >= stop:
                return
            if index < start:
                continue
            data = _decode_jsonl_line(line, index + 1)
            raw = line.rstrip(b"\r\n") if isinstance(data, BadRow) else None
            yield _make_row(spec.name, index, data, sample_id, raw)




def _iter_parquet(spec: SourceSpec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    return _parquet_rows(spec, open_parquet(spec.path), start, stop, sample_id)  # a damaged footer fails here


def _parquet_rows(spec: SourceSpec, pf: pq.ParquetFile, start: int, stop: int | None,
                  sample_id: str) -> Iterator[SourceRow]:
    offset = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        rg_start, rg_stop = offset, offset + n
        offset = rg_stop
        if rg_stop <= start:
            continue
        if stop is not None and rg_start >= stop:
            return
        try:
            table = pf.read_row_group(rg)
        except (pa.ArrowException, OSError) as e:  # a damaged page: ArrowInvalid, OSError (thrift, levels)
            raise parquet_error(spec.path, f"its row group {rg} (rows {rg_start}-{rg_stop - 1}) cannot be read", e) from e
        for batch in table.to_batches(max_chunksize=1024):
            for row in batch.to_pylist():
                index = rg_start
                rg_start += 1
                if index < start:
                    continue
                if stop is not None and index >= stop:
                    return
                yield _make_row(spec.name, index, row, sample_id)


def _iter_dataset(spec: SourceSpec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    ds, split = load_source_dataset(spec)
    n = len(ds)
    end = n if stop is None else min(stop, n)
    if start >= end:
        return
    name = dataset_name(spec, split)
    ds = ds.with_format(None)
    batch_size = 256
    for b0 in range(start, end, batch_size):
        b1 = min(b0 + batch_size, end)
        batch = ds[b0:b1]
        columns = list(batch.keys())
        for k in range(b1 - b0):
            row = {c: batch[c][k] for c in columns}
            yield _make_row(name, b0 + k, row, sample_id)


def iter_source(
    source: str | os.PathLike[str],
    *,
    start: int = 0,
    stop: int | None = None,
    sample_id: str = "row",
) -> Iterator[SourceRow]:
    """Yield the rows with index in ``[start, stop)`` of ``source``, unvalidated, one per row.

    ``sample_id="row"`` gives ids ``"<source name>:<row index>"``; ``"hash"`` gives the first 16
    hex digits of the sha256 of the row's canonical JSON (identical rows share an id). A JSONL
    line that cannot be decoded yields a row whose ``data`` is a :class:`BadRow`.

    Raises:
        ConfigError: a bad ``sample_id``/range, a missing or unsupported source; a damaged Parquet
            file (its footer: at the call; a row group: when the rows reach it), as one line naming it.
    """
    if sample_id not in ("row", "hash"):
        raise ConfigError(f"sample_id must be 'row' or 'hash', got {sample_id!r}")
    if start < 0 or (stop is not None and stop < 0):
        raise ConfigError(f"start/stop must be >= 0, got start={start}, stop={stop}")
    spec = resolve_source(source)  # a missing or unsupported source fails here, not at the first next()
    if spec.kind == "jsonl":
        return _iter_jsonl(spec, start, stop, sample_id)
    if spec.kind == "json":
        return _iter_json(spec, start, stop, sample_id)
    if spec.kind == "parquet":
        return _iter_parquet(spec, start, stop, sample_id)
    return _iter_dataset(spec, start, stop, sample_id)


def _iter_json(spec: SourceSpec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    rows = load_json_rows(spec.path)
    end = len(rows) if stop is None else min(stop, len(rows))
    for index in range(start, end):
        yield _make_row(spec.name, index, rows[index], sample_id)







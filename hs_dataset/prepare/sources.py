"""Source stage, reading: raw rows from files or ``datasets`` datasets, never failing on one bad row.

:func:`read_rows` yields one :class:`~hs_dataset.records.SourceRow` per input row, without any
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

from hs_dataset.errors import ConfigError
from hs_dataset.prepare.source_spec import LINES_PER_OFFSET, Source, resolve_source
from hs_dataset.records import SourceRow

__all__ = ["BadRow", "iter_source", "read_rows"]

_HASH_CHARS = 16


@dataclass(frozen=True)
class BadRow:
    """Placeholder ``SourceRow.data`` for a row that could not even be decoded.

    :func:`hs_dataset.prepare.conversations.parse_row` turns it into ``SampleError(field, reason)``.
    """

    reason: str
    field: str = "row"


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


def read_rows(source: Source, ranges: list[tuple[int, int | None]], *, sample_id: str = "row") -> Iterator[SourceRow]:
    """Yield the rows of ``source`` in each ``[start, stop)`` of ``ranges`` (``stop`` None: to the end), unvalidated,
    one per row, in one pass: the file is opened once, and each range starts from a seek where the format can
    (Parquet: its row groups; JSONL: the line offsets its first read recorded), never from the first row.

    ``sample_id="row"`` gives ids ``"<source name>:<row index>"``; ``"hash"`` gives the first 16 hex digits of
    the sha256 of the row's canonical JSON (identical rows share an id). A JSONL line that cannot be decoded
    yields a row whose ``data`` is a :class:`BadRow`.

    Raises:
        ConfigError: a bad ``sample_id`` or range; a damaged Parquet file (its footer: at the call; a row group:
            when the rows reach it), as one line naming it.
    """
    if sample_id not in ("row", "hash"):
        raise ConfigError(f"sample_id must be 'row' or 'hash', got {sample_id!r}")
    for start, stop in ranges:
        if start < 0 or (stop is not None and stop < 0):
            raise ConfigError(f"start/stop must be >= 0, got start={start}, stop={stop}")
    if source.kind == "parquet":
        source.parquet  # a damaged footer fails here, not at the first row
        return _parquet_rows(source, ranges, sample_id)
    return {"jsonl": _jsonl_rows, "json": _json_rows}.get(source.kind, _dataset_rows)(source, ranges, sample_id)


def iter_source(source: Source | str | os.PathLike[str], *, start: int = 0, stop: int | None = None,
                sample_id: str = "row") -> Iterator[SourceRow]:
    """The rows with index in ``[start, stop)`` of ``source`` (:func:`read_rows` of one range).

    Raises:
        ConfigError: as :func:`read_rows`; a missing or unsupported source (at the call, not at the first row).
    """
    resolved = source if isinstance(source, Source) else resolve_source(source)
    return read_rows(resolved, [(start, stop)], sample_id=sample_id)


def _jsonl_rows(source: Source, ranges: list[tuple[int, int | None]], sample_id: str) -> Iterator[SourceRow]:
    name = source.name
    with open(source.path, "rb") as f:
        at = 0  # the index of the line f is at
        for start, stop in ranges:
            if start < at or start - at > LINES_PER_OFFSET:
                offset, at = source.line_offset(start)
                f.seek(offset)
            while at < start and f.readline():
                at += 1
            while stop is None or at < stop:
                line = f.readline()
                if not line:
                    break
                data = _decode_jsonl_line(line, at + 1)
                raw = line.rstrip(b"\r\n") if isinstance(data, BadRow) else None
                yield _make_row(name, at, data, sample_id, raw)
                at += 1


def _parquet_rows(source: Source, ranges: list[tuple[int, int | None]], sample_id: str) -> Iterator[SourceRow]:
    bounds, name = source.row_groups, source.name
    for start, stop in ranges:
        end = int(bounds[-1]) if stop is None else min(stop, int(bounds[-1]))
        for rg in range(max(int(np.searchsorted(bounds, start, side="right")) - 1, 0), len(bounds) - 1):
            first = int(bounds[rg])
            if first >= end:
                break
            lo, hi = max(start, first), min(end, int(bounds[rg + 1]))
            index = lo
            for batch in source.row_group(rg).slice(lo - first, hi - lo).to_batches(max_chunksize=1024):
                for row in batch.to_pylist():
                    yield _make_row(name, index, row, sample_id)
                    index += 1


def _json_rows(source: Source, ranges: list[tuple[int, int | None]], sample_id: str) -> Iterator[SourceRow]:
    rows, name = source.json_rows, source.name
    for start, stop in ranges:
        for index in range(start, len(rows) if stop is None else min(stop, len(rows))):
            yield _make_row(name, index, rows[index], sample_id)


def _dataset_rows(source: Source, ranges: list[tuple[int, int | None]], sample_id: str) -> Iterator[SourceRow]:
    ds = source.dataset[0].with_format(None)
    name = source.name
    for start, stop in ranges:
        end = len(ds) if stop is None else min(stop, len(ds))
        for b0 in range(start, end, 256):
            batch = ds[b0:min(b0 + 256, end)]
            columns = list(batch.keys())
            for k in range(min(b0 + 256, end) - b0):
                yield _make_row(name, b0 + k, {c: batch[c][k] for c in columns}, sample_id)

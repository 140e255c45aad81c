"""Source stage, reading: raw rows from files or ``datasets`` datasets, never failing on one bad row.

:func:`iter_source` yields one :class:`~hs_dataset.records.SourceRow` per input row, without any
validation. A JSONL line that is not valid UTF-8 or not valid JSON still yields a row whose
``data`` is a :class:`BadRow`, so that samples in = written + rejected holds. Validation is the
next step, :func:`hs_dataset.conversations.parse_row`.

Supported sources:

* ``path/to/file.jsonl`` -- one JSON object per line, streamed line by line (bounded memory);
* ``path/to/file.json`` -- a list of rows, or ``{"data": [rows]}``;
* ``path/to/file.parquet`` -- streamed by row group;
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
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError, MissingPathError
from .layout import utf8_safe
from .records import SourceRow

__all__ = [
    "BadRow",
    "count_rows",
    "rows_to_build",
    "iter_source",
    "source_fingerprint",
    "source_name",
    "source_path",
]

_HASH_CHARS = 16
_CHUNK = 1 << 20


@dataclass(frozen=True)
class BadRow:
    """Placeholder ``SourceRow.data`` for a row that could not even be decoded.

    :func:`hs_dataset.conversations.parse_row` turns it into ``SampleError(field, reason)``.
    """

    reason: str
    field: str = "row"


# --------------------------------------------------------------------------------------------
# Source resolution
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    kind: str  # "jsonl" | "json" | "parquet" | "disk" | "hf"
    path: str
    split: str | None
    name: str  # valid UTF-8: a file name's undecodable bytes are escaped (layout.utf8_safe)


def _resolve(source: str | os.PathLike[str]) -> _Spec:
    text = os.fspath(source)
    if text.startswith("hf:"):
        rest = text[3:]
        path, _, split = rest.partition(":")
        if not path:
            raise ConfigError(f"source {text!r}: expected 'hf:<path_or_name>[:split]'")
        name = Path(path.rstrip("/")).name or path
        return _Spec("hf", path, split or None, utf8_safe(name))
    p = Path(text)
    if not p.exists():
        # "dir:split" for a DatasetDict saved to disk.
        head, sep, split = text.rpartition(":")
        if sep and head and Path(head).is_dir():
            return _Spec("disk", head, split or None, utf8_safe(Path(head).name))
        raise MissingPathError(
            f"source {text!r} does not exist; give a .jsonl/.json/.parquet file, a directory saved "
            "with datasets' save_to_disk (optionally 'dir:split'), or 'hf:<path_or_name>[:split]'"
        )
    if p.is_dir():
        return _Spec("disk", text, None, utf8_safe(p.name))
    suffix = p.suffix.lower()
    kinds = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
    if suffix not in kinds:
        raise ConfigError(
            f"source {text!r}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet, "
            "or load it through 'hf:<path>'"
        )
    return _Spec(kinds[suffix], text, None, utf8_safe(p.stem))


def source_path(source: str | os.PathLike[str]) -> Path | None:
    """The local file or folder ``source`` reads (None: a dataset ``hf:`` loads by name, or nothing there)."""
    text = os.fspath(source)
    if text.startswith("hf:"):
        text = text[3:].partition(":")[0]
    p = Path(text)
    if not p.exists():
        head, sep, _ = text.rpartition(":")
        p = Path(head) if sep and head else p
    return p if p.exists() else None


def source_name(source: str | os.PathLike[str]) -> str:
    """The name used in ``"<source name>:<row index>"`` sample ids.

    The file stem for files; the directory or dataset name for datasets, plus ``/<split>`` when
    the split was picked from several (a ``DatasetDict`` or ``load_dataset``).
    """
    spec = _resolve(source)
    if spec.kind in ("jsonl", "json", "parquet"):
        return spec.name
    return _dataset_name(spec, _load_dataset(spec)[1])


def _dataset_name(spec: _Spec, split: str | None) -> str:
    return f"{spec.name}/{split}" if split else spec.name


def _pick_split(obj: Any, split: str | None, where: str) -> tuple[Any, str | None]:
    import datasets

    if isinstance(obj, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        names = list(obj.keys())
        if split is None:
            if len(names) == 1:
                split = names[0]
            elif "train" in names:
                split = "train"
            else:
                raise ConfigError(f"{where} has splits {names}; pick one with '{where}:<split>'")
        if split not in obj:
            raise ConfigError(f"{where} has no split {split!r}; its splits are {names}")
        return obj[split], split
    if split is not None:
        raise ConfigError(f"{where} is a single dataset without splits; drop ':{split}'")
    return obj, None


def _load_dataset(spec: _Spec) -> tuple[Any, str | None]:
    """Load a map-style (memory-mapped) ``datasets.Dataset`` and the split it was taken from."""
    import datasets

    if spec.kind == "disk":
        try:
            obj = datasets.load_from_disk(spec.path)
        except FileNotFoundError as e:
            raise ConfigError(
                f"directory {spec.path!r} is not a dataset saved with save_to_disk ({e}); for a "
                "directory of data files use 'hf:<dir>'"
            ) from e
        return _pick_split(obj, spec.split, spec.path)
    if spec.split is not None:
        return datasets.load_dataset(spec.path, split=spec.split), spec.split
    return _pick_split(datasets.load_dataset(spec.path), None, f"hf:{spec.path}")


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


def _iter_jsonl(spec: _Spec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    with open(spec.path, "rb") as f:
        for index, line in enumerate(f):
            if stop is not None and index >= stop:
                return
            if index < start:
                continue
            data = _decode_jsonl_line(line, index + 1)
            raw = line.rstrip(b"\r\n") if isinstance(data, BadRow) else None
            yield _make_row(spec.name, index, data, sample_id, raw)


def _load_json_rows(path: str) -> list[Any]:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{path}: not a valid UTF-8 JSON file ({e}); fix the file, or use JSONL (one row per "
            "line) so that a bad row only rejects that row"
        ) from e
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        return doc["data"]
    if isinstance(doc, list):
        return doc
    raise ConfigError(f"{path}: expected a JSON list of rows or {{\"data\": [rows]}}, got {type(doc).__name__}")


def _iter_parquet(spec: _Spec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(spec.path)
    offset = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        rg_start, rg_stop = offset, offset + n
        offset = rg_stop
        if rg_stop <= start:
            continue
        if stop is not None and rg_start >= stop:
            return
        table = pf.read_row_group(rg)
        for batch in table.to_batches(max_chunksize=1024):
            for row in batch.to_pylist():
                index = rg_start
                rg_start += 1
                if index < start:
                    continue
                if stop is not None and index >= stop:
                    return
                yield _make_row(spec.name, index, row, sample_id)


def _iter_dataset(spec: _Spec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    ds, split = _load_dataset(spec)
    n = len(ds)
    end = n if stop is None else min(stop, n)
    if start >= end:
        return
    name = _dataset_name(spec, split)
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
    """
    if sample_id not in ("row", "hash"):
        raise ConfigError(f"sample_id must be 'row' or 'hash', got {sample_id!r}")
    if start < 0 or (stop is not None and stop < 0):
        raise ConfigError(f"start/stop must be >= 0, got start={start}, stop={stop}")
    spec = _resolve(source)  # a missing or unsupported source fails here, not at the first next()
    if spec.kind == "jsonl":
        return _iter_jsonl(spec, start, stop, sample_id)
    if spec.kind == "json":
        return _iter_json(spec, start, stop, sample_id)
    if spec.kind == "parquet":
        return _iter_parquet(spec, start, stop, sample_id)
    return _iter_dataset(spec, start, stop, sample_id)


def _iter_json(spec: _Spec, start: int, stop: int | None, sample_id: str) -> Iterator[SourceRow]:
    rows = _load_json_rows(spec.path)
    end = len(rows) if stop is None else min(stop, len(rows))
    for index in range(start, end):
        yield _make_row(spec.name, index, rows[index], sample_id)


def rows_to_build(source: str | os.PathLike[str], max_samples: int | None) -> int:
    """The source rows a build reads: all of :func:`count_rows`, at most ``max_samples``."""
    rows = count_rows(source)
    return rows if max_samples is None else min(rows, max_samples)


def count_rows(source: str | os.PathLike[str]) -> int:
    """Number of rows :func:`iter_source` yields for the whole source.

    Cheap where possible: JSONL counts newlines in 1 MiB chunks, parquet reads the footer,
    datasets use their length; a JSON file is parsed.
    """
    spec = _resolve(source)
    if spec.kind == "jsonl":
        count = 0
        last = b"\n"
        with open(spec.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                count += chunk.count(b"\n")
                last = chunk[-1:]
        return count + (0 if last == b"\n" else 1)
    if spec.kind == "json":
        return len(_load_json_rows(spec.path))
    if spec.kind == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(spec.path).metadata.num_rows)
    return len(_load_dataset(spec)[0])


def source_fingerprint(source: str | os.PathLike[str]) -> str:
    """A sha256 hex digest that changes when the source's content changes (for resume checks).

    Files: sha256 over the file bytes. Datasets: sha256 over the dataset fingerprint(s) and split.
    """
    spec = _resolve(source)
    h = hashlib.sha256()
    if spec.kind in ("jsonl", "json", "parquet"):
        with open(spec.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()
    ds, split = _load_dataset(spec)
    fp = getattr(ds, "_fingerprint", None)
    if not fp:
        raise ConfigError(f"dataset {spec.path!r} has no fingerprint; save it with save_to_disk first")
    h.update(f"{split}\0{fp}\0{len(ds)}".encode("utf-8"))
    return h.hexdigest()

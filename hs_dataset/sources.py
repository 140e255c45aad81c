"""Source stage: read raw rows from files or ``datasets`` datasets, and validate them.

Two steps, kept apart so that reading never fails on one bad row:

* :func:`iter_source` yields one :class:`~hs_dataset.records.SourceRow` per input row, without
  any validation. A JSONL line that is not valid UTF-8 or not valid JSON still yields a row whose
  ``data`` is a :class:`BadRow`, so that samples in = written + rejected holds.
* :func:`parse_row` validates one row and returns a :class:`~hs_dataset.records.Conversation`
  (ShareGPT or OpenAI chat shape) or a :class:`~hs_dataset.records.TokenizedSample` (raw token
  ids), or raises :class:`~hs_dataset.records.SampleError` naming the offending field.

Supported sources:

* ``path/to/file.jsonl`` -- one JSON object per line, streamed line by line (bounded memory);
* ``path/to/file.json`` -- a list of rows, or ``{"data": [rows]}``;
* ``path/to/file.parquet`` -- streamed by row group;
* ``path/to/dir`` -- a dataset saved with ``datasets.Dataset.save_to_disk`` (a saved
  ``DatasetDict`` needs ``path/to/dir:split`` unless it has one split or a ``train`` split);
* ``hf:<path_or_name>[:split]`` -- anything ``datasets.load_dataset`` can load (default split:
  ``train``, or the only split).

Row rules (see :func:`parse_row`): an optional system prompt first, then strictly alternating
user/assistant turns starting with a user turn, at least one assistant turn. A trailing user
turn after the last assistant reply is dropped (it would never be trained on).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .records import Conversation, Message, SampleError, SourceRow, TokenizedSample

__all__ = [
    "BadRow",
    "ROLE_ALIASES",
    "count_rows",
    "iter_source",
    "parse_row",
    "source_fingerprint",
    "source_name",
]

# Role names accepted in either shape (compared case-insensitively), mapped to Message roles.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

_INT32_MAX = 2**31 - 1
_HASH_CHARS = 16
_CHUNK = 1 << 20


@dataclass(frozen=True)
class BadRow:
    """Placeholder ``SourceRow.data`` for a row that could not even be decoded.

    :func:`parse_row` turns it into ``SampleError(field, reason)``.
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
    name: str


def _resolve(source: str | os.PathLike[str]) -> _Spec:
    text = os.fspath(source)
    if text.startswith("hf:"):
        rest = text[3:]
        path, _, split = rest.partition(":")
        if not path:
            raise ValueError(f"source {text!r}: expected 'hf:<path_or_name>[:split]'")
        name = Path(path.rstrip("/")).name or path
        return _Spec("hf", path, split or None, name)
    p = Path(text)
    if not p.exists():
        # "dir:split" for a DatasetDict saved to disk.
        head, sep, split = text.rpartition(":")
        if sep and head and Path(head).is_dir():
            return _Spec("disk", head, split or None, Path(head).name)
        raise FileNotFoundError(
            f"source {text!r} does not exist; give a .jsonl/.json/.parquet file, a directory saved "
            "with datasets' save_to_disk (optionally 'dir:split'), or 'hf:<path_or_name>[:split]'"
        )
    if p.is_dir():
        return _Spec("disk", text, None, p.name)
    suffix = p.suffix.lower()
    kinds = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
    if suffix not in kinds:
        raise ValueError(
            f"source {text!r}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet, "
            "or load it through 'hf:<path>'"
        )
    return _Spec(kinds[suffix], text, None, p.stem)


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
                raise ValueError(f"{where} has splits {names}; pick one with '{where}:<split>'")
        if split not in obj:
            raise ValueError(f"{where} has no split {split!r}; its splits are {names}")
        return obj[split], split
    if split is not None:
        raise ValueError(f"{where} is a single dataset without splits; drop ':{split}'")
    return obj, None


def _load_dataset(spec: _Spec) -> tuple[Any, str | None]:
    """Load a map-style (memory-mapped) ``datasets.Dataset`` and the split it was taken from."""
    import datasets

    if spec.kind == "disk":
        try:
            obj = datasets.load_from_disk(spec.path)
        except FileNotFoundError as e:
            raise ValueError(
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
        raise ValueError(
            f"{path}: not a valid UTF-8 JSON file ({e}); fix the file, or use JSONL (one row per "
            "line) so that a bad row only rejects that row"
        ) from e
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        return doc["data"]
    if isinstance(doc, list):
        return doc
    raise ValueError(f"{path}: expected a JSON list of rows or {{\"data\": [rows]}}, got {type(doc).__name__}")


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
        raise ValueError(f"sample_id must be 'row' or 'hash', got {sample_id!r}")
    if start < 0 or (stop is not None and stop < 0):
        raise ValueError(f"start/stop must be >= 0, got start={start}, stop={stop}")
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
        raise ValueError(f"dataset {spec.path!r} has no fingerprint; save it with save_to_disk first")
    h.update(f"{split}\0{fp}\0{len(ds)}".encode("utf-8"))
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return type(value).__name__


def _check_text(value: Any, field: str) -> str:
    """Return ``value`` if it is a string that is valid Unicode (encodable as UTF-8)."""
    if isinstance(value, (bytes, bytearray)):
        raise SampleError(field, f"expected a string, got {len(value)} raw bytes; decode them to text first")
    if not isinstance(value, str):
        raise SampleError(field, f"expected a string, got {_type_name(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SampleError(
            field,
            f"text is not valid UTF-8 (lone surrogate {value[e.start]!r} at character {e.start}); "
            "fix the text encoding of the source",
        ) from None
    return value


def _get(obj: Mapping[str, Any], key: str, field: str) -> Any:
    if key not in obj or obj[key] is None:
        keys = sorted(str(k) for k in obj.keys())
        raise SampleError(f"{field}.{key}" if field else key, f"missing field {key!r} (found keys {keys})")
    return obj[key]


def _as_list(value: Any, field: str) -> Sequence[Any]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise SampleError(field, f"expected a list, got {_type_name(value)}")
    return value


def _role(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise SampleError(field, f"expected a role string, got {_type_name(value)}")
    role = ROLE_ALIASES.get(value.strip().lower())
    if role is None:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise SampleError(
            field, f"unknown role {shown!r}; expected one of {sorted(ROLE_ALIASES)} (any case)"
        )
    return role


def _openai_content(value: Any, field: str) -> str:
    """OpenAI ``content``: a string, or a list of ``{"type": "text", "text": ...}`` parts joined by newlines."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise SampleError(field, "content is an empty list of parts")
        texts = []
        for k, part in enumerate(value):
            pfield = f"{field}[{k}]"
            if not isinstance(part, Mapping):
                raise SampleError(pfield, f"expected a content part object, got {_type_name(part)}")
            ptype = part.get("type") or "text"
            if ptype != "text":
                raise SampleError(
                    f"{pfield}.type", f"only text content parts are supported, got {str(ptype)[:40]!r}"
                )
            texts.append(_check_text(_get(part, "text", pfield), f"{pfield}.text"))
        return "\n".join(texts)
    return _check_text(value, field)


def _parse_messages(items: Sequence[Any], key: str, role_key: str, content_key: str) -> list[Message]:
    if len(items) == 0:
        raise SampleError(key, "conversation is empty")
    messages: list[Message] = []
    for i, item in enumerate(items):
        field = f"{key}[{i}]"
        if not isinstance(item, Mapping):
            raise SampleError(field, f"expected an object with {role_key!r} and {content_key!r}, got {_type_name(item)}")
        role = _role(_get(item, role_key, field), f"{field}.{role_key}")
        raw_content = _get(item, content_key, field)
        if key == "messages":
            content = _openai_content(raw_content, f"{field}.{content_key}")
        else:
            content = _check_text(raw_content, f"{field}.{content_key}")
        messages.append(Message(role, content))
    _check_order(messages, key, role_key, content_key)
    # A trailing user turn is never trained on: drop it.
    if messages[-1].role == "user":
        messages = messages[:-1]
    return messages


def _check_order(messages: list[Message], key: str, role_key: str, content_key: str) -> None:
    """Optional system first, then user, assistant, user, ... with at least one assistant turn."""
    expected = "user"
    for i, m in enumerate(messages):
        field = f"{key}[{i}].{role_key}"
        if m.role == "system":
            if i != 0:
                raise SampleError(field, f"a system message is only allowed as the first turn, found at turn {i}")
            continue
        if m.role != expected:
            if i == 0 or (i == 1 and messages[0].role == "system"):
                reason = f"the first turn after the optional system prompt must be a user turn, got {m.role}"
            else:
                reason = f"two consecutive {m.role} turns (turns {i - 1} and {i}); user and assistant turns must alternate"
            raise SampleError(field, reason)
        if m.role == "assistant" and not m.content.strip():
            raise SampleError(f"{key}[{i}].{content_key}", "assistant reply is empty; there is nothing to train on")
        expected = "assistant" if expected == "user" else "user"
    if not any(m.role == "assistant" for m in messages):
        raise SampleError(key, "conversation has no assistant turn; there is nothing to train on")


def _parse_int_list(value: Any, field: str, *, allow_bool: bool = False) -> list[int]:
    items = _as_list(value, field)
    out: list[int] = []
    for j, v in enumerate(items):
        if isinstance(v, (np.integer, np.bool_)):
            v = v.item()
        if isinstance(v, bool) and allow_bool:
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise SampleError(f"{field}[{j}]", f"expected an integer, got {_type_name(v)}")
        out.append(v)
    return out


def _parse_tokens(row: SourceRow, data: Mapping[str, Any]) -> TokenizedSample:
    ids = _parse_int_list(data["input_ids"], "input_ids")
    if not ids:
        raise SampleError("input_ids", "input_ids is empty")
    for j, v in enumerate(ids):
        if v < 0:
            raise SampleError(f"input_ids[{j}]", f"negative token id {v}")
        if v > _INT32_MAX:
            raise SampleError(f"input_ids[{j}]", f"token id {v} does not fit in int32")
    raw_mask = data.get("loss_mask")
    if raw_mask is None:
        mask = [1] * len(ids)
    else:
        mask = _parse_int_list(raw_mask, "loss_mask", allow_bool=True)
        if len(mask) != len(ids):
            raise SampleError("loss_mask", f"length {len(mask)} does not match input_ids length {len(ids)}")
        for j, v in enumerate(mask):
            if v not in (0, 1):
                raise SampleError(f"loss_mask[{j}]", f"expected 0 or 1, got {v}")
    return TokenizedSample(
        sample_id=row.sample_id,
        input_ids=np.asarray(ids, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.uint8),
    )


_SHAPES = ("conversations", "messages", "input_ids")


def parse_row(row: SourceRow) -> Conversation | TokenizedSample:
    """Validate one raw row; raise :class:`SampleError` naming the field on any problem.

    Shapes: ShareGPT ``{"conversations": [{"from", "value"}]}``, OpenAI
    ``{"messages": [{"role", "content"}]}`` (content may be a list of text parts, joined with
    ``"\\n"``), or raw tokens ``{"input_ids": [int], "loss_mask": [0/1] (optional)}``. Other keys
    are ignored; a key whose value is null counts as absent.
    """
    data = row.data
    if isinstance(data, BadRow):
        raise SampleError(data.field, data.reason)
    if not isinstance(data, Mapping):
        raise SampleError("row", f"expected a JSON object, got {_type_name(data)}")
    present = [k for k in _SHAPES if data.get(k) is not None]
    if not present:
        keys = sorted(str(k) for k in data.keys())[:20]
        raise SampleError(
            "row", f"no 'conversations', 'messages' or 'input_ids' field (found keys {keys})"
        )
    if len(present) > 1:
        raise SampleError("row", f"row has several of {present}; keep exactly one of them")
    key = present[0]
    if key == "input_ids":
        return _parse_tokens(row, data)
    items = _as_list(data[key], key)
    if key == "conversations":
        messages = _parse_messages(items, key, "from", "value")
    else:
        messages = _parse_messages(items, key, "role", "content")
    return Conversation(sample_id=row.sample_id, messages=messages)

"""Which source a build reads: its kind (JSONL, JSON, Parquet, a saved dataset, ``hf:``), name, local
path, how many rows it has and a fingerprint of its content (for resume checks). Reading its rows is
:mod:`hs_dataset.prepare.sources`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hs_dataset.errors import ConfigError, MissingPathError
from hs_dataset.redact import redact_text
from hs_dataset.layout import escape_controls, utf8_safe

__all__ = ["SourceSpec", "count_rows", "dataset_name", "id_name", "load_json_rows", "load_source_dataset", "open_parquet",
           "parquet_error", "resolve_source", "rows_to_build", "source_fingerprint", "source_name", "source_path"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # "jsonl" | "json" | "parquet" | "disk" | "hf"
    path: str
    split: str | None
    name: str  # valid UTF-8: a file name's undecodable bytes are escaped (layout.utf8_safe)
    # The file name looks like it holds a credential: the ids use ``source-<hash>`` instead of it.
    name_redacted: bool = False


def _spec(kind: str, path: str, split: str | None, raw_name: str) -> SourceSpec:
    """A spec whose ``name`` (the sample ids' prefix) holds no credential (see :func:`id_name`)."""
    name, redacted = id_name(raw_name)
    return SourceSpec(kind, path, split, name, redacted)


def id_name(raw: str) -> tuple[str, bool]:
    """The name sample ids are made of: ``raw`` as valid UTF-8, or ``source-<sha256[:12]>`` when ``raw`` looks
    like it holds a credential (an ``hf_...`` token, ``user:password@``, ``api_key=...``: anything
    :func:`hs_dataset.redact.redact_text` would redact). -> (name, whether it was replaced)."""
    name = escape_controls(utf8_safe(raw))
    if redact_text(name)[1]:
        return "source-" + hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()[:12], True
    return name, False


def resolve_source(source: str | os.PathLike[str]) -> SourceSpec:
    text = os.fspath(source)
    if text.startswith("hf:"):
        rest = text[3:]
        path, _, split = rest.partition(":")
        if not path:
            raise ConfigError(f"source {text!r}: expected 'hf:<path_or_name>[:split]'")
        name = Path(path.rstrip("/")).name or path
        return _spec("hf", path, split or None, name)
    p = Path(text)
    if not p.exists():
        # "dir:split" for a DatasetDict saved to disk.
        head, sep, split = text.rpartition(":")
        if sep and head and Path(head).is_dir():
            return _spec("disk", head, split or None, Path(head).name)
        raise MissingPathError(
            f"source {text!r} does not exist; give a .jsonl/.json/.parquet file, a directory saved "
            "with datasets' save_to_disk (optionally 'dir:split'), or 'hf:<path_or_name>[:split]'", path=text,
            field="source")
    if p.is_dir():
        return _spec("disk", text, None, p.name)
    suffix = p.suffix.lower()
    kinds = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
    if suffix not in kinds:
        raise ConfigError(
            f"source {text!r}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet, "
            "or load it through 'hf:<path>'"
        )
    return _spec(kinds[suffix], text, None, p.stem)


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
    spec = resolve_source(source)
    if spec.kind in ("jsonl", "json", "parquet"):
        return spec.name
    return dataset_name(spec, load_source_dataset(spec)[1])


def dataset_name(spec: SourceSpec, split: str | None) -> str:
    return f"{spec.name}/{split}" if split else spec.name


def _pick_split(obj: Any, split: str | None, where: str) -> tuple[Any, str | None]:
    import datasets  # deferred: only saved datasets and hf: sources need it

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


def load_source_dataset(spec: SourceSpec) -> tuple[Any, str | None]:
    """Load a map-style (memory-mapped) ``datasets.Dataset`` and the split it was taken from."""
    import datasets  # deferred: only saved datasets and hf: sources need it

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


def load_json_rows(path: str) -> list[Any]:
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


def open_parquet(path: str) -> pq.ParquetFile:
    """The Parquet file at ``path`` (its footer read).

    Raises:
        ConfigError: the file is damaged or not Parquet (one line naming it and what to do).
    """
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid: no footer, size 0...; OSError: unreadable
        raise parquet_error(path, "not a readable Parquet file", e) from e


def parquet_error(path: str, what: str, e: BaseException) -> ConfigError:
    """A damaged Parquet source as one line: the file, ``what`` failed, pyarrow's reason, what to do."""
    reason = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in " ".join(str(e).split())) or "no detail"
    return ConfigError(f"source {path!r}: {what} ({type(e).__name__}: {reason}); the file is damaged or not "
                       "Parquet: write it again (a copy or download cut short?) or give another source",
                       field="source", value=path)


def rows_to_build(source: str | os.PathLike[str], max_samples: int | None) -> int:
    """The source rows a build reads: all of :func:`count_rows`, at most ``max_samples``."""
    rows = count_rows(source)
    return rows if max_samples is None else min(rows, max_samples)


def count_rows(source: str | os.PathLike[str]) -> int:
    """Number of rows :func:`iter_source` yields for the whole source.

    Cheap where possible: JSONL counts newlines in 1 MiB chunks, parquet reads the footer,
    datasets use their length; a JSON file is parsed.

    Raises:
        ConfigError: the source is missing, unsupported, or damaged (a Parquet file without a readable
            footer: :func:`open_parquet`).
    """
    spec = resolve_source(source)
    if spec.kind == "jsonl":
        count = 0
        last = b"\n"
        with open(spec.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                count += chunk.count(b"\n")
                last = chunk[-1:]
        return count + (0 if last == b"\n" else 1)
    if spec.kind == "json":
        return len(load_json_rows(spec.path))
    if spec.kind == "parquet":
        return int(open_parquet(spec.path).metadata.num_rows)
    return len(load_source_dataset(spec)[0])


def source_fingerprint(source: str | os.PathLike[str]) -> str:
    """A sha256 hex digest that changes when the source's content changes (for resume checks).

    Files: sha256 over the file bytes. Datasets: sha256 over the dataset fingerprint(s) and split.
    """
    spec = resolve_source(source)
    h = hashlib.sha256()
    if spec.kind in ("jsonl", "json", "parquet"):
        with open(spec.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()
    ds, split = load_source_dataset(spec)
    fp = getattr(ds, "_fingerprint", None)
    if not fp:
        raise ConfigError(f"dataset {spec.path!r} has no fingerprint; save it with save_to_disk first")
    h.update(f"{split}\0{fp}\0{len(ds)}".encode("utf-8"))
    return h.hexdigest()

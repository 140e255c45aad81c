"""Which source a build reads, resolved once: :func:`resolve_source` turns the source string into a
:class:`Source` (its kind, name, local path), which then counts its rows and fingerprints its content once,
on first use. Reading its rows is :mod:`hs_dataset.prepare.sources`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hs_dataset.errors import ConfigError, ForeignFilesError, MissingPathError
from hs_dataset.layout import STATE_DIR, escape_controls, utf8_safe
from hs_dataset.redact import redact_text

__all__ = ["LINES_PER_OFFSET", "Source", "id_name", "open_parquet", "parquet_error", "resolve_source"]

_CHUNK = 1 << 20
# A JSONL source records the byte offset of every LINES_PER_OFFSET-th line while it counts its rows, so that a
# part's rows are read from a seek and at most this many skipped lines, not from the file's first line.
LINES_PER_OFFSET = 128


@dataclass(frozen=True, eq=False)
class Source:
    """A build's source, resolved once (:func:`resolve_source`); what depends on its content (rows, fingerprint,
    a dataset's split) is worked out on first use and kept.

    Attributes:
        kind: ``"jsonl"``, ``"json"``, ``"parquet"``, ``"disk"`` (saved with ``save_to_disk``) or ``"hf"``.
        path: the file or folder (``hf``: what ``datasets.load_dataset`` gets).
        split: the split asked for (None: the only one, or ``train``).
        text: the source string as given.
        name_redacted: the file name looks like it holds a credential: the ids use ``source-<hash>`` instead.
    """

    kind: str
    path: str
    split: str | None
    text: str
    base_name: str  # valid UTF-8: a file name's undecodable bytes are escaped (layout.utf8_safe)
    name_redacted: bool = False
    _groups: dict[str, Any] = field(default_factory=dict, repr=False)  # Parquet: the last row group decoded

    @property
    def local(self) -> Path | None:
        """The local file or folder read (None: a dataset ``hf:`` loads by name)."""
        p = Path(self.path)
        return p if p.exists() else None

    @property
    def name(self) -> str:
        """The name in ``"<name>:<row index>"`` sample ids: the file stem; a dataset's folder or name, plus
        ``/<split>`` when the split was picked from several."""
        if self.kind in ("jsonl", "json", "parquet"):
            return self.base_name
        split = self.dataset[1]
        return f"{self.base_name}/{split}" if split else self.base_name

    @cached_property
    def rows(self) -> int:
        """How many rows the source has. JSONL: its newlines counted (with its fingerprint and line offsets,
        one read of the file); Parquet: its footer; datasets: their length; a JSON file is parsed.

        Raises:
            ConfigError: the source is damaged (a Parquet file without a readable footer: :func:`open_parquet`)
                or a dataset cannot be loaded.
        """
        if self.kind == "jsonl":
            return self._jsonl_scan[0]
        if self.kind == "json":
            return len(self.json_rows)
        if self.kind == "parquet":
            return int(self.row_groups[-1])
        return len(self.dataset[0])

    def check_outside(self, folder: Path) -> None:
        """Refuse a local source inside ``folder``, a build's output (its ``.hs_build/`` excepted: imports write
        their index there): a rebuild would delete it.

        Raises:
            ForeignFilesError: naming both and what to do.
        """
        local = self.local
        if local is None:
            return
        a, b = local.resolve(), folder.resolve()
        if (a == b or b in a.parents) and (b / STATE_DIR) not in (a, *a.parents):
            raise ForeignFilesError(f"the source {local} lies inside the output directory {folder}: a build owns its "
                                    "output and removes what it did not write; move the source out, or pass another "
                                    "--output")

    def rows_to_build(self, max_samples: int | None) -> int:
        """The source rows a build reads: all of :attr:`rows`, at most ``max_samples``."""
        return self.rows if max_samples is None else min(self.rows, max_samples)

    @cached_property
    def fingerprint(self) -> str:
        """A sha256 hex digest that changes when the content changes (for resume checks): of a file's bytes, of a
        dataset's fingerprint and split."""
        if self.kind == "jsonl":
            return self._jsonl_scan[1]
        h = hashlib.sha256()
        if self.kind in ("json", "parquet"):
            with open(self.path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            return h.hexdigest()
        ds, split = self.dataset
        fp = getattr(ds, "_fingerprint", None)
        if not fp:
            raise ConfigError(f"dataset {self.path!r} has no fingerprint; save it with save_to_disk first")
        h.update(f"{split}\0{fp}\0{len(ds)}".encode("utf-8"))
        return h.hexdigest()

    def line_offset(self, line: int) -> tuple[int, int]:
        """JSONL: ``(byte offset, line index)`` of the recorded line at or before ``line``, to seek to."""
        offsets = self._jsonl_scan[2]
        k = min(line // LINES_PER_OFFSET, len(offsets) - 1)
        return int(offsets[k]), k * LINES_PER_OFFSET

    @cached_property
    def _jsonl_scan(self) -> tuple[int, str, np.ndarray]:
        """One read of a JSONL file: its rows, sha256, and the offset of every LINES_PER_OFFSET-th line."""
        h = hashlib.sha256()
        offsets = [0]
        count, pos, last = 0, 0, b"\n"
        with open(self.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                ends = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10)
                # line number count + j + 1 starts after the j-th newline of this chunk
                first = (-(count + 1)) % LINES_PER_OFFSET
                offsets.extend((pos + ends[first::LINES_PER_OFFSET] + 1).tolist())
                count += len(ends)
                pos += len(chunk)
                last = chunk[-1:]
        return count + (0 if last == b"\n" else 1), h.hexdigest(), np.asarray(offsets, dtype=np.int64)

    @cached_property
    def json_rows(self) -> list[Any]:
        """A JSON file's rows, parsed once.

        Raises:
            ConfigError: not UTF-8 JSON, or not a list of rows or ``{"data": [rows]}``.
        """
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"{self.path}: not a valid UTF-8 JSON file ({e}); fix the file, or use JSONL (one row per "
                "line) so that a bad row only rejects that row"
            ) from e
        if isinstance(doc, dict) and isinstance(doc.get("data"), list):
            return doc["data"]
        if isinstance(doc, list):
            return doc
        raise ConfigError(f"{self.path}: expected a JSON list of rows or {{\"data\": [rows]}}, got {type(doc).__name__}")

    @cached_property
    def dataset(self) -> tuple[Any, str | None]:
        """A saved or ``hf:`` dataset, loaded once (map-style, memory-mapped), and the split it was taken from.

        Raises:
            ConfigError: a folder not saved with ``save_to_disk``, a missing or ambiguous split.
        """
        import datasets  # deferred: only saved datasets and hf: sources need it

        if self.kind == "disk":
            try:
                obj = datasets.load_from_disk(self.path)
            except FileNotFoundError as e:
                raise ConfigError(
                    f"directory {self.path!r} is not a dataset saved with save_to_disk ({e}); for a "
                    "directory of data files use 'hf:<dir>'"
                ) from e
            return _pick_split(obj, self.split, self.path)
        if self.split is not None:
            return datasets.load_dataset(self.path, split=self.split), self.split
        return _pick_split(datasets.load_dataset(self.path), None, f"hf:{self.path}")

    @cached_property
    def parquet(self) -> pq.ParquetFile:
        """A Parquet file, its footer read once.

        Raises:
            ConfigError: the file is damaged or not Parquet (:func:`open_parquet`).
        """
        return open_parquet(self.path)

    @cached_property
    def row_groups(self) -> np.ndarray:
        """Parquet: the first row of each row group, and the rows in all (``num_row_groups + 1`` bounds)."""
        meta = self.parquet.metadata
        return np.cumsum([0] + [meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)])

    def row_group(self, rg: int) -> pa.Table:
        """Parquet: row group ``rg`` decoded; the last one is kept, so parts that share a row group decode it once.

        Raises:
            ConfigError: the row group is damaged (naming the file and its rows).
        """
        kept = self._groups.get("table")
        if kept is not None and kept[0] == rg:
            return kept[1]
        self._groups.pop("table", None)  # its memory goes before the next one is decoded
        try:
            table = self.parquet.read_row_group(rg)
        except (pa.ArrowException, OSError) as e:  # a damaged page: ArrowInvalid, OSError (thrift, levels)
            first, end = int(self.row_groups[rg]), int(self.row_groups[rg + 1])
            raise parquet_error(self.path, f"its row group {rg} (rows {first}-{end - 1}) cannot be read", e) from e
        self._groups["table"] = (rg, table)
        return table


def id_name(raw: str) -> tuple[str, bool]:
    """The name sample ids are made of: ``raw`` as valid UTF-8, or ``source-<sha256[:12]>`` when ``raw`` looks
    like it holds a credential (an ``hf_...`` token, ``user:password@``, ``api_key=...``: anything
    :func:`hs_dataset.redact.redact_text` would redact). -> (name, whether it was replaced)."""
    name = escape_controls(utf8_safe(raw))
    if redact_text(name)[1]:
        return "source-" + hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()[:12], True
    return name, False


def _source(kind: str, path: str, split: str | None, text: str, raw_name: str) -> Source:
    name, redacted = id_name(raw_name)
    return Source(kind, path, split, text, name, redacted)


def resolve_source(source: str | os.PathLike[str]) -> Source:
    """The :class:`Source` that the source string names (its rows are neither counted nor read here).

    ``path.jsonl``, ``path.json``, ``path.parquet``; a folder saved with ``datasets``' ``save_to_disk``
    (``dir:split`` for one split of a ``DatasetDict``); ``hf:<path_or_name>[:split]`` for anything
    ``datasets.load_dataset`` loads.

    Raises:
        MissingPathError: the file or folder does not exist.
        ConfigError: an unsupported file type, or an ``hf:`` source without a name.
    """
    text = os.fspath(source)
    if text.startswith("hf:"):
        path, _, split = text[3:].partition(":")
        if not path:
            raise ConfigError(f"source {text!r}: expected 'hf:<path_or_name>[:split]'")
        return _source("hf", path, split or None, text, Path(path.rstrip("/")).name or path)
    p = Path(text)
    if not p.exists():
        head, sep, split = text.rpartition(":")  # "dir:split" for a DatasetDict saved to disk
        if sep and head and Path(head).is_dir():
            return _source("disk", head, split or None, text, Path(head).name)
        raise MissingPathError(
            f"source {text!r} does not exist; give a .jsonl/.json/.parquet file, a directory saved "
            "with datasets' save_to_disk (optionally 'dir:split'), or 'hf:<path_or_name>[:split]'", path=text,
            field="source")
    if p.is_dir():
        return _source("disk", text, None, text, p.name)
    kinds = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
    if p.suffix.lower() not in kinds:
        raise ConfigError(f"source {text!r}: unsupported file type {p.suffix.lower()!r}; use .jsonl, .json or "
                          ".parquet, or load it through 'hf:<path>'")
    return _source(kinds[p.suffix.lower()], text, None, text, p.stem)


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

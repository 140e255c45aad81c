"""What every format module shares: the export frame (rows in, sidecar + drafter layer ids out) and
the records a format's reader hands to the import driver (:mod:`hs_dataset.interop.importer`).

Every export writes, beside the data::

    OUT/hs_dataset_export.json   ids, layers (hs_dataset convention), model, source: read back by import
    OUT/drafter_layer_ids.json   the layer ids for the drafter config, per engine (layer_ids.py)

Neither file is read by the peers (SpecForge lists ``*.ckpt``, ModelOpt ``*.pt``, speculators
``hidden_states/hs_*.safetensors`` + the dataset's own files).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hs_dataset.atomic import atomic_write, tmp_path
from hs_dataset.errors import InteropError
from hs_dataset.capture.layer_ids import drafter_layer_ids
from hs_dataset.layout import META_FILE, layer_column
from hs_dataset.read.iterate import iter_torch
from hs_dataset.read.open import open_dataset

__all__ = ["EXPORT_SIDECAR", "LAYER_IDS_FILE", "ExportFrame", "ExportSummary", "ImportedSample", "InteropError",
           "Peek", "SourceFile", "few", "index_of", "read_sidecar", "torch_load"]

EXPORT_SIDECAR = "hs_dataset_export.json"
LAYER_IDS_FILE = "drafter_layer_ids.json"


@dataclass
class ExportSummary:
    output_dir: str
    samples: int
    files: int
    bytes_written: int
    seconds: float
    layer_ids: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass
class SourceFile:
    """One sample of a foreign layout: its file, its index in that layout, and its sample id."""

    index: int
    path: Path
    sample_id: str = ""


@dataclass
class Peek:
    """A sample's tokens and the shape of its states, read without reading the states."""

    input_ids: torch.Tensor  # int [T]
    loss_mask: torch.Tensor  # int [T]
    num_states: int  # entries of the file's states (aux layers, then its last entry)
    hidden_size: int
    flags: dict[str, Any] = field(default_factory=dict)  # per-file facts the driver checks (e.g. prenorm)


@dataclass
class ImportedSample:
    input_ids: torch.Tensor  # int [T]
    states: torch.Tensor  # bf16 [num_states, T, H], in the file's order


def few(items: Iterable[Any], n: int = 3) -> str:
    """At most ``n`` items, then ``and N more``: keeps a listing in an error message to one short line."""
    items = list(items)
    shown = ", ".join(str(x) for x in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def index_of(path: Path, prefix: str) -> int | None:
    """``12`` for ``<prefix>12.<ext>``, else None."""
    m = re.fullmatch(re.escape(prefix) + r"(\d+)", path.name.split(".", 1)[0])
    return int(m.group(1)) if m else None


def torch_load(path: Path) -> dict[str, Any]:
    """A ``torch.save``'d dict, memory-mapped when possible (``.gz`` is decompressed first)."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True, map_location="cpu")
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except RuntimeError:  # the legacy (non-zipfile) format cannot be memory-mapped
        return torch.load(path, weights_only=True, map_location="cpu")


def read_sidecar(src: Path, fmt: str) -> dict[str, Any]:
    """``hs_dataset_export.json`` of an ``hs-dataset export --to fmt`` (empty when absent or another format)."""
    p = src / EXPORT_SIDECAR
    if not p.exists():
        return {}
    side = json.loads(p.read_text())
    return side if side.get("format") == fmt else {}


class ExportFrame:
    """One export: checks the build and the output, gives the rows, writes the sidecar and layer ids.

    ``aux``: the layers the format carries as EAGLE-3 inputs (default: every stored layer except
    ``L-1``, the pre-norm last state, which only the speculators layout carries, as its last entry).
    """

    def __init__(self, fmt: str, src: str | os.PathLike, out: str | os.PathLike, layers: Iterable[int] | None):
        self.t0 = time.time()
        self.fmt, self.src, self.out = fmt, Path(src), Path(out)
        meta_path = self.src / META_FILE
        if not meta_path.exists():
            raise InteropError(f"{self.src} is not a finished hs_dataset build (no {META_FILE})")
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise InteropError(f"{self.out} exists and is not empty: export into a new directory")
        self.meta = json.loads(meta_path.read_text())
        self.num_layers = int(self.meta["model"]["num_layers"])
        self.stored = [int(k) for k in self.meta["layers"]]
        if layers is None:
            self.aux = [k for k in self.stored if k != self.num_layers - 1]
        else:
            self.aux = [int(k) for k in layers]
            missing = [k for k in self.aux if k not in self.stored]
            if missing or self.aux != sorted(set(self.aux)):
                raise InteropError(f"export layers {self.aux} must be distinct stored layers in increasing order; "
                                   f"{self.src} stores {self.stored}")
        if not self.aux:
            raise InteropError(f"no aux layers to export: {self.src} stores {self.stored}")
        self.warnings: list[str] = []
        teacher = self.meta.get("teacher") or {}
        if teacher.get("k"):  # no peer format has a place for them: said, never dropped silently
            self.warnings.append(f"teacher top-{teacher['k']} columns (teacher_ids, teacher_logprobs, teacher_lse) are "
                                 f"not exported: the {fmt} layout has no place for them; read them from {self.src} "
                                 "with hs_dataset.read")
        self.ids: list[str] = []
        self.files = 0
        self.nbytes = 0

    def require(self, ok: bool, message: str) -> None:
        if not ok:
            raise InteropError(message)

    def rows(self, columns: list[str]) -> Iterator[dict[str, Any]]:
        """The build's rows in order (id, input_ids, loss_mask and ``columns``), decoded to bf16."""

        self.out.mkdir(parents=True, exist_ok=True)
        for row in iter_torch(open_dataset(self.src), batch_size=4, columns=columns):
            self.ids.append(row["id"])
            yield row

    def aux_columns(self) -> list[str]:
        return [layer_column(k) for k in self.aux]

    def wrote(self, path: Path) -> None:
        self.files += 1
        self.nbytes += path.stat().st_size

    def save(self, obj: Any, path: Path, writer: Callable[[Any, str], None]) -> None:
        """Write ``obj`` with ``writer(obj, tmp)`` then rename into ``path`` (no half-written file)."""
        tmp = tmp_path(path)
        writer(obj, str(tmp))
        os.replace(tmp, path)
        self.wrote(path)

    def finish(self, layers: list[int], **extra: Any) -> ExportSummary:
        """Write the sidecar (``layers``: every layer the files carry, hs_dataset convention) and layer ids."""

        info = self.meta["model"]
        ids = drafter_layer_ids(info["architecture"], self.num_layers, self.aux)
        if ids["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] is None:
            self.warnings.append(f"no SGLang layer ids for layers {self.aux}: {ids['sglang']['rule']}")
        sidecar = {"format": self.fmt, "source": str(self.src.resolve()), "model": info, "layers": layers,
                   "layer_convention": self.meta["layer_convention"], "storage_dtype": self.meta["storage_dtype"],
                   "tokenizer": self.meta.get("tokenizer", {}).get("path"), "ids": self.ids, **extra}
        atomic_write(self.out / LAYER_IDS_FILE, json.dumps(ids, indent=1))
        atomic_write(self.out / EXPORT_SIDECAR, json.dumps(sidecar))
        return ExportSummary(str(self.out), len(self.ids), self.files, self.nbytes, time.time() - self.t0, ids,
                             self.warnings)

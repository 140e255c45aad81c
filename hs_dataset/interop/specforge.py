"""SpecForge's offline layout (``sgl-project/SpecForge``, PyPI ``specforge==0.2.0``).

``scripts/prepare_hidden_states.py`` (``HiddenStatesGenerator._save_tensor_sync``) writes, and
``specforge/data/preprocessing.py`` (``build_offline_eagle3_dataset``) and the 0.2.0 provider path
(``runtime/data_plane/offline_reader.py`` -> ``LocalFeatureStore`` -> ``FeatureDataLoader``) read,
``OUT/rows_{g}-{g + 2000}/data_{i}.ckpt`` for sample ``i`` (``g = i // 2000 * 2000``;
``--file-group-size``), each a ``torch.save``'d dict::

    input_ids         int64 [T]
    loss_mask         int64 [T]
    hidden_state      bf16  [1, T, H]        the final post-norm state
    aux_hidden_state  bf16  [1, T, 3 * H]    the aux layers, concatenated along the last dim

The readers list ``*.ckpt`` / ``*.ckpt.gz`` recursively (other files are ignored) and need exactly
three aux layers (``resolve_eagle_capture_layers``); their ids are SGLang's (see
:mod:`hs_dataset.interop.layer_ids`), default ``[1, L//2 - 1, L - 4]`` = the same hs_dataset layers.

**Pad tails.** 0.2.0 captures each row of a padded batch whole (``--batch-size 32``;
``DataCollatorWithPadding`` pads ``input_ids`` and ``loss_mask`` with 0) and saves the tail: pad id 0
with loss mask 0 and the states the model computed for them. The import strips the trailing run of
``input_ids == pad_id`` with ``loss_mask == 0`` (``pad_id`` 0 by default, ``None`` keeps it) and
records how many tokens it stripped in ``hs_dataset.json``; a sample whose own last tokens are the
pad id outside the loss mask loses them too. Files of an ``hs-dataset export`` have no padding and are
never stripped. Older writers saved ``input_ids`` longer than the states: only the first ``T`` are kept.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from hs_dataset.errors import SampleError
from hs_dataset.interop.common import (ExportFrame, ExportSummary, ImportedSample, InteropError, Peek, SourceFile,
                                       index_of, read_sidecar, torch_load)
from hs_dataset.interop.importer import ForeignSource
from hs_dataset.layout import FINAL_COLUMN

__all__ = ["SPECFORGE_GROUP_SIZE", "SPECFORGE_PAD_ID", "export_specforge", "list_specforge", "specforge_file",
           "specforge_record", "specforge_source"]

SPECFORGE_GROUP_SIZE = 2000
SPECFORGE_PAD_ID = 0  # DataCollatorWithPadding.paddingtensor2D pads with zeros
_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


def specforge_file(out: str | os.PathLike, index: int, group_size: int = SPECFORGE_GROUP_SIZE) -> Path:
    """Where SpecForge keeps sample ``index``: ``out/rows_{g}-{g + group_size}/data_{index}.ckpt``."""
    g = index // group_size * group_size
    return Path(out) / f"rows_{g}-{g + group_size}" / f"data_{index}.ckpt"


def specforge_record(row: dict[str, Any], aux: list[str], final: str) -> dict[str, torch.Tensor]:
    """One decoded row as SpecForge's per-sample dict (``aux``: the layer columns, ``final``: hidden_final)."""
    return {
        "input_ids": row["input_ids"].to(torch.long),
        "loss_mask": row["loss_mask"].to(torch.long),
        "hidden_state": row[final].unsqueeze(0),
        "aux_hidden_state": torch.cat([row[c] for c in aux], dim=-1).unsqueeze(0),
    }


def export_specforge(src: str | os.PathLike, out: str | os.PathLike, *, group_size: int = SPECFORGE_GROUP_SIZE,
                     layers: Iterable[int] | None = None,
                     on_sample: Callable[[int], None] | None = None) -> ExportSummary:
    """Write the build directory ``src`` in SpecForge's offline layout under ``out``.

    Args:
        src: a finished build directory.
        out: a new (or empty) directory.
        group_size: samples per ``rows_<a>-<b>`` folder (SpecForge's ``--file-group-size``).
        layers: the three stored layers to write as ``aux_hidden_state`` (default: the stored
            layers except ``L-1``).
        on_sample: called with each sample's index after it is written.

    Raises:
        InteropError: ``src`` is not a finished build, ``out`` is not empty, or the aux layers are
            not exactly three (SpecForge's contract).
    """
    if group_size < 1:
        raise InteropError(f"group size must be >= 1, got {group_size}")
    x = ExportFrame("specforge", src, out, layers)
    x.require(len(x.aux) == 3, f"SpecForge trains EAGLE-3 on exactly 3 aux layers; the export would write {x.aux} "
                               f"(stored: {x.stored}): pass --layers with 3 of them")
    cols = x.aux_columns()
    dirs: set[Path] = set()
    for i, row in enumerate(x.rows(cols + [FINAL_COLUMN])):
        path = specforge_file(x.out, i, group_size)
        if path.parent not in dirs:
            path.parent.mkdir(exist_ok=True)
            dirs.add(path.parent)
        x.save(specforge_record(row, cols, FINAL_COLUMN), path, torch.save)
        if on_sample is not None:
            on_sample(i)
    return x.finish(x.aux, group_size=group_size)


def list_specforge(src: str | os.PathLike) -> list[SourceFile]:
    """SpecForge's ``data_{i}.ckpt`` (or ``.ckpt.gz``) files under ``src``, by sample index."""
    files = []
    for root, _, names in os.walk(os.fspath(src)):
        for name in names:
            if name.endswith((".ckpt", ".ckpt.gz")):
                p = Path(root) / name
                i = index_of(p, "data_")
                if i is None:
                    raise InteropError(f"{p}: not a SpecForge sample file name (expected data_<index>.ckpt)")
                files.append(SourceFile(i, p, f"specforge:{i}"))
    files.sort(key=lambda f: f.index)
    for a, b in itertools.pairwise(files):
        if a.index == b.index:
            raise InteropError(f"sample {a.index} is stored twice: {a.path} and {b.path}")
    return files


def _parts(f: SourceFile, pad_id: int | None) -> tuple[dict[str, Any], int, int, int, int]:
    """The file's dict (memory-mapped), its real length, state length, hidden size and aux count."""
    d = torch_load(f.path)
    missing = [k for k in _KEYS if k not in d]
    if missing:
        raise SampleError("file", f"missing keys {missing} (was it made with --enable-aux-hidden-states?)")
    H = d["hidden_state"].shape[-1]
    T = d["hidden_state"].numel() // H
    width = d["aux_hidden_state"].shape[-1]
    if width % H or d["aux_hidden_state"].numel() != T * width:
        raise SampleError("aux_hidden_state", f"shape {tuple(d['aux_hidden_state'].shape)} does not fit "
                                              f"hidden_state {tuple(d['hidden_state'].shape)}")
    ids, mask = d["input_ids"].reshape(-1), d["loss_mask"].reshape(-1)
    if ids.shape[0] < T or mask.shape[0] != ids.shape[0]:
        raise SampleError("input_ids", f"{ids.shape[0]} input_ids and {mask.shape[0]} loss_mask values for {T} states")
    n = T
    if pad_id is not None:
        while n > 0 and int(ids[n - 1]) == pad_id and int(mask[n - 1]) == 0:
            n -= 1
        if n == 0:
            raise SampleError("input_ids", f"every token is the pad id {pad_id} outside the loss mask")
    return d, n, T, H, width // H


def specforge_source(src: Path, info_layers: int, *, pad_id: int | None = SPECFORGE_PAD_ID) -> ForeignSource:
    """The import reader of a SpecForge output directory (``info_layers``: the model's decoder layers)."""
    side = read_sidecar(src, "specforge")
    files = list_specforge(src)
    if side and len(side.get("ids", [])) == len(files) and [f.index for f in files] == list(range(len(files))):
        for f, sid in zip(files, side["ids"]):
            f.sample_id = sid
        pad_id = None  # our own export: no padding
    L = info_layers

    def peek(f: SourceFile) -> Peek:
        d, n, T, H, aux = _parts(f, pad_id)
        ids, mask = d["input_ids"].reshape(-1), d["loss_mask"].reshape(-1)
        flags = {"pad_tail_tokens": T - n, "pad_tail_samples": int(T > n)} if pad_id is not None else {}
        return Peek(ids[:n].clone(), mask[:n].clone(), aux + 1, H, flags)

    def read(f: SourceFile) -> ImportedSample:
        d, n, T, H, aux = _parts(f, pad_id)
        states = torch.empty((aux + 1, n, H), dtype=torch.bfloat16)
        states[:aux] = d["aux_hidden_state"].reshape(T, aux, H)[:n].transpose(0, 1)
        states[aux] = d["hidden_state"].reshape(T, H)[:n]
        return ImportedSample(d["input_ids"].reshape(-1)[:n], states)

    if side.get("layers"):
        layers, where = tuple(side["layers"]), f"{src}/hs_dataset_export.json"
    else:
        layers, where = (1, L // 2 - 1, L - 4), "SpecForge's default aux layers [1, L//2-1, L-4]"
    return ForeignSource("specforge", files, peek, read, layers, where,
                         options={"pad_id": pad_id} if pad_id is not None else {})

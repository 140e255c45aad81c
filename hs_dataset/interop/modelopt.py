"""NVIDIA ModelOpt's offline EAGLE-3 dumps (PyPI ``nvidia-modelopt==0.47.0``).

``examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py`` (and ``_vllm.py``)
write, and ``modelopt.torch.speculative.eagle.utils.OfflineSupervisedDataset`` reads
(``torch.load(weights_only=True)``; the trainer globs ``*.pt`` recursively), one
``{conversation_id}.pt`` per conversation::

    input_ids              int64 [T]
    hidden_states          bf16  [T, H]        the final state (HF dump: ``hidden_states[-1]``, post-norm)
    aux_hidden_states      bf16  [T, n * H]    ``hidden_states[lid + 1]`` for each aux layer id
    loss_mask              int64 [T]           optional (``--answer-only-loss``); absent = all ones; the
                                               trainer reads it only with ``answer_only_loss=True``
    conversation_id        the source row's id
    hidden_states_prenorm  bool                optional: True when ``hidden_states`` is before the norm

The HF dump's aux ids are hs_dataset's own (output of layer ``lid``), default
``default_eagle_aux_layer_ids(L) = sorted({1, L//2 - 1, L - 4})``. The vLLM dump passes its ids to vLLM
(which captures the *input* of layer id: hs_dataset ``id - 1``: pass ``--layers``) and stores vLLM's
pre-norm last layer as ``hidden_states`` without setting ``hidden_states_prenorm``: import it with
``final_prenorm=True`` (``--final-prenorm``); a pre-norm ``hidden_states`` is stored as
``hidden_layer_{L-1}`` and ``hidden_final`` is computed with the model's final norm.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from hs_dataset.errors import SampleError
from hs_dataset.interop.common import (ExportFrame, ExportSummary, ImportedSample, InteropError, Peek, SourceFile,
                                       few, read_sidecar, torch_load)
from hs_dataset.interop.importer import _UNREADABLE, ForeignSource
from hs_dataset.layout import FINAL_COLUMN

__all__ = ["export_modelopt", "modelopt_default_layers", "modelopt_file_name", "modelopt_source"]

_KEYS = ("input_ids", "hidden_states", "aux_hidden_states")


def modelopt_default_layers(num_layers: int) -> tuple[int, ...]:
    """ModelOpt's ``default_eagle_aux_layer_ids`` (hf_eagle.py)."""
    return tuple(sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)}))


def modelopt_file_name(conversation_id: str) -> str:
    """``{conversation_id}.pt``, with characters a file name cannot hold replaced by ``_``."""
    return re.sub(r"[/\\\x00]", "_", conversation_id) + ".pt"


def export_modelopt(src: str | os.PathLike, out: str | os.PathLike, *,
                    layers: Iterable[int] | None = None) -> ExportSummary:
    """Write the build ``src`` as ModelOpt offline dumps (``{id}.pt``, post-norm ``hidden_states``).

    Each file carries the build's ``loss_mask``, but ModelOpt uses it only when trained with
    ``answer_only_loss=True`` (``training.answer_only_loss``; ``OfflineSupervisedDataset(...,
    answer_only_loss=True)``): by default it ignores the stored mask and trains on every token.

    Args:
        src: a finished build directory.
        out: a new (or empty) directory: ModelOpt's ``data.offline_data_path``.
        layers: the stored layers to concatenate into ``aux_hidden_states`` (default: all but ``L-1``).

    Raises:
        InteropError: not a finished build, ``out`` not empty, or two ids give one file name.
    """
    x = ExportFrame("modelopt", src, out, layers)
    cols = x.aux_columns()
    names: set[str] = set()
    for row in x.rows(cols + [FINAL_COLUMN]):
        name = modelopt_file_name(row["id"])
        x.require(name not in names, f"two samples map to the file name {name}: ids must differ beyond '/' and '\\'")
        names.add(name)
        record = {"input_ids": row["input_ids"].to(torch.long), "hidden_states": row[FINAL_COLUMN],
                  "aux_hidden_states": torch.cat([row[c] for c in cols], dim=-1),
                  "loss_mask": row["loss_mask"].to(torch.long), "conversation_id": row["id"]}
        x.save(record, x.out / name, torch.save)
    return x.finish(x.aux)


def modelopt_source(src: Path, L: int, *, final_prenorm: bool | None = None) -> ForeignSource:
    """The import reader of a folder of ModelOpt dumps (``L``: the model's decoder layers).

    ``final_prenorm``: whether ``hidden_states`` is before the final norm; None: the files'
    ``hidden_states_prenorm`` (absent = post-norm, ModelOpt's own default). A folder whose files
    disagree is refused, never judged by one file or by the majority: the flag decides what
    ``hidden_states`` is labelled, and a dump of the other kind is most likely another run.

    Raises:
        InteropError: no ``*.pt`` file, or a folder mixing pre-norm and post-norm dumps (the
            message gives how many of each and a few of the fewer kind).
    """
    side = read_sidecar(src, "modelopt")
    paths = sorted(src.rglob("*.pt"))
    order = {modelopt_file_name(sid): k for k, sid in enumerate(side.get("ids", []))}
    if order and len(order) == len(paths) and all(p.name in order for p in paths):
        paths.sort(key=lambda p: order[p.name])  # our export: the build's order
    files = [SourceFile(k, p, p.name[:-3]) for k, p in enumerate(paths)]
    errors: dict[int, tuple[str, str]] = {}
    seen: dict[str, Path] = {}
    kinds: dict[bool, list[Path]] = {True: [], False: []}
    for k, f in enumerate(files):  # ids and the pre-norm flag need the (memory-mapped) dicts: no states read
        try:
            d = torch_load(f.path)
            cid = d.get("conversation_id")
            if cid is not None:
                f.sample_id = str(cid)
            kinds[bool(d.get("hidden_states_prenorm", False))].append(f.path)
        except _UNREADABLE as e:  # EOFError, UnpicklingError...: this file's reject, not the import's end
            errors[k] = ("file", f"{f.path}: unreadable ({e!r})")
            continue
        if f.sample_id in seen:
            errors[k] = ("conversation_id", f"{f.path}: conversation_id {f.sample_id!r} also in {seen[f.sample_id]}")
        seen.setdefault(f.sample_id, f.path)
    if not files:
        raise InteropError(f"{src}: no ModelOpt dump files (*.pt)")
    if final_prenorm is None and kinds[True] and kinds[False]:
        pre, post = len(kinds[True]), len(kinds[False])
        fewer = kinds[pre < post]
        raise InteropError(f"{src} mixes {pre} pre-norm and {post} post-norm dumps (hidden_states_prenorm "
                           f"{'true' if pre < post else 'absent or false'} in {few(p.name for p in fewer)}): import "
                           "each kind from its own folder, or pass --final-prenorm if every hidden_states is pre-norm")
    prenorm = bool(kinds[True]) if final_prenorm is None else final_prenorm

    def load(f: SourceFile) -> tuple[dict, int, int, int]:
        d = torch_load(f.path)
        missing = [k for k in _KEYS if k not in d]
        if missing:
            hint = (": a list of hidden_states is speculators' legacy data_<i>.pt, use --from speculators"
                    if isinstance(d.get("hidden_states"), (list, tuple)) else "")
            raise SampleError("file", f"missing keys {missing}{hint}")
        if final_prenorm is None and bool(d.get("hidden_states_prenorm", False)) != prenorm:
            raise SampleError("hidden_states_prenorm", f"is {not prenorm}, unlike when the import began (the file "
                                                       "changed): do not mix pre-norm and post-norm dumps")
        H = d["hidden_states"].shape[-1]
        T = d["hidden_states"].numel() // H
        width = d["aux_hidden_states"].numel() // max(T, 1)
        if width == 0 or width % H or d["input_ids"].numel() != T:
            raise SampleError("aux_hidden_states", f"shape {tuple(d['aux_hidden_states'].shape)} does not fit "
                                                   f"hidden_states {tuple(d['hidden_states'].shape)} and "
                                                   f"{d['input_ids'].numel()} input_ids")
        return d, T, H, width // H

    def peek(f: SourceFile) -> Peek:
        d, _, H, n = load(f)
        ids = d["input_ids"].reshape(-1)
        mask = d["loss_mask"].reshape(-1) if "loss_mask" in d else torch.ones_like(ids)
        return Peek(ids.clone(), mask.clone(), n + 1, H)

    def read(f: SourceFile) -> ImportedSample:
        d, T, H, n = load(f)
        states = torch.empty((n + 1, T, H), dtype=torch.bfloat16)
        states[:n] = d["aux_hidden_states"].reshape(T, n, H).transpose(0, 1)
        states[n] = d["hidden_states"].reshape(T, H)
        return ImportedSample(d["input_ids"].reshape(-1), states)

    if side.get("layers"):
        layers, where = tuple(side["layers"]), f"{src}/hs_dataset_export.json"
    else:
        layers, where = modelopt_default_layers(L), "ModelOpt's default_eagle_aux_layer_ids sorted({1, L//2-1, L-4})"
    if prenorm:
        layers = (*layers, L - 1)
    return ForeignSource("modelopt", files, peek, read, layers, where, last="prenorm" if prenorm else "final",
                         errors=errors, options={"final_prenorm": prenorm})

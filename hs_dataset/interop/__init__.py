"""Interop with the offline hidden-state layouts of SpecForge, vLLM speculators and NVIDIA ModelOpt.

``hs-dataset export DIR --to specforge|speculators|modelopt OUT`` and
``hs-dataset import SRC --from specforge|speculators|modelopt OUT``. One module per format
(:mod:`.specforge`, :mod:`.speculators`, :mod:`.modelopt`: each docstring gives the layout, the
peer's source it was checked against, and its layer ids); :mod:`.common` (the export frame),
:mod:`.importer` (the import driver: per-sample rejects, a resumable build), :mod:`hs_dataset.capture.layer_ids`
(the drafter config's ids per engine), :mod:`.final_norm` (``hidden_final`` from a pre-norm
last layer) and :mod:`.model_check` (``--model`` checked against the files' states).

Labels are never guessed: a state before the final norm is stored as ``hidden_layer_{L-1}``, and
``hidden_final`` is either the file's post-norm state or computed with the model's own final norm.
``layers`` are always given in hs_dataset's convention (see :mod:`hs_dataset.model_info`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from hs_dataset.codec.encode import check_storage_dtype
from hs_dataset.errors import InteropError
from hs_dataset.integrity.verify import read_meta
from hs_dataset.interop.common import EXPORT_SIDECAR, LAYER_IDS_FILE, ExportSummary, read_sidecar
from hs_dataset.interop.importer import FileCaptureBackend, ImportSummary, run_import
from hs_dataset.capture.layer_ids import drafter_layer_ids
from hs_dataset.interop.modelopt import export_modelopt, modelopt_source
from hs_dataset.interop.specforge import (SPECFORGE_GROUP_SIZE, SPECFORGE_PAD_ID, export_specforge, list_specforge,
                                          specforge_file, specforge_source)
from hs_dataset.interop.speculators import export_speculators, speculators_source
from hs_dataset.layout import FileFormat, StorageDtype
from hs_dataset.model_info import read_model_info

__all__ = ["EXPORT_FORMATS", "EXPORT_SIDECAR", "IMPORT_FORMATS", "LAYER_IDS_FILE", "SPECFORGE_GROUP_SIZE",
           "SPECFORGE_PAD_ID", "ExportSummary", "FileCaptureBackend", "ImportSummary", "InteropError",
           "default_layers", "drafter_layer_ids", "export_dataset", "export_modelopt", "export_specforge",
           "export_speculators", "import_dataset", "list_specforge", "specforge_file"]

EXPORT_FORMATS = ("specforge", "speculators", "modelopt")
IMPORT_FORMATS = ("specforge", "speculators", "modelopt")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """SpecForge's default EAGLE-3 aux layers (= vLLM's ``[2, L//2, L-3]``), in hs_dataset's convention."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def export_dataset(src: str | os.PathLike, fmt: str, out: str | os.PathLike, *, layers: Iterable[int] | None = None,
                   group_size: int = SPECFORGE_GROUP_SIZE,
                   on_sample: Callable[[int], None] | None = None) -> ExportSummary:
    """Write the build ``src`` in the layout ``fmt`` under ``out`` (see the format modules).

    Args:
        src: a finished build directory.
        fmt: ``specforge``, ``speculators`` or ``modelopt``.
        out: a new (or empty) directory.
        layers: the stored layers to write as the EAGLE-3 aux layers (default: all but ``L-1``).
        group_size: SpecForge's samples per folder.
        on_sample: SpecForge only: called with each sample's index after it is written.

    Raises:
        InteropError: an unknown format, a build the peers' files cannot carry (no ``hidden_final``, samples
            spanning rows), or what the format's exporter refuses.
    """
    meta = read_meta(Path(src))
    if meta.get("store_final") is False:
        raise InteropError(f"{src} stores the teacher's top-k instead of hidden_final (store_final=false): {fmt}'s "
                           "files carry the final state of every position, which this build does not have; rebuild "
                           "with store_final=true to export it")
    if meta.get("long_rows"):
        raise InteropError(f"{src} stores samples longer than row_tokens {meta.get('row_tokens')} as several rows; {fmt}'s "
                           "files hold one whole sample each: rebuild with row_tokens >= max_length to export it")
    if fmt == "specforge":
        return export_specforge(src, out, group_size=group_size, layers=layers, on_sample=on_sample)
    if fmt == "speculators":
        return export_speculators(src, out, layers=layers)
    if fmt == "modelopt":
        return export_modelopt(src, out, layers=layers)
    raise InteropError(f"unknown format {fmt!r}: use one of {', '.join(EXPORT_FORMATS)}")


def import_dataset(src: str | os.PathLike, fmt: str, out: str | os.PathLike, *, model: str | None = None,
                   layers: Iterable[int] | None = None, storage_dtype: StorageDtype = "bfloat16",
                   file_format: FileFormat = "arrow",
                   part_size: int = 256, progress: bool = False, build_command: str | None = None,
                   pad_id: int | None = SPECFORGE_PAD_ID, final_prenorm: bool | None = None,
                   trust_remote_code: bool = False, check_model: bool = True) -> ImportSummary:
    """Import SpecForge, speculators or ModelOpt hidden states from ``src`` into a build directory ``out``.

    Args:
        src: the peer's output directory.
        fmt: ``specforge``, ``speculators`` or ``modelopt``.
        out: the build directory to write (resumable: run the same call again after a crash).
        model: the target model's directory (config.json, tokenizer and weights: the model check
            runs it; with ``check_model=False`` the weights are needed only for a pre-norm last
            layer (speculators, ModelOpt vLLM dumps), of which only the final norm is read);
            default: the model recorded by an ``hs-dataset export``.
        layers: the layers of the files' entries in hs_dataset's convention (ending with ``L-1``
            where the files' last entry is the pre-norm last layer); default: recorded by
            ``hs-dataset export`` or ``data_config.json``, else the format's default.
        storage_dtype, file_format, part_size, progress, build_command: as for a build.
        pad_id: SpecForge: strip trailing tokens with this id outside the loss mask (None keeps them).
        final_prenorm: ModelOpt: whether ``hidden_states`` is before the final norm (None: the files' flag).
        trust_remote_code: the model's tokenizer is its own code (Kimi-K2.5), recorded like a build's.
        check_model: before anything is written, recompute a few samples with ``model`` on the CPU
            (transformers) and refuse states it does not compute (:mod:`.model_check`); False
            (``--skip-model-check``) for a model too large to run there: only the cheap check runs.

    Raises:
        InteropError: an unknown format, an unusable source, no usable sample at all (one bad
            sample is a reject in ``rejects.jsonl``, not an error), or states ``model`` does not
            compute (another model, other layers).
    """

    if fmt not in IMPORT_FORMATS:
        raise InteropError(f"unknown format {fmt!r}: use one of {', '.join(IMPORT_FORMATS)}")
    check_storage_dtype(storage_dtype)
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise InteropError(f"{src} is not a directory")
    if model is None:
        side = read_sidecar(src, fmt) or read_sidecar(src.parent, fmt)
        model = (side.get("model") or {}).get("path")
        if not model:
            raise InteropError("pass --model: the target model's directory (config.json and tokenizer)")
    L = read_model_info(model).num_layers
    if fmt == "specforge":
        source = specforge_source(src, L, pad_id=pad_id)
    elif fmt == "speculators":
        source = speculators_source(src, L)
    else:
        source = modelopt_source(src, L, final_prenorm=final_prenorm)
    return run_import(source, out, model=model, source_dir=src, layers=layers, storage_dtype=storage_dtype,
                      file_format=file_format, part_size=part_size, progress=progress, trust_remote_code=trust_remote_code,
                      check_model=check_model, build_command=build_command or f"hs-dataset import {src} --from {fmt} {out}")

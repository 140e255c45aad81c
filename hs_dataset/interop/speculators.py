"""vLLM speculators' offline layout (``vllm-project/speculators``, PyPI ``speculators==0.9.0`` +
``hs-connectors==0.9.0``), both eras.

Current (``speculators prepare-data`` + ``generate-offline-data`` with vLLM's
``extract_hidden_states``; read by ``speculators.train.data.ArrowDataset``)
    ``DATA/`` is the preprocessed dataset (``save_to_disk``, torch format: ``input_ids`` and
    ``loss_mask`` int64, ``seq_len``), ``DATA/token_freq.pt`` the loss-masked token counts the
    trainer turns into its d2t/t2d vocab mapping, and ``DATA/hidden_states/hs_{i}.safetensors``
    the states of row ``i``, as vLLM's ``ExampleHiddenStatesConnector._write_tensors`` saves them::

        hidden_states         bf16 [T, n + 1, H]   vLLM ids target_layer_ids + [L]
        token_ids             int64 [T]            must equal the row's input_ids
        hidden_states_scales  fp32 [T, 1, 1]       only from hs-connectors' FP8HiddenStatesConnector
                                                   (hidden_states then float8_e4m3fn)

    vLLM captures the *input* of layer ``id`` (hs_dataset layer ``id - 1``); id ``L`` is the last
    layer's output **before** the final norm: the trainer feeds ``hidden_states[:, :-1]`` to the
    drafter and applies its ``verifier_norm`` to ``hidden_states[:, -1]`` (``models/eagle3/core.py``).
    So the entries are hs_dataset layers ``target_layer_ids - 1`` and ``L - 1``; the default
    ``[2, L//2, L-3] + [L]`` is hs_dataset's ``[1, L//2-1, L-4, L-1]``. The import stores the last
    entry as ``hidden_layer_{L-1}`` and computes ``hidden_final`` with the model's final norm
    (:mod:`hs_dataset.interop.final_norm`); FP8 files are dequantized as hs-connectors' reader
    does (``fp8.to(bf16) * scale.to(bf16)``, in bf16).

Legacy (<= 0.4: ``scripts/data_generation_offline.py``, ``custom_worker.py``)
    ``OUT/data_{i}.pt``: ``input_ids``, ``loss_mask``, ``hidden_states`` = list of ``[T, H]``, one per
    ``--layer-ids``, captured as the *output* of layer id before any norm (hs_dataset's own ids),
    default ``[2, L//2, L-3, L-1]``; ``OUT/data_config.json`` (``hidden_states.layer_ids``) records
    them. The last entry is again the pre-norm last layer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hs_dataset.errors import SampleError
from hs_dataset.interop.common import (ExportFrame, ExportSummary, ImportedSample, InteropError, Peek, SourceFile,
                                       few, index_of, read_sidecar, torch_load)
from hs_dataset.interop.importer import _UNREADABLE, ForeignSource

__all__ = ["export_speculators", "fp8_dequantize", "fp8_quantize", "speculators_source"]

HS_DIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
SCALES_KEY = "hidden_states_scales"


def fp8_quantize(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hs-connectors' ``quantize_tensor_to_fp8``: one fp32 scale per token (dim 0) over the other dims, amax / 448.
    -> (float8_e4m3fn states, scale ``[T, 1, ...]``)."""
    x = states.float()
    amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    scale = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


def fp8_dequantize(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """hs-connectors' ``dequantize_fp8_tensor``: ``fp8.to(bf16) * scale.to(bf16)`` (scale ``[T, 1, 1]``)."""
    return fp8.to(torch.bfloat16) * scale.reshape(scale.shape[0], *([1] * (fp8.dim() - 1))).to(torch.bfloat16)


def export_speculators(src: str | os.PathLike, out: str | os.PathLike, *,
                       layers: Iterable[int] | None = None) -> ExportSummary:
    """Write the build ``src`` as speculators' preprocessed dataset + ``hidden_states/hs_{i}.safetensors``.

    Args:
        src: a finished build directory; it must store layer ``L-1`` (the last layer's output
            before the final norm), which speculators' files carry as their last entry.
        out: a new (or empty) directory: pass it to ``speculators train --data-path``.
        layers: the stored layers to write before it (default: every stored layer but ``L-1``).

    An fp8 build (``storage_dtype="fp8_e4m3"``) is written in hs-connectors' FP8 layout (:func:`fp8_quantize`),
    a bf16 build in bf16.

    Raises:
        InteropError: not a finished build, ``out`` not empty, or layer ``L-1`` not stored.
    """

    x = ExportFrame("speculators", src, out, layers)
    last = x.num_layers - 1
    want = sorted(set(x.stored) | {last})
    x.require(last in x.stored, f"speculators' files end with the verifier's last layer before the final norm "
                                f"(hs_dataset layer {last}); {x.src} stores {x.stored}: build with layers={want} "
                                f"(--set layers={want}) and export again")
    x.require(last not in x.aux, f"layer {last} is written as the last entry: leave it out of --layers")
    cols = x.aux_columns() + [f"hidden_layer_{last}"]
    hs_dir = x.out / HS_DIR
    fp8 = x.meta.get("storage_dtype") == "fp8_e4m3"
    if fp8:
        x.warnings.append("fp8 build: written in hs-connectors' FP8 layout (hidden_states float8_e4m3fn + "
                          f"{SCALES_KEY} fp32 [T, 1, 1], one scale per token over all states), re-rounded from the "
                          "build's per-state scales; speculators' reader dequantizes it")
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    for i, row in enumerate(x.rows(cols)):
        if i == 0:
            hs_dir.mkdir(parents=True)
        ids = row["input_ids"].to(torch.long)
        mask = row["loss_mask"].to(torch.long)
        states = torch.stack([row[c] for c in cols], dim=1).contiguous()
        tensors = {"hidden_states": states, "token_ids": ids}
        if fp8:  # hs-connectors' FP8HiddenStatesConnector layout, which speculators' reader dequantizes
            tensors["hidden_states"], tensors[SCALES_KEY] = fp8_quantize(states)
        x.save(tensors, hs_dir / f"hs_{i}.safetensors", save_file)
        rows["input_ids"].append(ids.numpy())
        rows["loss_mask"].append(mask.numpy())
        rows["seq_len"].append(int(ids.shape[0]))
        u, c = ids[mask.bool()].unique(return_counts=True)
        for t, n in zip(u.tolist(), c.tolist()):
            freq[t] = freq.get(t, 0) + n
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                  "loss_mask": datasets.List(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict(rows, features=features)
    ds.set_format(type="torch")  # as prepare-data saves it: rows come back as int64 tensors
    ds.save_to_disk(str(x.out))
    x.save(freq, x.out / TOKEN_FREQ_FILE, torch.save)
    return x.finish(x.aux + [last], vllm_target_layer_ids=[k + 1 for k in x.aux] + [x.num_layers])


def _hs_files(hs_dir: Path) -> dict[int, Path]:
    out = {}
    for p in hs_dir.glob("hs_*.safetensors"):
        i = index_of(p, "hs_")
        if i is not None:
            out[i] = p
    return out


def _refuse_modelopt(src: Path, pts: list[Path]) -> None:
    """A folder of ModelOpt dumps (``*.pt`` too) is refused as such, not read as data_<i>.pt files."""
    for p in pts[:3]:  # the first readable file decides; a corrupt one is left to the per-file rejects
        try:
            keys = set(torch_load(p))
        except _UNREADABLE:
            continue
        if "aux_hidden_states" in keys:
            raise InteropError(f"{src} looks like a ModelOpt dump ({p.name} holds aux_hidden_states, which "
                               "speculators' data_<i>.pt files do not): use --from modelopt")
        return


def _legacy_source(src: Path, L: int) -> ForeignSource:
    pts = sorted((p for p in src.rglob("*.pt") if p.name != TOKEN_FREQ_FILE), key=lambda p: (index_of(p, "data_")
                 if index_of(p, "data_") is not None else -1, str(p)))
    if not pts:
        raise InteropError(f"{src}: no speculators data (hidden_states/hs_<i>.safetensors or data_<i>.pt files)")
    _refuse_modelopt(src, pts)
    files = [SourceFile(k, p, f"speculators:{index_of(p, 'data_') if index_of(p, 'data_') is not None else k}")
             for k, p in enumerate(pts)]
    cfg_path = src / "data_config.json"
    if cfg_path.exists():
        layers = tuple(json.loads(cfg_path.read_text())["hidden_states"]["layer_ids"])
        where = f"{cfg_path} hidden_states.layer_ids"
    else:
        layers, where = (2, L // 2, L - 3, L - 1), "the legacy speculators default [2, L//2, L-3, L-1]"

    def load(f: SourceFile) -> tuple[dict[str, Any], list[torch.Tensor]]:
        d = torch_load(f.path)
        hs = d["hidden_states"]
        return d, list(hs) if isinstance(hs, (list, tuple)) else list(hs.unbind(0))

    def peek(f: SourceFile) -> Peek:
        d, hs = load(f)
        T = hs[0].shape[0]
        if any(tuple(h.shape) != tuple(hs[0].shape) for h in hs) or d["input_ids"].numel() != T:
            raise SampleError("hidden_states", f"{len(hs)} states of shapes {few(tuple(h.shape) for h in hs)} for "
                                               f"{d['input_ids'].numel()} input_ids (want [T, H] per layer)")
        return Peek(d["input_ids"].reshape(-1).clone(), d["loss_mask"].reshape(-1).clone(), len(hs), hs[0].shape[-1])

    def read(f: SourceFile) -> ImportedSample:
        d, hs = load(f)
        return ImportedSample(d["input_ids"].reshape(-1), torch.stack([h.to(torch.bfloat16) for h in hs]))

    return ForeignSource("speculators", files, peek, read, layers, where, last="prenorm",
                         options={"era": "legacy data_<i>.pt"})


def speculators_source(src: Path, L: int) -> ForeignSource:
    """The import reader of a speculators data directory (``L``: the model's decoder layers).

    ``src`` is the preprocessed-data directory (with ``hidden_states/``), the ``hidden_states``
    folder itself (the dataset is then its parent), or a legacy folder of ``data_<i>.pt`` files.
    """

    hs_dir, ds_dir = (src / HS_DIR, src) if (src / HS_DIR).is_dir() else (src, src.parent)
    found = _hs_files(hs_dir)
    if not found:
        return _legacy_source(src, L)
    if not (ds_dir / "state.json").exists() and not (ds_dir / "dataset_info.json").exists():
        raise InteropError(f"{hs_dir} holds speculators hidden-state files but {ds_dir} is not the preprocessed "
                           "dataset they belong to (it carries the loss masks): pass the preprocessed-data directory, "
                           "whose hidden_states/ folder holds hs_<i>.safetensors")
    ds = datasets.load_from_disk(str(ds_dir))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    for c in ("input_ids", "loss_mask"):
        if c not in ds.column_names:
            raise InteropError(f"preprocessed dataset {ds_dir} has no {c!r} column (columns: {few(ds.column_names, 6)})")
    beyond = [i for i in found if i >= len(ds)]
    if beyond:
        raise InteropError(f"{found[beyond[0]]} is beyond the {len(ds)} rows of the preprocessed dataset {ds_dir}")
    table = ds.with_format("numpy", columns=["input_ids", "loss_mask"])
    files = [SourceFile(i, found.get(i, hs_dir / f"hs_{i}.safetensors"), f"speculators:{i}") for i in range(len(ds))]
    errors = {i: ("file", f"{f.path}: no hidden-states file for row {i} of {ds_dir}")
              for i, f in enumerate(files) if i not in found}
    side = read_sidecar(ds_dir, "speculators")
    if side and len(side.get("ids", [])) == len(files):
        for f, sid in zip(files, side["ids"]):
            f.sample_id = sid

    def row(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = table[i]
        return (torch.as_tensor(np.asarray(r["input_ids"]).reshape(-1)).long(),
                torch.as_tensor(np.asarray(r["loss_mask"]).reshape(-1)).long())

    def check_tokens(f: SourceFile, token_ids: torch.Tensor, ids: torch.Tensor) -> None:
        if not torch.equal(token_ids.reshape(-1).long(), ids):  # ArrowDataset skips such a sample
            raise SampleError("token_ids", f"do not match input_ids of row {f.index} of the preprocessed dataset")

    def peek(f: SourceFile) -> Peek:
        with safe_open(str(f.path), framework="pt") as st:
            T, n, H = st.get_slice("hidden_states").get_shape()
            tokens = st.get_tensor("token_ids")
        ids, mask = row(f.index)
        check_tokens(f, tokens, ids)
        if tokens.numel() != T:
            raise SampleError("hidden_states", f"{T} states for {tokens.numel()} token_ids")
        return Peek(ids, mask, n, H)

    def read(f: SourceFile) -> ImportedSample:
        d = load_file(str(f.path))
        hs = d["hidden_states"]  # [T, n, H]
        if SCALES_KEY in d:
            hs = fp8_dequantize(hs, d[SCALES_KEY])
        ids, _ = row(f.index)
        check_tokens(f, d["token_ids"], ids)
        return ImportedSample(ids, hs.to(torch.bfloat16).transpose(0, 1).contiguous())

    if side.get("layers"):
        layers, where = tuple(side["layers"]), f"{ds_dir}/hs_dataset_export.json"
    else:
        layers, where = (1, L // 2 - 1, L - 4, L - 1), "vLLM's default ids [2, L//2, L-3, L] minus 1"
    return ForeignSource("speculators", files, peek, read, layers, where, last="prenorm", errors=errors,
                         options={"era": "hidden_states/hs_<i>.safetensors"})

"""Interop with the offline hidden-state layouts of SpecForge and vLLM speculators.

``hs-dataset export DIR --to specforge OUT`` and ``hs-dataset import SRC --from specforge|speculators OUT``.

SpecForge (``sgl-project/SpecForge``: ``scripts/prepare_hidden_states.py`` writes,
``specforge/data/preprocessing.py`` ``OfflineEagle3Dataset`` reads)
    ``OUT/rows_{g}-{g + 2000}/data_{i}.ckpt`` for sample ``i`` (``g = i // 2000 * 2000``; the group
    size is ``--file-group-size``, 2000 by default; older versions used 5000), each a
    ``torch.save``'d dict (zipfile format, so ``torch.load(..., mmap=True)`` works)::

        input_ids         int64 [T]
        loss_mask         int64 [T]
        hidden_state      bf16  [1, T, H]        the final post-norm state (a batch dim of 1)
        aux_hidden_state  bf16  [1, T, n * H]    the captured layers, concatenated along the last dim

    The reader squeezes the batch dim, takes ``aux_hidden_state`` as the drafter input and
    ``hidden_state`` as the target; it lists ``*.ckpt`` (and ``*.ckpt.gz``) files recursively,
    so other files in ``OUT`` are ignored. Its default aux layers are ``[1, L//2 - 1, L - 4]``
    passed to SGLang's ``set_eagle3_layers_to_capture``, which (llama family) captures them at
    the input of layer ``id + 1``: the same ids in hs_dataset's convention (output of layer k).

vLLM speculators (``vllm-project/speculators``: ``scripts/data_generation_offline.py`` with the
hidden-states KV connector writes, ``src/speculators/train/data.py`` reads)
    ``DATA/`` is the preprocessed dataset (``save_to_disk``: ``input_ids``, ``loss_mask``, ...),
    ``DATA/hidden_states/hs_{i}.safetensors`` the states of row ``i``::

        hidden_states         bf16 [T, n + 1, H]   the aux layers, then the verifier's last layer
        token_ids             int64 [T]            must equal the dataset's input_ids
        hidden_states_scales  fp32 [T, 1]          only in FP8 files (fp8 e4m3 hidden_states,
                                                   one scale per token over all layers)

    The trainer feeds ``hidden_states[:, :-1].flatten(1)`` to the drafter and applies the
    verifier's ``lm_head`` straight to ``hidden_states[:, -1]`` (no norm): the last entry is the
    final post-norm state (``fp8_hidden_states_connector.py``, ``custom_worker.py``: the last
    layer is captured after the final norm). Layer ids are vLLM's aux-layer ids, captured at the
    *input* of decoder layer ``id``, i.e. hs_dataset layer ``id - 1``; the default
    ``[2, L//2, L - 3]`` is hs_dataset's ``[1, L//2 - 1, L - 4]``. The older sample-file format
    (``*.pt``: ``input_ids``, ``loss_mask``, ``hidden_states`` = list of ``[T, H]``, last = final)
    is read too.

Imports go through :func:`hs_dataset.shard_writer.build` with a capture backend that reads the source
files, so the rows, shards, ``hs_dataset.json``, ``README.md`` and ``rejects.jsonl`` are written
by the same code as a normal build (and the import is resumable). ``layers`` are given in
hs_dataset's convention (see :mod:`hs_dataset.backends.base`).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from .backends.base import ModelInfo, check_layers, read_model_info
from .layout import FINAL_COLUMN, META_FILE, STATE_DIR, layer_of
from .errors import InteropError
from .records import CaptureResult, Reject, TokenizedSample

SPECFORGE_GROUP_SIZE = 2000
EXPORT_SIDECAR = "hs_dataset_export.json"
IMPORT_FORMATS = ("specforge", "speculators")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """SpecForge's and speculators' default EAGLE-3 aux layers, in hs_dataset's convention."""
    return (1, num_layers // 2 - 1, num_layers - 4)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@dataclass
class ExportSummary:
    output_dir: str
    samples: int
    files: int
    bytes_written: int
    seconds: float


def specforge_file(out: str | os.PathLike, index: int, group_size: int = SPECFORGE_GROUP_SIZE) -> Path:
    """Where SpecForge keeps sample ``index``: ``out/rows_{g}-{g + group_size}/data_{index}.ckpt``."""
    g = index // group_size * group_size
    return Path(out) / f"rows_{g}-{g + group_size}" / f"data_{index}.ckpt"


def specforge_record(row: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One decoded row (:func:`hs_dataset.reader.decode_row`) as SpecForge's per-sample dict."""
    layer_cols = sorted((c for c in row if layer_of(c) is not None), key=layer_of)
    return {
        "input_ids": row["input_ids"].to(torch.long),
        "loss_mask": row["loss_mask"].to(torch.long),
        "hidden_state": row[FINAL_COLUMN].unsqueeze(0),
        "aux_hidden_state": torch.cat([row[c] for c in layer_cols], dim=-1).unsqueeze(0),
    }


def export_specforge(src: str | os.PathLike, out: str | os.PathLike, *, group_size: int = SPECFORGE_GROUP_SIZE,
                     on_sample: Callable[[int], None] | None = None) -> ExportSummary:
    """Write the build directory ``src`` in SpecForge's offline layout under ``out``.

    Sample ``i`` (in dataset order) goes to :func:`specforge_file`; ``out/hs_dataset_export.json``
    records the sample ids, layers (hs_dataset convention), model and source, so that
    :func:`import_dataset` restores the ids and layers. fp8-stored datasets are decoded to bf16.
    """
    from .resume import atomic_write
    from .reader import iter_torch, open_dataset

    t0 = time.time()
    src, out = Path(src), Path(out)
    meta_path = src / META_FILE
    if not meta_path.exists():
        raise InteropError(f"{src} is not a finished hs_dataset build (no {META_FILE})")
    if group_size < 1:
        raise InteropError(f"group size must be >= 1, got {group_size}")
    if out.exists() and any(out.iterdir()):
        raise InteropError(f"{out} exists and is not empty: export into a new directory")
    meta = json.loads(meta_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    ids: list[str] = []
    nbytes = 0
    dirs: set[Path] = set()
    for i, row in enumerate(iter_torch(open_dataset(src), batch_size=4)):
        path = specforge_file(out, i, group_size)
        if path.parent not in dirs:
            path.parent.mkdir(exist_ok=True)
            dirs.add(path.parent)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(specforge_record(row), tmp)
        os.replace(tmp, path)
        nbytes += path.stat().st_size
        ids.append(row["id"])
        if on_sample is not None:
            on_sample(i)
    sidecar = {
        "format": "specforge",
        "group_size": group_size,
        "source": str(src.resolve()),
        "model": meta["model"],
        "layers": meta["layers"],
        "layer_convention": meta["layer_convention"],
        "storage_dtype": meta["storage_dtype"],
        "tokenizer": meta.get("tokenizer", {}).get("path"),
        "ids": ids,
    }
    atomic_write(out / EXPORT_SIDECAR, json.dumps(sidecar))
    return ExportSummary(str(out), len(ids), len(ids), nbytes, time.time() - t0)


# ---------------------------------------------------------------------------------------------
# Reading the foreign layouts
# ---------------------------------------------------------------------------------------------


@dataclass
class SourceFile:
    """One sample of a foreign layout: its file and its index in that layout."""

    index: int
    path: Path
    sample_id: str | None = None


@dataclass
class ImportedSample:
    input_ids: torch.Tensor  # int [T]
    loss_mask: torch.Tensor  # int [T]
    states: torch.Tensor  # bf16 [n_aux + 1, T, H]: the aux layers, then the final state


def _index_of(path: Path, prefix: str) -> int | None:
    m = re.fullmatch(re.escape(prefix) + r"(\d+)", path.name.split(".", 1)[0])
    return int(m.group(1)) if m else None


def _torch_load(path: Path) -> dict[str, Any]:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True, map_location="cpu")
    return torch.load(path, mmap=True, weights_only=True, map_location="cpu")


def list_specforge(src: str | os.PathLike) -> list[SourceFile]:
    """SpecForge's ``data_{i}.ckpt`` (or ``.ckpt.gz``) files under ``src``, by sample index."""
    files = []
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith((".ckpt", ".ckpt.gz")):
                p = Path(root) / name
                i = _index_of(p, "data_")
                if i is None:
                    raise InteropError(f"{p}: not a SpecForge sample file name (expected data_<index>.ckpt)")
                files.append(SourceFile(i, p))
    files.sort(key=lambda f: f.index)
    for a, b in zip(files, files[1:]):
        if a.index == b.index:
            raise InteropError(f"sample {a.index} is stored twice: {a.path} and {b.path}")
    return files


@dataclass
class Peek:
    """A sample's tokens and the shape of its states, read without reading the states."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    num_states: int  # aux layers + final
    hidden_size: int


def _specforge_parts(f: SourceFile) -> tuple[dict[str, Any], int, int, int]:
    d = _torch_load(f.path)  # memory-mapped: nothing of the states is read yet
    missing = {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"} - set(d)
    if missing:
        raise InteropError(f"{f.path}: missing keys {sorted(missing)} (was it made with --enable-aux-hidden-states?)")
    H = d["hidden_state"].shape[-1]
    T = d["hidden_state"].numel() // H
    width = d["aux_hidden_state"].shape[-1]
    if width % H or d["aux_hidden_state"].numel() != T * width:
        raise InteropError(f"{f.path}: aux_hidden_state {tuple(d['aux_hidden_state'].shape)} does not fit "
                           f"hidden_state {tuple(d['hidden_state'].shape)}")
    return d, T, H, width // H


def _tokens(d: dict[str, Any], T: int, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = d["input_ids"].reshape(-1), d["loss_mask"].reshape(-1)
    if ids.shape[0] < T or mask.shape[0] != ids.shape[0]:
        raise InteropError(f"{path}: {ids.shape[0]} input_ids and {mask.shape[0]} loss_mask values for {T} states")
    return ids[:T], mask[:T]  # a batch-padded input_ids (SpecForge batches before saving) keeps its pad tail out


def peek_specforge(f: SourceFile) -> Peek:
    d, T, H, n = _specforge_parts(f)
    ids, mask = _tokens(d, T, f.path)
    return Peek(ids.clone(), mask.clone(), n + 1, H)


def read_specforge(f: SourceFile) -> ImportedSample:
    d, T, H, n = _specforge_parts(f)
    ids, mask = _tokens(d, T, f.path)
    states = torch.empty((n + 1, T, H), dtype=torch.bfloat16)
    states[:n] = d["aux_hidden_state"].reshape(T, n, H).transpose(0, 1)
    states[n] = d["hidden_state"].reshape(T, H)
    return ImportedSample(ids, mask, states)


@dataclass
class _Speculators:
    files: list[SourceFile]
    dataset: Any  # datasets.Dataset with input_ids / loss_mask, or None (legacy .pt files carry both)


def _find_speculators(src: Path) -> _Speculators:
    import datasets

    hs_dir, ds_dir = (src / "hidden_states", src) if (src / "hidden_states").is_dir() else (src, src.parent)
    st = sorted(hs_dir.glob("hs_*.safetensors"))
    if st:
        files = []
        for p in st:
            i = _index_of(p, "hs_")
            if i is not None:
                files.append(SourceFile(i, p))
        files.sort(key=lambda f: f.index)
        if not (ds_dir / "state.json").exists() and not (ds_dir / "dataset_info.json").exists():
            raise InteropError(
                f"{hs_dir} holds speculators hidden-state files but {ds_dir} is not the preprocessed dataset "
                "they belong to (it carries the loss masks): pass the preprocessed-data directory, whose "
                "hidden_states/ folder holds hs_<i>.safetensors")
        ds = datasets.load_from_disk(str(ds_dir))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        for c in ("input_ids", "loss_mask"):
            if c not in ds.column_names:
                raise InteropError(f"preprocessed dataset {ds_dir} has no {c!r} column (columns: {ds.column_names})")
        if files and files[-1].index >= len(ds):
            raise InteropError(f"{files[-1].path} is beyond the {len(ds)} rows of the preprocessed dataset {ds_dir}")
        return _Speculators(files, ds.with_format("numpy", columns=["input_ids", "loss_mask"]))
    pts = []
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".pt"):
                pts.append(Path(root) / name)
    if not pts:
        raise InteropError(f"{src}: no speculators data (hidden_states/hs_<i>.safetensors or sample *.pt files)")
    files = []
    for p in pts:
        m = re.search(r"(\d+)$", p.name[:-3])
        files.append(SourceFile(int(m.group(1)) if m else -1, p))
    files.sort(key=lambda f: (f.index, str(f.path)))
    return _Speculators([SourceFile(k, f.path) for k, f in enumerate(files)], None)


def _peek_speculators(spec: _Speculators, f: SourceFile) -> Peek:
    if f.path.suffix == ".pt":
        d = torch.load(f.path, mmap=True, weights_only=True, map_location="cpu")
        hs = d["hidden_states"]
        n, H = (len(hs), hs[0].shape[-1]) if isinstance(hs, (list, tuple)) else (hs.shape[0], hs.shape[-1])
        return Peek(d["input_ids"].reshape(-1).clone(), d["loss_mask"].reshape(-1).clone(), n, H)
    from safetensors import safe_open

    with safe_open(str(f.path), framework="pt") as st:
        T, n, H = st.get_slice("hidden_states").get_shape()
        tokens = st.get_tensor("token_ids").reshape(-1)
    row = spec.dataset[f.index]
    ids = torch.as_tensor(np.asarray(row["input_ids"]).reshape(-1))
    if tokens.shape[0] != T or not torch.equal(tokens.to(torch.long), ids.to(torch.long)):
        raise InteropError(f"{f.path}: token_ids do not match input_ids of row {f.index} of the preprocessed dataset")
    return Peek(ids, torch.as_tensor(np.asarray(row["loss_mask"]).reshape(-1)).to(torch.uint8), n, H)


def _read_speculators(spec: _Speculators, f: SourceFile) -> ImportedSample:
    if f.path.suffix == ".pt":
        d = torch.load(f.path, mmap=True, weights_only=True, map_location="cpu")
        hs = d["hidden_states"]
        states = torch.stack([h.to(torch.bfloat16) for h in hs]) if isinstance(hs, (list, tuple)) else hs
        return ImportedSample(d["input_ids"].reshape(-1), d["loss_mask"].reshape(-1), states)
    from safetensors.torch import load_file

    d = load_file(str(f.path))
    hs = d["hidden_states"]  # [T, n + 1, H]
    if hs.dtype == torch.float8_e4m3fn:
        scale = d["hidden_states_scales"].float()
        hs = (hs.float() * scale.reshape(scale.shape[0], *([1] * (hs.dim() - 1)))).to(torch.bfloat16)
    elif hs.dtype != torch.bfloat16:
        hs = hs.to(torch.bfloat16)
    row = spec.dataset[f.index]
    ids = torch.as_tensor(np.asarray(row["input_ids"]).reshape(-1))
    if not torch.equal(d["token_ids"].reshape(-1).to(torch.long), ids.to(torch.long)):
        raise InteropError(f"{f.path}: token_ids do not match input_ids of row {f.index} of the preprocessed dataset")
    return ImportedSample(ids, torch.as_tensor(np.asarray(row["loss_mask"]).reshape(-1)),
                          hs.transpose(0, 1).contiguous())


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


class FileCaptureBackend:
    """A capture backend whose "capture" reads already-extracted states from files.

    Samples arrive from the build's source (an index JSONL written by :func:`import_dataset`) with
    ids ``"<name>:<row>"``; row ``k`` is ``files[k]``. Each result carries the original sample id.
    """

    def __init__(self, fmt: str, info: ModelInfo, layers: tuple[int, ...], files: list[SourceFile],
                 read: Callable[[SourceFile], ImportedSample], source_name: str):
        self.name = f"import-{fmt}"
        self.continuous = False
        self.encodings = ("bfloat16",)
        self.info = info
        self.layers = tuple(layers)
        self._files = files
        self._read = read
        self._prefix = f"{source_name}:"

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CaptureResult | Reject]:
        for s in samples:
            f = self._files[int(s.sample_id[len(self._prefix):])]
            sid = f.sample_id or s.sample_id
            try:
                got = self._read(f)
            except (InteropError, OSError, RuntimeError, KeyError) as e:
                yield Reject(sid, "file", f"{f.path}: {e}", "import")
                continue
            n = s.num_tokens
            if got.states.shape[0] != len(self.layers) + 1 or got.states.shape[2] != self.info.hidden_size:
                raise InteropError(
                    f"{f.path}: states of shape {tuple(got.states.shape)} (states, tokens, hidden) do not fit "
                    f"{len(self.layers)} layers + final of hidden size {self.info.hidden_size}")
            if got.states.shape[1] != n or not torch.equal(got.input_ids[:n].to(torch.long),
                                                           torch.from_numpy(s.input_ids).to(torch.long)):
                yield Reject(sid, "input_ids", f"{f.path}: tokens changed since the import index was written", "import")
                continue
            yield CaptureResult(TokenizedSample(sid, s.input_ids, s.loss_mask, s.truncated), self.layers, got.states)

    def versions(self) -> dict[str, str]:
        return {"import": self.name}

    def close(self) -> None:
        pass


@dataclass
class ImportSummary:
    output_dir: str
    samples: int
    written: int
    rejected: int
    bytes_written: int
    seconds: float


def import_dataset(src: str | os.PathLike, fmt: str, out: str | os.PathLike, *, model: str | None = None,
                   layers: Iterable[int] | None = None, storage_dtype: str = "bfloat16", file_format: str = "arrow",
                   part_size: int = 256, progress: bool = False, build_command: str | None = None,
                   trust_remote_code: bool = False) -> ImportSummary:
    """Import SpecForge or speculators hidden states from ``src`` into a build directory ``out``.

    ``model``: the target model's local directory (config.json + tokenizer; the weights are not
    needed), which sizes and describes the dataset; default: the model recorded by an
    ``hs-dataset export``. ``layers``: the captured layers in hs_dataset's convention; default:
    the ones recorded by ``hs-dataset export``, else :func:`default_layers` (the two tools' default).
    ``trust_remote_code``: the model's tokenizer is its own code (Kimi-K2.5), recorded like a build's.
    """
    from .shard_writer import build
    from .dataset_builder import HiddenStatesConfig
    from .encode import check_storage_dtype

    if fmt not in IMPORT_FORMATS:
        raise InteropError(f"unknown format {fmt!r}: use one of {', '.join(IMPORT_FORMATS)}")
    check_storage_dtype(storage_dtype)
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise InteropError(f"{src} is not a directory")
    sidecar = json.loads((src / EXPORT_SIDECAR).read_text()) if (src / EXPORT_SIDECAR).exists() else {}
    if fmt == "specforge":
        files = list_specforge(src)
        read: Callable[[SourceFile], ImportedSample] = read_specforge
        peek: Callable[[SourceFile], Peek] = peek_specforge
    else:
        spec = _find_speculators(src)
        files = spec.files
        read = lambda f: _read_speculators(spec, f)  # noqa: E731
        peek = lambda f: _peek_speculators(spec, f)  # noqa: E731
    if not files:
        raise InteropError(f"{src}: no {fmt} sample files found")
    ids = sidecar.get("ids")
    if ids is not None and len(ids) == len(files) and [f.index for f in files] == list(range(len(files))):
        for f, sid in zip(files, ids):
            f.sample_id = sid
    else:
        for f in files:
            f.sample_id = f"{fmt}:{f.index}"
    if model is None:
        model = (sidecar.get("model") or {}).get("path")
        if not model:
            raise InteropError("pass --model: the target model's directory (config.json and tokenizer)")
    info = read_model_info(model)
    if layers is None:
        layers = sidecar.get("layers") or default_layers(info.num_layers)
    try:
        layers = check_layers(layers, info)
    except ValueError as e:
        raise InteropError(f"{e}; pass --layers: the {fmt} files' aux layers in hs_dataset's convention") from None

    # The index the build reads as its source: one raw-token row per file, in source order.
    state = out / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    name = f"import-{fmt}"
    index = state / f"{name}.jsonl"
    max_len = 1
    lines = []
    for f in files:
        try:
            p = peek(f)
        except InteropError:
            raise
        except Exception as e:  # unreadable file: the backend rejects it, with the reason
            lines.append(json.dumps({"input_ids": [0], "loss_mask": [1], "file": str(f.path), "error": repr(e)}))
            continue
        if p.hidden_size != info.hidden_size:
            raise InteropError(f"{f.path}: hidden size {p.hidden_size}, but {model} has {info.hidden_size}")
        if p.num_states != len(layers) + 1:
            raise InteropError(f"{f.path} holds {p.num_states - 1} aux layers + final, but layers={list(layers)} "
                               f"names {len(layers)}: pass --layers with {p.num_states - 1} ids")
        ids_ = p.input_ids.tolist()
        max_len = max(max_len, len(ids_))
        lines.append(json.dumps({"input_ids": ids_, "loss_mask": [int(v) for v in p.loss_mask.tolist()],
                                 "file": str(f.path)}))
    text = "".join(line + "\n" for line in lines)
    if not index.exists() or index.read_text() != text:
        tmp = index.with_name(f".{index.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, index)
    config = HiddenStatesConfig(model=str(model), layers=layers, source=str(index), max_length=max_len,
                                truncation="reject", backend=name, storage_dtype=storage_dtype,
                                file_format=file_format, part_size=part_size, trust_remote_code=trust_remote_code,
                                backend_options={"from": fmt, "path": str(src.resolve())})
    backend = FileCaptureBackend(fmt, info, layers, files, read, name)
    s = build(config, out, backend=backend, progress=progress,
              build_command=build_command or f"hs-dataset import {src} --from {fmt} {out}")
    return ImportSummary(s.output_dir, s.counts.samples_in, s.counts.written, s.counts.rejected, s.bytes_written,
                         s.seconds)


__all__ = ["EXPORT_SIDECAR", "ExportSummary", "FileCaptureBackend", "ImportSummary", "InteropError",
           "SPECFORGE_GROUP_SIZE", "default_layers", "export_specforge", "import_dataset", "list_specforge",
           "peek_specforge", "read_specforge", "specforge_file", "specforge_record"]

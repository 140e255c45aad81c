"""The import driver: a format's reader (:class:`ForeignSource`) -> a normal hs_dataset build.

Imports go through :func:`hs_dataset.write.driver.build` with a capture backend that reads the
source files, so the rows, shards, ``hs_dataset.json``, ``README.md`` and ``rejects.jsonl`` are
written by the same code as a normal build, and an import is resumable like one.

Before the build, every file is *peeked* (tokens and shapes, not the states) and checked: a bad
file (unreadable, wrong hidden size or layer count, token ids outside the vocabulary, mismatched
token ids...) becomes one reject with the sample id it would have had, never an abort of the
whole import; only when no file at all is usable does the import stop, with the first reason.
Then, still before anything is written, ``--model`` is checked against a few samples' states
(:mod:`hs_dataset.interop.model_check`): the right shapes do not make the right model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from hs_dataset.atomic import atomic_write
from hs_dataset.write.driver import build
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import InteropError, SampleError
from hs_dataset.interop.common import ImportedSample, Peek, SourceFile
from hs_dataset.interop.final_norm import FinalNorm, load_final_norm
from hs_dataset.interop.file_check import check_same_source, fingerprint, spread
from hs_dataset.interop.model_check import CHECK_SAMPLES, check_model as model_check
from hs_dataset.layout import STATE_DIR, FileFormat, StorageDtype
from hs_dataset.model_info import ModelInfo, check_layers, read_model_info
from hs_dataset.prepare.tokenizer import load_tokenizer
from hs_dataset.records import CaptureResult, Reject, TokenizedSample

__all__ = ["FileCaptureBackend", "ForeignSource", "ImportSummary", "run_import"]

# A corrupt file can make its parser (torch's unpickler, safetensors, gzip) raise nearly anything: it is
# one reject, with the exception in its reason.
_UNREADABLE = Exception


@dataclass
class ForeignSource:
    """What a format's reader gives the driver.

    ``layers``: the layers of the files' entries in hs_dataset's convention, as the format records
    them (sidecar, ``data_config.json``) or its default; ``layers_from`` says which. ``last``:
    the files' last entry is ``hidden_final`` (``"final"``), or layer ``L-1`` before the final norm
    (``"prenorm"``: then ``layers`` ends with ``L-1`` and ``hidden_final`` is computed).
    ``errors``: samples known bad before peeking (row -> field, reason).
    """

    fmt: str
    files: list[SourceFile]
    peek: Callable[[SourceFile], Peek]
    read: Callable[[SourceFile], ImportedSample]
    layers: tuple[int, ...]
    layers_from: str
    last: Literal["final", "prenorm"] = "final"
    options: dict[str, Any] = field(default_factory=dict)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)


@dataclass
class ImportSummary:
    output_dir: str
    samples: int
    written: int
    rejected: int
    bytes_written: int
    seconds: float
    notes: list[str] = field(default_factory=list)


class FileCaptureBackend:
    """A capture backend whose "capture" reads already-extracted states from files.

    Row ``k`` of the import index is ``files[k]``; ``errors[k]`` holds the reject of a file the
    peek found bad. Each result and reject carries the file's own sample id.
    """

    def __init__(self, src: ForeignSource, info: ModelInfo, layers: tuple[int, ...], norm: FinalNorm | None):
        self.name = f"import-{src.fmt}"
        self.continuous = False
        self.encodings: tuple[StorageDtype, ...] = ("bfloat16",)
        self.info = info
        self.layers = tuple(layers)
        self._src = src
        self._norm = norm

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CaptureResult | Reject]:
        for s in samples:
            index = s.sample_id.rpartition(":")[2]  # <the index's name>:<row>
            if ":" not in s.sample_id or not index.isdigit() or int(index) >= len(self._src.files):
                # a sample of no file (the build's model probe, hs_dataset.capture.fingerprint): nothing to read
                yield Reject(s.sample_id, "input_ids", "not a file of this import", "import")
                continue
            k = int(index)
            f = self._src.files[k]
            if k in self._src.errors:
                fld, reason = self._src.errors[k]
                yield Reject(f.sample_id, fld, reason, "import")
                continue
            try:
                got = self._src.read(f)
            except SampleError as e:
                yield Reject(f.sample_id, e.field, f"{f.path}: {e.reason}", "import")
                continue
            except _UNREADABLE as e:
                yield Reject(f.sample_id, "file", f"{f.path}: {e}", "import")
                continue
            states = got.states
            if self._norm is not None:
                states = torch.cat([states, self._norm(states[-1]).unsqueeze(0)])
            n = s.num_tokens
            if (tuple(states.shape) != (len(self.layers) + 1, n, self.info.hidden_size)
                    or not torch.equal(got.input_ids.reshape(-1).to(torch.long), torch.from_numpy(s.input_ids).long())):
                yield Reject(f.sample_id, "file", f"{f.path}: changed since the import index was written", "import")
                continue
            yield CaptureResult(TokenizedSample(f.sample_id, s.input_ids, s.loss_mask, s.truncated), self.layers,
                                states.to(torch.bfloat16))

    def versions(self) -> dict[str, str]:
        return {"import": self.name}

    def close(self) -> None:
        pass


def _check_tokens(p: Peek, vocab: int) -> None:
    ids, mask = p.input_ids.reshape(-1), p.loss_mask.reshape(-1)
    if ids.numel() == 0:
        raise SampleError("input_ids", "no tokens")
    if mask.shape != ids.shape:
        raise SampleError("loss_mask", f"{mask.numel()} values for {ids.numel()} input_ids")
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if bad.numel():
        j = int(bad[0])
        raise SampleError(f"input_ids[{j}]", f"token id {int(ids[j])} outside the vocabulary (0..{vocab - 1})")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise SampleError("loss_mask", "values other than 0 and 1")


def _peek_all(src: ForeignSource, info: ModelInfo, layers: tuple[int, ...], vocab: int,
              flags: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """One index line per file; bad files go to ``src.errors``. Returns the lines and the longest sample."""
    want = len(layers) + (1 if src.last == "final" else 0)
    lines: list[dict[str, Any]] = []
    max_len = 1
    for k, f in enumerate(src.files):
        if k not in src.errors:
            try:
                p = src.peek(f)
                if p.hidden_size != info.hidden_size:
                    raise SampleError("hidden_states", f"hidden size {p.hidden_size}, but {info.path} has "
                                                       f"{info.hidden_size}: pass the model the files were made with")
                if p.num_states != want:
                    got = p.num_states - (1 if src.last == "final" else 0)
                    raise SampleError("hidden_states", f"holds {got} layers{' + final' * (src.last == 'final')}, "
                                                       f"but layers={list(layers)} names {len(layers)}: pass --layers "
                                                       f"with {got} ids")
                _check_tokens(p, vocab)
            except SampleError as e:
                src.errors[k] = (e.field, f"{f.path}: {e.reason}")
            except _UNREADABLE as e:
                src.errors[k] = ("file", f"{f.path}: unreadable ({e!r})")
            else:
                for name, v in p.flags.items():
                    flags[name] = flags.get(name, 0) + v
                ids = [int(v) for v in p.input_ids.reshape(-1).tolist()]
                max_len = max(max_len, len(ids))
                lines.append({"input_ids": ids, "loss_mask": [int(v) for v in p.loss_mask.reshape(-1).tolist()]})
                continue
        lines.append({"input_ids": [0], "loss_mask": [1]})  # a placeholder: the backend rejects it
    return lines, max_len


def _resolve_layers(src: ForeignSource, info: ModelInfo, layers: Iterable[int] | None) -> tuple[int, ...]:
    given = layers is not None
    try:
        out = check_layers(src.layers if layers is None else layers, info)
    except ValueError as e:
        raise InteropError(f"{e} ({'--layers' if given else src.layers_from}); pass --layers: the {src.fmt} files' "
                           "layers in hs_dataset's convention") from None
    if src.last == "prenorm" and out[-1] != info.num_layers - 1:
        raise InteropError(
            f"the {src.fmt} files' last entry is the verifier's last layer before the final norm, hs_dataset layer "
            f"{info.num_layers - 1}, but the layers end with {out[-1]} ({'--layers' if given else src.layers_from}): "
            f"without it there is no final state; pass --layers ending with {info.num_layers - 1}")
    return out


def _file_states(backend: FileCaptureBackend, src: ForeignSource, lines: list[dict[str, Any]],
                 files: Iterable[int]) -> Iterator[tuple[int, CaptureResult]]:
    """The states the import would store for each of ``files`` (usable ones), in order (read lazily)."""
    for k in files:
        line = lines[k]
        s = TokenizedSample(f"import:{k}", np.asarray(line["input_ids"], dtype=np.int32),
                            np.asarray(line["loss_mask"], dtype=np.uint8))
        yield from ((k, r) for r in backend.capture([s]) if isinstance(r, CaptureResult))


def _check_files(backend: FileCaptureBackend, src: ForeignSource, lines: list[dict[str, Any]], use: tuple[int, ...],
                 picks: list[int], checked: bool, folder: Path) -> str:
    """Every usable file's fingerprint against the files the model check verified (hs_dataset.interop.file_check)."""
    usable = [k for k in range(len(lines)) if k not in src.errors]
    prints = {str(src.files[k].path): fingerprint(r.states, torch.from_numpy(r.sample.loss_mask[:r.states.shape[1]]))
              for k, r in _file_states(backend, src, lines, usable)
              if bool(torch.isfinite(r.states).all())}  # NaN/Inf: that file's reject
    if len(prints) < 2:
        return "file check: fewer than 2 files to compare"
    names = [f"hidden_layer_{k}" for k in use] + ["hidden_final"]
    return "file check: " + check_same_source(prints, [str(src.files[k].path) for k in picks] if checked else [],
                                             names, str(folder))


def run_import(src: ForeignSource, out: str | os.PathLike, *, model: str, source_dir: Path,
               layers: Iterable[int] | None, storage_dtype: StorageDtype, file_format: FileFormat, part_size: int,
               progress: bool, build_command: str, trust_remote_code: bool = False,
               check_model: bool = True) -> ImportSummary:
    """Peek and check every file of ``src``, check ``model`` against a few samples' states
    (:mod:`hs_dataset.interop.model_check`; ``check_model=False``: only its cheap check), write the
    import index, run the build."""

    if not src.files:
        raise InteropError(f"{source_dir}: no {src.fmt} sample files found")
    info = read_model_info(model)
    use = _resolve_layers(src, info, layers)
    norm = None
    notes: list[str] = []
    options: dict[str, Any] = {"from": src.fmt, "path": str(source_dir.resolve()), "layers_from":
                               "--layers" if layers is not None else src.layers_from, **src.options}
    if src.last == "prenorm":
        norm = load_final_norm(model, f"the {src.fmt} files hold the last layer before the final norm (stored as "
                                      f"hidden_layer_{info.num_layers - 1}); hidden_final must be computed from it")
        options["final"] = norm.describe(info.num_layers - 1)
        notes.append(options["final"])
    else:
        options["final"] = f"hidden_final = the {src.fmt} files' post-norm final state"
    flags: dict[str, Any] = {}
    vocab = min(len(load_tokenizer(model, trust_remote_code=trust_remote_code)), info.vocab_size)
    lines, max_len = _peek_all(src, info, use, vocab, flags)
    if len(src.errors) == len(src.files):
        raise InteropError(f"no usable {src.fmt} sample in {source_dir}: {next(iter(src.errors.values()))[1]}")
    options.update(flags)
    backend = FileCaptureBackend(src, info, use, norm)
    picks = spread([k for k in range(len(lines)) if k not in src.errors], CHECK_SAMPLES)  # over the whole folder
    options["model_check"] = model_check((r for _, r in _file_states(backend, src, lines, picks)), info, use, model,
                                         check=check_model, norm=norm, trust_remote_code=trust_remote_code)
    notes.append(options["model_check"])
    options["file_check"] = _check_files(backend, src, lines, use, picks, check_model, source_dir)
    notes.append(options["file_check"])
    if flags.get("pad_tail_tokens"):
        notes.append(f"stripped SpecForge pad tails: {flags['pad_tail_tokens']} tokens (pad id "
                     f"{src.options.get('pad_id')}, loss mask 0) from {flags['pad_tail_samples']} samples")

    state = Path(out) / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    name = f"import-{src.fmt}"
    index = state / f"{name}.jsonl"
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if not index.exists() or index.read_text() != text:
        atomic_write(index, text)
    # NaN/Inf in one file is that sample's reject, as every other bad file (SpecForge's writer skips them too)
    config = HiddenStatesConfig(model=str(model), layers=use, source=str(index), max_length=max_len,
                                truncation="reject", on_nonfinite="reject", backend=name, storage_dtype=storage_dtype,
                                file_format=file_format, part_size=part_size, backend_options=options,
                                trust_remote_code=trust_remote_code)
    s = build(config, out, backend=backend, progress=progress, build_command=build_command)
    return ImportSummary(s.output_dir, s.counts.samples_in, s.counts.written, s.counts.rejected, s.bytes_written,
                         s.seconds, notes)

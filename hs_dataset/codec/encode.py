"""The encode stage: captured states -> a row's values -> a one-row Arrow table, and the dataset schema.

Arrow and ``datasets`` have no bfloat16. States are stored **exactly**: the bf16 bit patterns
as ``uint16`` in ``Array2D(shape=(None, hidden), dtype="uint16")`` columns, one per captured layer
plus the final state. The logical dtype is recorded in ``hs_dataset.json`` and the card, and
:mod:`hs_dataset.read.decode` turns a column back into ``torch.bfloat16`` without copying.

Optional ``fp8_e4m3`` storage keeps one ``uint8`` byte per value (float8 e4m3fn bits) plus a
per-token float32 scale column ``<column>_scale`` (:mod:`hs_dataset.codec.fp8`: scale = amax / 448, as in
vLLM speculators' hidden-state connectors); the reader multiplies back to bf16. States that arrive
already quantized (the SGLang plugin does it on the GPU) are stored as they are; bf16 states are
quantized here with the same function.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from datasets import Array2D, Features, List, Value

from hs_dataset.codec.fp8 import fp8_dequantize, fp8_quantize
from hs_dataset.errors import ConfigError, SampleError
from hs_dataset.layout import (FINAL_COLUMN, MESSAGES_COLUMN, SAMPLE_TOKENS_COLUMN, STORAGE_DTYPES, TEACHER_IDS_COLUMN,
                               TEACHER_LOGPROBS_COLUMN, TEACHER_LSE_COLUMN, TOKEN_START_COLUMN, StorageDtype, scale_column,
                               state_columns)
from hs_dataset.records import CaptureResult

__all__ = ["bf16_bits", "bytes_per_token", "check_finite", "check_storage_dtype", "encode_row",
           "fp8_decode", "fp8_encode", "make_features", "row_pieces", "row_table", "stored_state_columns"]


def check_storage_dtype(storage_dtype: str) -> StorageDtype:
    """``storage_dtype`` as a :data:`~hs_dataset.layout.StorageDtype`.

    Raises:
        ConfigError: not one of :data:`~hs_dataset.layout.STORAGE_DTYPES`.
    """
    if storage_dtype not in STORAGE_DTYPES:
        raise ConfigError(f"storage_dtype {storage_dtype!r} unknown: use one of {', '.join(STORAGE_DTYPES)}",
                          field="storage_dtype", value=storage_dtype)
    return storage_dtype  # type: ignore[return-value]


def make_features(layers: tuple[int, ...], hidden_size: int, storage_dtype: StorageDtype = "bfloat16", *,
                  messages: bool = False, long_rows: bool = False, teacher_k: int = 0,
                  store_final: bool = True, tags: dict[str, str] | None = None) -> Features:
    """The dataset schema for these layers (``tags``: tag columns and their dtypes, :mod:`hs_dataset.prepare.tags`;
    ``messages``: a regenerate build's conversation column;
    ``long_rows``: a build whose samples may span several rows, with ``token_start`` and ``sample_tokens``;
    ``teacher_k``: the teacher's top-k columns; ``store_final=False``: no ``hidden_final``)."""
    check_storage_dtype(storage_dtype)
    cols: dict[str, Any] = {"id": Value("string")}
    if messages:
        cols[MESSAGES_COLUMN] = Value("string")
    cols.update({
        "input_ids": List(Value("int32")),
        "loss_mask": List(Value("uint8")),
        "num_tokens": Value("int32"),
    })
    cols.update({name: Value(dtype) for name, dtype in (tags or {}).items()})
    if long_rows:
        cols[TOKEN_START_COLUMN] = Value("int32")
        cols[SAMPLE_TOKENS_COLUMN] = Value("int32")
    bits = "uint16" if storage_dtype == "bfloat16" else "uint8"
    for c in stored_state_columns(layers, store_final):
        cols[c] = Array2D(shape=(None, hidden_size), dtype=bits)
        if storage_dtype == "fp8_e4m3":
            cols[scale_column(c)] = List(Value("float32"))
    if teacher_k:
        cols[TEACHER_IDS_COLUMN] = Array2D(shape=(None, teacher_k), dtype="int32")
        cols[TEACHER_LOGPROBS_COLUMN] = Array2D(shape=(None, teacher_k), dtype="float32")
        cols[TEACHER_LSE_COLUMN] = List(Value("float32"))
    return Features(cols)


def stored_state_columns(layers: tuple[int, ...] | list[int], store_final: bool = True) -> list[str]:
    """The hidden-state columns a build stores: the layers, then ``hidden_final`` unless ``store_final`` is False."""
    cols = state_columns(layers)
    return cols if store_final else cols[:-1]


def bytes_per_token(n_states: int, hidden_size: int, storage_dtype: StorageDtype = "bfloat16") -> int:
    """Hidden-state payload bytes per token (what writer batches and shard sizes are computed from)."""
    if storage_dtype == "bfloat16":
        return n_states * hidden_size * 2
    return n_states * (hidden_size + 4)


def check_finite(result: CaptureResult, columns: list[str]) -> None:
    """Raise :class:`SampleError` naming the first state (layer) holding NaN or Inf.

    Uses the backend's own count when it made one (``result.nonfinite``), else checks here.
    """
    if result.nonfinite is not None:
        bad_states = [j for j, n in enumerate(result.nonfinite) if n]
        if not bad_states:
            return
        bad = bad_states[0]
    else:
        values = result.states if result.scales is None else result.scales  # fp8 NaN carries into the scale
        finite = torch.isfinite(values).flatten(1).all(dim=1)
        if bool(finite.all()):
            return
        bad = int((~finite).nonzero()[0, 0])
    if result.scales is None:
        st = result.states[bad]
        nan, inf = int(torch.isnan(st).sum()), int(torch.isinf(st).sum())
        what = f"{nan} NaN and {inf} Inf values"
    else:
        what = f"{result.nonfinite[bad] if result.nonfinite else '?'} positions with NaN or Inf"
    raise SampleError(columns[bad], f"non-finite hidden state: {what}")


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """Zero-copy view of a contiguous CPU bf16 tensor as a uint16 numpy array."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected torch.bfloat16, got {t.dtype}")
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def fp8_encode(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """bf16 ``[T, H]`` -> (float8 e4m3fn bits ``uint8 [T, H]``, per-token scale ``float32 [T]``)."""
    q, scale = fp8_quantize(t)
    return q.numpy(), scale.numpy()


def fp8_decode(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_encode`: uint8 bits ``[T, H]`` and float32 scales ``[T]`` -> bf16."""
    return fp8_dequantize(bits, scale)


def row_pieces(result: CaptureResult, row_tokens: int) -> list[CaptureResult]:
    """``result`` cut into rows of at most ``row_tokens`` positions aligned to multiples of it (views, no
    copy): one row for a sample that short, several for a longer one (or a piece of one). The backend's
    statistics of the sample (``value_stats``) go with the last row, zeros with the others."""
    a, n = result.token_start, result.num_positions
    if result.token_start % row_tokens == 0 and n <= row_tokens:
        return [result]
    out = []
    for lo in range(a, a + n, row_tokens):
        hi = min(a + n, (lo // row_tokens + 1) * row_tokens)
        counted = result.value_stats
        out.append(dataclasses.replace(
            result, states=result.states[:, lo - a:hi - a], token_start=lo,
            value_stats=counted if counted is None or hi == a + n else torch.zeros_like(counted),
            scales=None if result.scales is None else result.scales[:, lo - a:hi - a],
            teacher=None if result.teacher is None else (result.teacher[0][lo - a:hi - a],
                                                         result.teacher[1][lo - a:hi - a],
                                                         result.teacher[2][lo - a:hi - a])))
    return out


def encode_row(result: CaptureResult, storage_dtype: StorageDtype = "bfloat16", *,
               check_nonfinite: bool = True, long_rows: bool = False, store_final: bool = True,
               teacher: bool = False) -> dict[str, Any]:
    """One dataset row for a captured sample, or for positions ``[token_start, token_start + n)`` of one
    (``long_rows``: with the ``token_start`` and ``sample_tokens`` columns; ``teacher``: the teacher's
    top-k at the row's loss-masked positions; ``store_final=False``: without ``hidden_final``). Raises
    SampleError on NaN/Inf (names the layer) and on a teacher missing or non-finite."""
    s = result.sample
    cols = state_columns(result.layers)
    a, n = result.token_start, result.num_positions
    if (not long_rows and n != s.num_tokens) or a + n > s.num_tokens or (long_rows and n == 0 and s.num_tokens):
        raise SampleError(cols[0], f"backend returned {n} positions from {a} for {s.num_tokens} tokens")
    if result.encoding != "bfloat16" and result.encoding != storage_dtype:
        raise ValueError(f"the backend delivered {result.encoding} states for a {storage_dtype} dataset")
    if check_nonfinite:
        check_finite(result, cols)
    row: dict[str, Any] = {
        "id": s.sample_id,
        MESSAGES_COLUMN: s.messages,
        "input_ids": s.input_ids[a:a + n].astype(np.int32, copy=False),
        "loss_mask": s.loss_mask[a:a + n].astype(np.uint8, copy=False),
        "num_tokens": n,
        TOKEN_START_COLUMN: a,
        SAMPLE_TOKENS_COLUMN: s.num_tokens,
        **(s.tags or {}),
    }
    if teacher:
        if result.teacher is None or result.teacher[0].shape[0] != n:
            raise SampleError(TEACHER_IDS_COLUMN, "the backend gave no teacher top-k for these positions")
        # NumPy: a boolean index of the tensors here was most of the build thread's time at Kimi width with a
        # teacher (benchmarks/compact.py --profile)
        masked = np.asarray(row["loss_mask"]).astype(bool)
        ids, logprobs, lse = (np.compress(masked, t.numpy(), axis=0) for t in result.teacher)
        if not (np.isfinite(lse).all() and np.isfinite(logprobs).all()):
            raise SampleError(TEACHER_LOGPROBS_COLUMN, "non-finite teacher log-probabilities")
        row[TEACHER_IDS_COLUMN], row[TEACHER_LOGPROBS_COLUMN], row[TEACHER_LSE_COLUMN] = ids, logprobs, lse
    stored = cols if store_final else cols[:-1]
    if result.states.shape[0] < len(stored):  # a backend asked for no final state (start_capture's final=False)
        raise SampleError(FINAL_COLUMN, f"the backend delivered {result.states.shape[0]} states, without the final "
                                        "one, for a build that stores hidden_final")
    for i, c in enumerate(stored):
        if storage_dtype == "bfloat16":
            row[c] = bf16_bits(result.states[i])
        elif result.scales is not None:  # quantized by the backend: stored as it is, no copy
            row[c], row[scale_column(c)] = result.states[i].numpy(), result.scales[i].numpy()
        else:
            row[c], row[scale_column(c)] = fp8_encode(result.states[i])
    return row



def _arrow_values(a: np.ndarray) -> pa.Array:
    """Zero-copy Arrow view of a contiguous 1-D numpy array (the buffer keeps ``a`` alive)."""
    a = np.ascontiguousarray(a).reshape(-1)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [None, pa.py_buffer(a)])


def _one_row_list(values: pa.Array, type_: pa.DataType | None = None) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values, type=type_)


def row_table(row: dict[str, Any], schema: pa.Schema) -> pa.Table:
    """One encoded row (see :func:`encode_row`) as a one-row Arrow table of ``schema``.

    Hidden-state columns are wrapped **without copying** their bytes: the table's buffers are the
    backend's tensors. ``datasets``' own path (``Features.encode_example`` + ``TypedSequence``) copies
    every ``Array2D`` value three times (``np.array``, ``flatten``, ``concat_arrays``), which at
    Kimi scale (117 MB per sample) costs as much as writing the bytes to disk.
    """
    arrays = []
    for col in schema:
        v = row[col.name]
        t = col.type
        if isinstance(t, pa.ExtensionType):  # Array2D(shape=(None, H)): list<list<bits>>
            n, h = v.shape
            inner = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * h, h, dtype=np.int32)),
                                             _arrow_values(v))
            arrays.append(pa.ExtensionArray.from_storage(t, _one_row_list(inner)))
        elif pa.types.is_list(t):
            arrays.append(_one_row_list(_arrow_values(np.asarray(v, dtype=t.value_type.to_pandas_dtype())), t))
        else:
            arrays.append(pa.array([v], t))
    return pa.Table.from_arrays(arrays, schema=schema)

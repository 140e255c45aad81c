"""Arrow rows -> torch tensors: the stored bits back to bf16, without upcasts, safe to write to.

``load_dataset`` gives nested Python lists for ``Array2D`` columns, and ``with_format("torch")``
copies every value into an int64 tensor (the uint16 bit patterns as numbers, not bf16). These
functions read the Arrow buffers instead: bf16 bits are viewed as ``torch.bfloat16``, fp8-stored
columns are decoded to bf16 (one multiply), or with ``fp8="codes"`` handed out as they are stored
(``torch.float8_e4m3fn`` codes and their float32 scales), for a trainer that decodes them on its GPU
(:func:`hs_dataset.read.collate.decode_on`: half the bytes to move, no decode on the host). Tensors
are never views of the read-only shard mappings (an in-place op there is a segfault): large states are
private copy-on-write mappings of the same bytes (:mod:`hs_dataset.read.safe_views`), small values are
copied, and memory no file backs (a streaming dataset's batches) is viewed as it is.
"""

from __future__ import annotations

from typing import Any, Iterable

import pyarrow as pa
import torch

from hs_dataset.codec.rows import FP8_MODES, check_fp8_mode, list_slice, state_from_bits, state_slice
from hs_dataset.layout import (FINAL_COLUMN, MESSAGES_COLUMN, SAMPLE_TOKENS_COLUMN, TEACHER_IDS_COLUMN,
                               TEACHER_LOGPROBS_COLUMN, TEACHER_LSE_COLUMN, TOKEN_START_COLUMN, layer_of, scale_column)
from hs_dataset.read.safe_views import SafeViews

__all__ = ['FP8_MODES', 'check_fp8_mode', 'column_bits', 'decode_row', 'decode_state', 'list_values',
           'state_columns_of']


def _as_tensor(values: pa.Array, views: SafeViews) -> torch.Tensor:
    """A torch tensor of a primitive Arrow array without nulls, made by ``views``."""
    return views.tensor(values.to_numpy(zero_copy_only=True))


def column_bits(col: pa.ChunkedArray | pa.Array, i: int = 0, *, views: SafeViews | None = None) -> torch.Tensor:
    """Row ``i`` of an ``Array2D(shape=(None, H))`` column as its raw stored integer tensor ``[T, H]``.

    ``views`` (see :mod:`hs_dataset.read.safe_views`): how tensors over Arrow memory are made; by default
    a :class:`~hs_dataset.read.safe_views.SafeViews` for this call (tensors safe to write to).
    """
    flat, width = state_slice(col, i)
    t = _as_tensor(flat, views or SafeViews())
    return t.view(len(flat) // width if width else 0, width)


def list_values(col: pa.ChunkedArray | pa.Array, i: int = 0, *, views: SafeViews | None = None) -> torch.Tensor:
    """Row ``i`` of a ``List(Value(...))`` column as a 1-D tensor (``views``: as in :func:`column_bits`)."""
    return _as_tensor(list_slice(col, i), views or SafeViews())


def decode_state(table: pa.Table, column: str, i: int = 0, *, views: SafeViews | None = None,
                 fp8: str = "decode") -> torch.Tensor:
    """One hidden-state column of row ``i`` as ``torch.bfloat16 [T, H]`` (``views``: as in :func:`column_bits`);
    with ``fp8="codes"`` an fp8-stored one as its stored codes, ``torch.float8_e4m3fn [T, H]``.

    Raises:
        TypeError: the column holds neither bf16 nor fp8 bits.
    """
    views = views or SafeViews()
    return state_from_bits(column_bits(table.column(column), i, views=views),
                           lambda: list_values(table.column(scale_column(column)), i, views=views), fp8=fp8,
                           column=column)


def state_columns_of(table: pa.Table) -> list[str]:
    """Hidden-state columns of a table: the layers in ascending order, then the final state."""
    layers = sorted((c for c in table.column_names if layer_of(c) is not None), key=lambda c: layer_of(c) or 0)
    return layers + ([FINAL_COLUMN] if FINAL_COLUMN in table.column_names else [])


def decode_row(table: pa.Table, i: int = 0, columns: Iterable[str] | None = None, *,
               views: SafeViews | None = None, fp8: str = "decode") -> dict[str, Any]:
    """Row ``i`` of an Arrow table (``ds.with_format("arrow")[k]`` or a batch) as torch tensors.

    Args:
        table: an Arrow table of a build's rows.
        i: the row.
        columns: the hidden-state columns to decode (default: all of them).
        views: how tensors over Arrow memory are made (default: a fresh
            :class:`~hs_dataset.read.safe_views.SafeViews`: tensors safe to write to).
        fp8: ``"decode"`` (default): fp8-stored states decoded to bf16; ``"codes"``: as stored, each a
            ``torch.float8_e4m3fn [T, H]`` with its float32 scales ``[T]`` as ``<column>_scale``.

    Returns:
        ``id`` (str), ``input_ids`` (int32 [T]), ``loss_mask`` (uint8 [T]), every hidden-state column (or
        those in ``columns``) as ``torch.bfloat16 [T, H]``, and in regenerate builds ``messages`` (the
        conversation as JSON text), and in builds whose samples span rows ``token_start`` and
        ``sample_tokens`` (ints: the row holds positions ``[token_start, token_start + T)`` of a sample
        of ``sample_tokens``); in teacher builds ``teacher_ids`` (int32 [M, k]), ``teacher_logprobs``
        (float32 [M, k]) and ``teacher_lse`` (float32 [M]) at the M loss-masked positions. Every tensor
        can be written to in place without touching the dataset's files.

    Raises:
        TypeError: a column holds neither bf16 nor fp8 bits.
    """
    views = views or SafeViews()
    out: dict[str, Any] = {}
    names = table.column_names
    for c in ("id", MESSAGES_COLUMN, TOKEN_START_COLUMN, SAMPLE_TOKENS_COLUMN):  # regenerate, long-rows builds
        if c in names:
            out[c] = table.column(c)[i].as_py()
    for c in ("input_ids", "loss_mask"):
        if c in names:
            out[c] = list_values(table.column(c), i, views=views)
    for c in columns if columns is not None else state_columns_of(table):
        out[c] = decode_state(table, c, i, views=views, fp8=fp8)
        if out[c].dtype == torch.float8_e4m3fn:
            out[scale_column(c)] = list_values(table.column(scale_column(c)), i, views=views)
    for c in (TEACHER_IDS_COLUMN, TEACHER_LOGPROBS_COLUMN):  # teacher builds: [M, k] at the M masked positions
        if c in names:
            out[c] = column_bits(table.column(c), i, views=views)
    if TEACHER_LSE_COLUMN in names:
        out[TEACHER_LSE_COLUMN] = list_values(table.column(TEACHER_LSE_COLUMN), i, views=views)
    return out

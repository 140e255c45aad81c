"""The one row decoder: where a stored row's values are in its Arrow arrays, and what its state bits mean.

A build stores ``input_ids`` / ``loss_mask`` (and a state's ``<column>_scale``) as ``List(Value)`` and every
hidden state as ``Array2D((None, H))`` (a list of fixed-width lists) of bf16 bit patterns (uint16) or of
float8_e4m3fn codes (uint8) with a float32 scale per token (:mod:`hs_dataset.codec.encode`). Every reader
goes through these functions: the tensor readers (:mod:`hs_dataset.read.decode`), the token windows
(:mod:`hs_dataset.read.windows`), the recount (:mod:`hs_dataset.integrity.scan`) and the probe
(:mod:`hs_dataset.integrity.probe_inputs`).

* :func:`list_slice`: positions ``[lo, hi)`` of row ``i`` of a list column, as an Arrow array (no copy);
* :func:`state_slice`: positions ``[lo, hi)`` of row ``i`` of an ``Array2D`` column: its flat values and ``H``;
* :func:`state_from_bits`: stored bits (``[T, H]`` uint16 or uint8) -> bf16, or fp8 codes as they are.
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa
import torch

from hs_dataset.codec.encode import fp8_decode

__all__ = ["FP8_MODES", "check_fp8_mode", "list_slice", "row_array", "state_from_bits", "state_slice"]

FP8_MODES = ("decode", "codes")  # fp8-stored states: bf16 decoded on the host, or the stored codes and scales


def check_fp8_mode(fp8: str) -> str:
    """``fp8`` if it is one of :data:`FP8_MODES`; else ValueError naming them."""
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8={fp8!r}: use 'decode' (bf16 decoded on the host) or 'codes' (the stored float8_e4m3fn "
                         "codes and their scales, to decode on the GPU with hs_dataset.read.collate.decode_on)")
    return fp8


def row_array(col: pa.ChunkedArray | pa.Array, i: int) -> tuple[pa.Array, int]:
    """The chunk of ``col`` holding row ``i``, unwrapped from its extension type, and the row's index in it."""
    if isinstance(col, pa.ChunkedArray):
        for chunk in col.chunks:
            if i < len(chunk):
                col = chunk
                break
            i -= len(chunk)
        else:
            raise IndexError("row index out of range")
    return (col.storage if isinstance(col, pa.ExtensionArray) else col), i


def list_slice(col: pa.ChunkedArray | pa.Array, i: int, lo: int = 0, hi: int | None = None) -> pa.Array:
    """Positions ``[lo, hi)`` (default: all) of row ``i`` of a ``List(Value)`` column, a slice of its values."""
    arr, j = row_array(col, i)
    a, b = arr.offsets[j].as_py(), arr.offsets[j + 1].as_py()
    hi = b - a if hi is None else hi
    return arr.values.slice(a + lo, hi - lo)


def state_slice(col: pa.ChunkedArray | pa.Array, i: int, lo: int = 0, hi: int | None = None) -> tuple[pa.Array, int]:
    """Positions ``[lo, hi)`` (default: all) of row ``i`` of an ``Array2D((None, H))`` column: the flat values
    (a slice, no copy) and ``H`` (0 for an empty slice)."""
    arr, j = row_array(col, i)
    s, e = arr.offsets[j].as_py(), arr.offsets[j + 1].as_py()
    hi = e - s if hi is None else hi
    inner = arr.values
    a, b = inner.offsets[s + lo].as_py(), inner.offsets[s + hi].as_py()
    return inner.values.slice(a, b - a), (b - a) // (hi - lo) if hi > lo else 0


def state_from_bits(bits: torch.Tensor, scale: Callable[[], torch.Tensor], *, fp8: str = "decode",
                    column: str = "state") -> torch.Tensor:
    """A stored state ``[T, H]`` as ``torch.bfloat16``: bf16 bits viewed, fp8 codes decoded with ``scale()``
    (called only for fp8); with ``fp8="codes"`` an fp8 state as its codes, ``torch.float8_e4m3fn``.

    Raises:
        TypeError: ``bits`` are neither uint16 (bf16) nor uint8 (fp8), naming ``column``.
    """
    if bits.dtype == torch.uint16:
        return bits.view(torch.bfloat16)
    if bits.dtype == torch.uint8:
        if check_fp8_mode(fp8) == "codes":
            return bits.view(torch.float8_e4m3fn)
        return fp8_decode(bits, scale())
    raise TypeError(f"column {column!r} holds {bits.dtype}, not a hidden-state encoding")

"""One stored state's statistics (:class:`ColumnStats`): the kernels that count a ``[T, H]`` state fast.

A state is read in chunks of :data:`CHUNK` values into one reused float32 buffer (4 MiB: it stays in
the cache while a chunk is summed, its square summed and its extremes found): per chunk a float32 sum,
a float32 dot product and ``aminmax``, the sums added up in float64. bf16 bits convert to float32 in
one copy. fp8 e4m3 codes are decoded without a lookup table (numpy's ``take`` costs 2 ns a value):
the code's 7 magnitude bits shifted left by 20 are a float32 with the same exponent and mantissa
fields, which is the fp8 value times 2^-120 for normal and subnormal codes alike, so a shift, an OR
of the sign and one multiplication by ``2^120 * scale`` give ``code * scale`` exactly (measured on one
core of the 2-core VM: a Kimi-width state, 2048 x 7168, in ~9 ms as bf16 and ~30 ms as fp8). Non-finite
values (bf16 NaN/Inf, the fp8 NaN codes 0x7F/0xFF, a token whose scale is not finite) are counted and
left out of the sums; the fast path finds them from the chunk's sum.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hs_dataset.codec.fp8 import FP8_MAX
from hs_dataset.layout import scale_column

__all__ = ["CHUNK", "ColumnStats", "column_stats", "saturation_limit"]

CHUNK = 1 << 20  # values per chunk
_LIMIT_CODE, _NAN_CODE = 0x7E, 0x7F  # e4m3fn magnitudes: 0x7E is 448, 0x7F is NaN
_P120 = np.float32(2.0 ** 120)


def saturation_limit(hidden: int) -> float:
    """The share of a row's fp8 values at the e4m3 limit above which the row is flagged: 5%, or 8 values
    per token for narrow states (a healthy token has one or a few, its largest)."""
    return max(0.05, 8.0 / max(hidden, 1))


@dataclass
class ColumnStats:
    """One state column's running totals: values, their sum and sum of squares (of the finite ones),
    the largest magnitude, NaN and Inf counts, values at the fp8 limit."""

    values: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    absmax: float = 0.0
    nan: int = 0
    inf: int = 0
    fp8_limit: int = 0

    def merge(self, other: "ColumnStats") -> None:
        self.values += other.values
        self.sum += other.sum
        self.sumsq += other.sumsq
        self.absmax = max(self.absmax, other.absmax)
        self.nan += other.nan
        self.inf += other.inf
        self.fp8_limit += other.fp8_limit

    @property
    def finite(self) -> int:
        return self.values - self.nan - self.inf

    @property
    def mean(self) -> float:
        return self.sum / self.finite if self.finite else float("nan")

    @property
    def std(self) -> float:
        n = self.finite
        return math.sqrt(max(self.sumsq / n - self.mean ** 2, 0.0)) if n else float("nan")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = asdict(self)
        d.update(mean=self.mean, std=self.std, fp8_limit_share=self.fp8_limit / self.values if self.values else 0.0)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ColumnStats":
        return cls(int(d["values"]), float(d["sum"]), float(d["sumsq"]), float(d["absmax"]), int(d["nan"]),
                   int(d["inf"]), int(d["fp8_limit"]))


class _Buffers(threading.local):
    """Each thread's chunk buffers (a uint32 array, its float32 view, a scratch array)."""

    def __init__(self) -> None:
        self.u32 = np.empty(CHUNK, np.uint32)
        self.f32 = self.u32.view(np.float32)
        self.tensor = torch.from_numpy(self.f32)
        self.scratch = np.empty(CHUNK, np.uint32)


_BUFFERS = _Buffers()


def _reduce(b: torch.Tensor, s: ColumnStats) -> None:
    """Add a float32 chunk ``b`` (zeroed in place where not finite) to ``s``."""
    total = float(b.sum())
    if not math.isfinite(total):  # rare: count, then leave the non-finite values out
        nan, inf = torch.isnan(b), torch.isinf(b)
        s.nan += int(nan.sum())
        s.inf += int(inf.sum())
        b.masked_fill_(nan | inf, 0.0)
        total = float(b.sum())
    s.sum += total
    s.sumsq += float(torch.dot(b, b))
    lo, hi = torch.aminmax(b)
    s.absmax = max(s.absmax, -float(lo), float(hi))


def _bf16_stats(x: torch.Tensor) -> ColumnStats:
    flat = x.reshape(-1)
    s = ColumnStats(values=flat.numel())
    for k in range(0, flat.numel(), CHUNK):
        b = _BUFFERS.tensor[:min(CHUNK, flat.numel() - k)]
        b.copy_(flat[k:k + b.numel()])
        _reduce(b, s)
        if s.absmax >= FP8_MAX:
            s.fp8_limit += int((b.abs() >= FP8_MAX).sum())
    return s


def _fp8_stats(q: np.ndarray, scale: np.ndarray) -> ColumnStats:
    T, H = q.shape
    s = ColumnStats(values=T * H)
    step = max(1, CHUNK // max(H, 1))
    for t0 in range(0, T, step):
        qc, sc = q[t0:t0 + step], scale[t0:t0 + step].astype(np.float32)
        n = qc.shape[0]
        u = _BUFFERS.u32[:n * H].reshape(n, H)
        sign = _BUFFERS.scratch[:n * H].reshape(n, H)
        np.copyto(u, qc, casting="unsafe")
        np.bitwise_and(u, 0x80, out=sign)
        np.left_shift(sign, 24, out=sign)
        np.bitwise_and(u, 0x7F, out=u)  # the magnitude code
        s.fp8_limit += int(np.count_nonzero(u == _LIMIT_CODE))
        nan_codes = u == _NAN_CODE
        nan = int(np.count_nonzero(nan_codes))
        np.left_shift(u, 20, out=u)
        np.bitwise_or(u, sign, out=u)
        f = _BUFFERS.f32[:n * H].reshape(n, H)
        f *= _P120
        ok = np.isfinite(sc)
        if nan or not ok.all():  # rare: NaN codes, tokens whose scale is not finite (all their values count)
            s.nan += int(np.count_nonzero(nan_codes[ok])) + H * int(np.count_nonzero(np.isnan(sc)))
            s.inf += H * int(np.count_nonzero(np.isinf(sc)))
            f[nan_codes] = 0.0
            f[~ok] = 0.0
            sc = np.where(ok, sc, np.float32(0.0))
        f *= sc[:, None]
        _reduce(_BUFFERS.tensor[:n * H], s)
    return s


def column_stats(row: dict[str, Any], column: str) -> ColumnStats:
    """The statistics of one stored state of an encoded row (:func:`hs_dataset.codec.encode.encode_row`'s
    values, or a row read back): bf16 bits (uint16 ``[T, H]``) or fp8 codes (uint8) with ``<column>_scale``."""
    bits = np.asarray(row[column])
    if bits.dtype == np.uint8:
        return _fp8_stats(bits, np.asarray(row[scale_column(column)], dtype=np.float32))
    with warnings.catch_warnings():  # a shard's read-only mapping: only read here, never written
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return _bf16_stats(torch.from_numpy(bits).view(torch.bfloat16))

"""One stored state's statistics (:class:`ColumnStats`): the kernels that count a ``[T, H]`` state fast.

A state is read in chunks of :data:`CHUNK` values into one reused float32 buffer (4 MiB: it stays in
the cache while a chunk is summed, its square summed and its extremes found), all in numpy: per chunk
pairwise float32 sums of the values and of their squares, the minimum and the maximum, the sums added
up in float64. numpy reduces on the calling thread alone, so the sums are the same however many
threads a process has (a build split over workers gives a single-worker build's statistics, bit for
bit). Decoding takes no lookup table (numpy's ``take`` costs 2 ns a value): bf16 bits shifted left by
16 are the float32 of the same value; an fp8 e4m3 code's 7 magnitude bits shifted left by 20 are a
float32 with the same exponent and mantissa fields, which is the fp8 value times 2^-120 for normal
and subnormal codes alike, so a shift, an OR of the sign and two multiplications (by 2^120, by the
token's scale) give ``code * scale``. Costs: ``benchmarks/stats_overhead.py``. Non-finite values (bf16
NaN/Inf, the fp8 NaN codes 0x7F/0xFF, a token whose scale is not finite) are counted and left out of
the sums; the fast path finds them from the chunk's sum.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hs_dataset.codec.fp8 import FP8_MAX
from hs_dataset.layout import scale_column

__all__ = ["CHUNK", "ColumnStats", "column_stats", "saturation_limit"]

CHUNK = 1 << 20  # values per chunk
_LIMIT_CODE, _NAN_CODE = 0x7E, 0x7F  # e4m3fn magnitudes: 0x7E is 448, 0x7F is NaN
_P120 = np.float32(2.0 ** 120)
_SCALE_FITS = 2.0 ** 7  # below it, 2^120 * scale is a finite float32 (and so is every product with a code)


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
        counts = {k: int(d[k]) for k in ("values", "nan", "inf", "fp8_limit")}
        return cls(**counts, sum=float(d["sum"]), sumsq=float(d["sumsq"]), absmax=float(d["absmax"]))


class _Buffers(threading.local):
    """Each thread's chunk buffers (a uint32 array, its float32 view, a scratch array)."""

    def __init__(self) -> None:
        self.u32 = np.empty(CHUNK, np.uint32)
        self.f32 = self.u32.view(np.float32)
        self.scratch = np.empty(CHUNK, np.uint32)


_BUFFERS = _Buffers()


def _reduce(f: np.ndarray, s: ColumnStats) -> None:
    """Add a float32 chunk ``f`` (zeroed in place where not finite) to ``s``. numpy's reductions run on
    this thread alone (pairwise sums), so the result does not depend on how many threads there are."""
    total = float(np.sum(f))
    if not math.isfinite(total):  # rare: count, then leave the non-finite values out
        nan, inf = np.isnan(f), np.isinf(f)
        s.nan += int(np.count_nonzero(nan))
        s.inf += int(np.count_nonzero(inf))
        f[nan | inf] = 0.0
        total = float(np.sum(f))
    square = _BUFFERS.scratch.view(np.float32)[:f.size]
    np.multiply(f, f, out=square)
    s.sum += total
    s.sumsq += float(np.sum(square))
    s.absmax = max(s.absmax, -float(np.min(f)), float(np.max(f)))


def _bf16_stats(bits: np.ndarray) -> ColumnStats:
    flat = bits.reshape(-1)
    s = ColumnStats(values=flat.size)
    for k in range(0, flat.size, CHUNK):
        n = min(CHUNK, flat.size - k)
        u = _BUFFERS.u32[:n]
        np.copyto(u, flat[k:k + n], casting="unsafe")
        np.left_shift(u, 16, out=u)  # bf16 bits are the high half of the float32 with the same value
        f = _BUFFERS.f32[:n]
        _reduce(f, s)
        if s.absmax >= FP8_MAX:
            s.fp8_limit += int(np.count_nonzero(np.abs(f) >= FP8_MAX))
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
        ok = np.isfinite(sc)
        if nan or not ok.all():  # rare: NaN codes, tokens whose scale is not finite (all their values count)
            s.nan += int(np.count_nonzero(nan_codes[ok])) + H * int(np.count_nonzero(np.isnan(sc)))
            s.inf += H * int(np.count_nonzero(np.isinf(sc)))
            f[nan_codes] = 0.0
            f[~ok] = 0.0
            sc = np.where(ok, sc, np.float32(0.0))
        if sc.size and float(np.max(np.abs(sc))) < _SCALE_FITS:  # one multiplication by 2^120 * scale
            np.multiply(f, (sc * _P120)[:, None], out=f)
        else:  # 2^120 * scale would overflow float32: two
            f *= _P120
            f *= sc[:, None]
        _reduce(_BUFFERS.f32[:n * H], s)
    return s


def column_stats(row: dict[str, Any], column: str) -> ColumnStats:
    """The statistics of one stored state of an encoded row (:func:`hs_dataset.codec.encode.encode_row`'s
    values, or a row read back): bf16 bits (uint16 ``[T, H]``) or fp8 codes (uint8) with ``<column>_scale``."""
    bits = np.asarray(row[column])
    if bits.dtype == np.uint8:
        return _fp8_stats(bits, np.asarray(row[scale_column(column)], dtype=np.float32))
    return _bf16_stats(bits.view(np.uint16))

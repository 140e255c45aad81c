"""One stored state's statistics (:class:`ColumnStats`): the kernels that count a ``[T, H]`` state fast.

A state is read in chunks of :data:`CHUNK` values into one reused float32 buffer (4 MiB: it stays in
the cache while it is summed). Few passes over a chunk, each one numpy call that releases the GIL
(about ten per chunk: a build counts on several threads beside busy Python ones): the sum and the sum
of squares are dot products of a few thousand values each (OpenBLAS's ``sdot``, below its threading
threshold), added up in float64; so the sums are the same however many threads a process has (a build
split over workers gives a single-worker build's statistics, bit for bit). Decoding takes no lookup
table (numpy's ``take`` costs 2 ns a value): bf16 bits shifted left by 16 are the float32 of the same
value, and their largest magnitude comes from the bits themselves; an fp8 e4m3 code sign-extended to
32 bits, shifted left by 20 and masked is a float32 with the code's sign, exponent and mantissa fields,
which is the fp8 value times 2^-120 for normal and subnormal codes alike; one multiplication by 2^120
gives the code's value, and the token's scale enters the per-token sums in float64. Costs:
``benchmarks/stats_overhead.py``. Non-finite values (bf16 NaN/Inf, the fp8 NaN codes 0x7F/0xFF, a token
whose scale is not finite) are counted and left out of the sums; the fast path finds them from the
chunk's sum (bf16) or each token's largest code (fp8).
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
ROW = 4096  # values per dot product (a divisor of CHUNK)
_ONES = np.ones(ROW, np.float32)
_LIMIT_CODE, _NAN_CODE = 0x7E, 0x7F  # e4m3fn magnitudes: 0x7E is 448, 0x7F is NaN
_P120 = np.float32(2.0 ** 120)
_FP8_MAGNITUDE = np.array([float(np.array(c << 20, np.uint32).view(np.float32)) * 2.0 ** 120 for c in range(128)])
_FP8_MAGNITUDE[_NAN_CODE] = 0.0  # the value of each magnitude code (NaN codes are left out)


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
    """Each thread's chunk buffers (a uint32 array, its float32 view, a uint8 array)."""

    def __init__(self) -> None:
        self.u32 = np.empty(CHUNK, np.uint32)
        self.f32 = self.u32.view(np.float32)
        self.u8 = np.empty(CHUNK, np.uint8)


_BUFFERS = _Buffers()


def _sums(f: np.ndarray) -> tuple[float, float]:
    """The sum and the sum of squares of a float32 chunk: dot products of :data:`ROW` values (one numpy call
    each for all rows, one pass over the chunk each), added up in float64. A row is below OpenBLAS's
    threading threshold (10,000 values), so each dot product runs on the calling thread alone and the sums
    are the same however many threads a process has."""
    rows = f.size // ROW * ROW
    whole = f[:rows].reshape(-1, ROW)
    total = float(np.sum(np.vecdot(whole, _ONES), dtype=np.float64))
    square = float(np.sum(np.vecdot(whole, whole), dtype=np.float64))
    if rows < f.size:
        rest = f[rows:]
        total += float(np.dot(rest, _ONES[:rest.size]))
        square += float(np.dot(rest, rest))
    return total, square


def _reduce(f: np.ndarray, s: ColumnStats, absmax: float) -> None:
    """Add a float32 chunk ``f`` (zeroed in place where not finite) to ``s``; ``absmax``: its largest
    magnitude, found from its bf16 bits (unless some values are not finite)."""
    total, square = _sums(f)
    if not math.isfinite(total):  # rare: count, then leave the non-finite values out
        nan, inf = np.isnan(f), np.isinf(f)
        s.nan += int(np.count_nonzero(nan))
        s.inf += int(np.count_nonzero(inf))
        f[nan | inf] = 0.0
        total, square = _sums(f)
        absmax = max(-float(np.min(f)), float(np.max(f)))
    s.sum += total
    s.sumsq += square
    s.absmax = max(s.absmax, absmax)


def _bf16_absmax(bits: np.ndarray) -> float:
    """The largest magnitude of finite bf16 values ``bits`` (uint16), from the bits alone: a bf16 value's
    magnitude grows with its bits; as int16 the largest is the largest positive value (when there is one),
    as uint16 the largest is the negative value of largest magnitude (when there is one)."""
    positive = int(np.max(bits.view(np.int16)))
    negative = int(np.max(bits)) - 0x8000
    top = max(positive, negative, 0)
    return float(np.array(top << 16, np.uint32).view(np.float32))


def _bf16_stats(bits: np.ndarray) -> ColumnStats:
    flat = bits.reshape(-1)
    s = ColumnStats(values=flat.size)
    for k in range(0, flat.size, CHUNK):
        n = min(CHUNK, flat.size - k)
        u = _BUFFERS.u32[:n]
        np.copyto(u, flat[k:k + n], casting="unsafe")
        np.left_shift(u, 16, out=u)  # bf16 bits are the high half of the float32 with the same value
        f = _BUFFERS.f32[:n]
        _reduce(f, s, _bf16_absmax(flat[k:k + n]))
        if s.absmax >= FP8_MAX:
            s.fp8_limit += int(np.count_nonzero(np.abs(f) >= FP8_MAX))
    return s


def _piece(H: int) -> int:
    """The length of the dot products over a token of width ``H``: its largest divisor up to 8,192 (below
    OpenBLAS's threading threshold, see :func:`_sums`)."""
    return next(d for d in range(min(H, 8192), 0, -1) if H % d == 0)


def _fp8_stats(q: np.ndarray, scale: np.ndarray) -> ColumnStats:
    T, H = q.shape
    s = ColumnStats(values=T * H)
    step = max(1, CHUNK // max(H, 1))
    piece = _piece(H)
    ones = np.ones(piece, np.float32)
    for t0 in range(0, T, step):
        qc, sc = q[t0:t0 + step], scale[t0:t0 + step].astype(np.float64)
        n = qc.shape[0]
        mag = _BUFFERS.u8[:n * H].reshape(n, H)
        np.bitwise_and(qc, 0x7F, out=mag)  # the magnitude code
        s.fp8_limit += int(np.count_nonzero(mag == _LIMIT_CODE))
        top = np.max(mag, axis=1)  # each token's largest magnitude code
        ok = np.isfinite(sc)
        nan_codes = None
        if n and int(top.max()) == _NAN_CODE:  # rare: NaN codes, counted where the token's scale is finite
            nan_codes = mag == _NAN_CODE
            s.nan += int(np.count_nonzero(nan_codes[ok]))
            mag[nan_codes] = 0
            top = np.max(mag, axis=1)
        if not ok.all():  # rare: tokens whose scale is not finite (all their values count)
            s.nan += H * int(np.count_nonzero(np.isnan(sc)))
            s.inf += H * int(np.count_nonzero(np.isinf(sc)))
            sc = np.where(ok, sc, 0.0)
        u = _BUFFERS.u32[:n * H].reshape(n, H)
        np.copyto(u.view(np.int32), qc.view(np.int8), casting="unsafe")  # sign-extended: the sign in bit 31
        np.left_shift(u, 20, out=u)
        np.bitwise_and(u, 0x87F00000, out=u)  # sign | magnitude << 20: the code's value times 2^-120
        f = _BUFFERS.f32[:n * H].reshape(n, H)
        np.multiply(f, _P120, out=f)  # the code's value
        if nan_codes is not None:
            f[nan_codes] = 0.0
        pieces = f.reshape(n, H // piece, piece)
        token_sum = np.sum(np.vecdot(pieces, ones), axis=1, dtype=np.float64)
        token_sumsq = np.sum(np.vecdot(pieces, pieces), axis=1, dtype=np.float64)
        s.sum += float(np.sum(token_sum * sc))
        s.sumsq += float(np.sum(token_sumsq * (sc * sc)))
        if n:
            s.absmax = max(s.absmax, float(np.max(_FP8_MAGNITUDE[top] * np.abs(sc))))
    return s


def column_stats(row: dict[str, Any], column: str) -> ColumnStats:
    """The statistics of one stored state of an encoded row (:func:`hs_dataset.codec.encode.encode_row`'s
    values, or a row read back): bf16 bits (uint16 ``[T, H]``) or fp8 codes (uint8) with ``<column>_scale``."""
    bits = np.asarray(row[column])
    if bits.dtype == np.uint8:
        return _fp8_stats(bits, np.asarray(row[scale_column(column)], dtype=np.float32))
    return _bf16_stats(bits.view(np.uint16))

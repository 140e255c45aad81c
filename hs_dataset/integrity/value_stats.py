"""One stored state's statistics (:class:`ColumnStats`): the kernels that count a ``[T, H]`` state fast.

A build counts states on worker threads beside busy Python threads (its own, the ring reader), so
what costs is not the arithmetic but each return from a call that released the GIL: the thread waits
up to the switch interval to get it back (``benchmarks/stats_overhead.py --threads``). So the kernels
are torch's, a handful of calls per :data:`STEP_VALUES` values (a whole
2,048-token Kimi-width state), each one parallel inside torch: a state is decoded into a reused
float32 buffer (bf16 bits by a copy; fp8 e4m3 codes sign-extended to 32 bits, shifted left by 20 and
masked, which is a float32 with the code's sign, exponent and mantissa fields, the fp8 value times
2^-120 for normal and subnormal codes alike, then multiplied by 2^120), summed and its norm taken in
rows of at most 8,192 values, its extremes found. Every row is reduced by one thread (torch splits a
reduction across threads only above 32,768 values), and rows are added up in float64 by numpy, so the sums are the
same however many threads a process has (a build split over workers gives a single-worker build's
statistics, bit for bit). An fp8 token's scale enters its sums in float64. Non-finite values (bf16
NaN/Inf, the fp8 NaN codes 0x7F/0xFF, a token whose scale is not finite) are counted and left out of
the sums; the fast path finds them from the sums.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from hs_dataset.codec.fp8 import FP8_MAX
from hs_dataset.layout import scale_column

__all__ = ["STEP_VALUES", "ColumnStats", "column_stats", "saturation_limit"]

STEP_VALUES = 1 << 24  # values decoded at once (a 64 MiB float32 buffer for each state being counted)
_LIMIT_CODE, _NAN_CODE = 0x7E, 0x7F  # e4m3fn magnitudes: 0x7E is 448, 0x7F is NaN
_SIGN_MAGNITUDE = int(np.array(0x87F00000, np.uint32).view(np.int32))  # bit 31 and bits 20-26, as int32
_P120 = 2.0 ** 120
_FP8_MAGNITUDE = np.array([float(np.array(c << 20, np.uint32).view(np.float32)) * _P120 for c in range(128)])
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


@dataclass
class _Buffers:
    """Decode buffers of ``n`` values: the decoded values (int32, viewed as float32), the fp8 magnitude
    codes (uint8), comparisons (bool)."""

    i32: torch.Tensor
    u8: torch.Tensor
    b: torch.Tensor

    @classmethod
    def new(cls, n: int) -> "_Buffers":
        return cls(torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.bool))

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.i32[:n], self.u8[:n], self.b[:n]


_FREE: list[_Buffers] = []  # buffers of STEP_VALUES values, kept for the next state: a build's counting threads
_FREE_LOCK = threading.Lock()  # come and go with its parts, and fresh memory costs a page fault per 4 KiB


@contextmanager
def _buffers(n: int) -> Iterator[_Buffers]:
    """Buffers of at least ``n`` values (at most :data:`STEP_VALUES`), from the free list or new, then back to it."""
    with _FREE_LOCK:
        buf = _FREE.pop() if _FREE and _FREE[-1].i32.numel() >= n else None
    if buf is None:
        buf = _Buffers.new(STEP_VALUES if n <= STEP_VALUES else n)
    try:
        yield buf
    finally:
        with _FREE_LOCK:
            if buf.i32.numel() == STEP_VALUES:
                _FREE.append(buf)


def _piece(H: int) -> int:
    """The length of the rows a state is reduced in: ``H``'s largest divisor up to 8,192 (one thread each)."""
    return next(d for d in range(min(H, 8192), 0, -1) if H % d == 0)


def _count(b: torch.Tensor) -> int:
    """The true values of a bool tensor (``count_nonzero``: a bool ``sum`` is 20 times slower)."""
    return int(torch.count_nonzero(b))


def _row_sums(f: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``f`` (float32 ``[n, piece]``): the sum and the sum of squares, as float64."""
    total = f.sum(1).numpy().astype(np.float64)
    norm = torch.linalg.vector_norm(f, dim=1).numpy().astype(np.float64)
    return total, norm * norm


def _bf16_stats(bits: np.ndarray) -> ColumnStats:
    flat = np.ascontiguousarray(bits).reshape(-1)
    s = ColumnStats(values=flat.size)
    piece = _piece(max(bits.shape[-1], 1) if bits.ndim else 1)
    x = torch.from_numpy(flat.view(np.int16)).view(-1, piece)
    step = max(1, STEP_VALUES // piece)
    with _buffers(min(x.numel(), step * piece)) as buf:
        for r0 in range(0, x.shape[0], step):
            _bf16_step(x[r0:r0 + step], buf, s)
    return s


def _bf16_step(xs: torch.Tensor, buf: _Buffers, s: ColumnStats) -> None:
    """Add rows ``xs`` (bf16 bits as int16, ``[n, piece]``) to ``s``."""
    i32, _, b = buf.take(xs.numel())
    i32, b = i32.view(xs.shape), b.view(xs.shape)
    i32.copy_(xs)  # sign-extended: the bits in the low half
    i32.bitwise_left_shift_(16)  # bf16 bits are the high half of the float32 with the same value
    f = i32.view(torch.float32)
    total, square = _row_sums(f)
    if not np.isfinite(total).all():  # rare: count, then leave the non-finite values out
        nan, inf = torch.isnan(f), torch.isinf(f)
        s.nan += _count(nan)
        s.inf += _count(inf)
        f.masked_fill_(nan | inf, 0.0)
        total, square = _row_sums(f)
    s.sum += float(np.sum(total))
    s.sumsq += float(np.sum(square))
    lo, hi = torch.aminmax(f)
    top = max(-float(lo), float(hi))
    s.absmax = max(s.absmax, top)
    if top >= FP8_MAX:
        s.fp8_limit += _count(torch.ge(f.abs_(), FP8_MAX, out=b))  # f is not needed after this


def _fp8_stats(q: np.ndarray, scale: np.ndarray) -> ColumnStats:
    T, H = q.shape
    s = ColumnStats(values=T * H)
    codes = torch.from_numpy(np.ascontiguousarray(q))
    step = max(1, STEP_VALUES // max(H, 1))
    with _buffers(min(T, step) * H) as buf:
        for t0 in range(0, T, step):
            _fp8_step(codes[t0:t0 + step], scale[t0:t0 + step].astype(np.float64), buf, s)
    return s


def _fp8_step(qc: torch.Tensor, sc: np.ndarray, buf: _Buffers, s: ColumnStats) -> None:
    """Add tokens ``qc`` (fp8 e4m3 codes, uint8 ``[n, H]``) with scales ``sc`` to ``s``."""
    n, H = qc.shape
    piece = _piece(max(H, 1))
    i32, mag, b = buf.take(n * H)
    i32, mag, b = i32.view(n, H), mag.view(n, H), b.view(n, H)
    torch.bitwise_and(qc, 0x7F, out=mag)  # the magnitude code
    s.fp8_limit += _count(torch.eq(mag, _LIMIT_CODE, out=b))
    i32.copy_(qc.view(torch.int8))  # sign-extended: the sign in bit 31
    i32.bitwise_left_shift_(20)
    i32.bitwise_and_(_SIGN_MAGNITUDE)  # sign | magnitude << 20: the code's value times 2^-120
    f = i32.view(torch.float32)
    f.mul_(_P120)  # the code's value
    total, square = (a.reshape(n, -1).sum(1) for a in _row_sums(f.view(-1, piece)))
    ok = np.isfinite(sc)
    if not (np.isfinite(total).all() and ok.all()):  # rare: NaN codes, tokens whose scale is not finite
        nan_codes = torch.eq(mag, _NAN_CODE)
        s.nan += int(nan_codes.sum(1).numpy()[ok].sum()) + H * int(np.count_nonzero(np.isnan(sc)))
        s.inf += H * int(np.count_nonzero(np.isinf(sc)))
        f.masked_fill_(nan_codes, 0.0)
        mag.masked_fill_(nan_codes, 0)
        total, square = (a.reshape(n, -1).sum(1) for a in _row_sums(f.view(-1, piece)))
        sc = np.where(ok, sc, 0.0)
    s.sum += float(np.sum(total * sc))
    s.sumsq += float(np.sum(square * (sc * sc)))
    if n:  # each token's largest magnitude code (a magnitude grows with its code), times its scale
        top = _FP8_MAGNITUDE[torch.amax(mag, dim=1).numpy()]
        s.absmax = max(s.absmax, float(np.max(top * np.abs(sc))))


def column_stats(row: dict[str, Any], column: str) -> ColumnStats:
    """The statistics of one stored state of an encoded row (:func:`hs_dataset.codec.encode.encode_row`'s
    values, or a row read back): bf16 bits (uint16 ``[T, H]``) or fp8 codes (uint8) with ``<column>_scale``."""
    bits = np.asarray(row[column])
    if not bits.flags.writeable:  # a state mapped from a shard (verify --stats): torch has no read-only tensors
        bits = bits.copy()  # (torch.from_numpy warns); one copy beside the counting's several passes over it
    if bits.dtype == np.uint8:
        return _fp8_stats(bits, np.asarray(row[scale_column(column)], dtype=np.float32))
    return _bf16_stats(bits.view(np.uint16))

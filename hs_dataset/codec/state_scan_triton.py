"""The GPU path of :func:`hs_dataset.codec.state_scan.scan_state`: one Triton program per token.

Each program loads a token's ``H`` values once and computes, in float32 registers: whether any is NaN or Inf;
the bf16 values' sum, sum of squares, largest magnitude and count at or beyond 448; and with ``QUANT`` the
fp8 e4m3fn codes and scale exactly as :func:`hs_dataset.codec.fp8.fp8_quantize` makes them (every step an
IEEE float32 operation with round-to-nearest: ``max(amax, 1e-12) * (1/448)``, a division rounded to nearest
(``div_rn``, not Triton's default approximate one), the clamp, the round-to-nearest-even fp8 cast) and the
same four statistics of the fp8 values (the count: codes of magnitude 448). PyTorch then turns the float32
sums into :func:`hs_dataset.codec.state_stats.token_stats`' float64 layout, each token's scale applied in
float64. The GPU test compares this with the PyTorch path bit for bit (codes, scales, NaN/Inf tokens) and
within the statistics' tolerance.

Imports Triton at module level: loaded only on a GPU, by :func:`~hs_dataset.codec.state_scan.scan_state`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hs_dataset.codec.fp8 import FP8_MAX
from hs_dataset.codec.state_stats import FIELDS

__all__ = ["scan_rows"]

_COLS = 9  # per token: bf16 sum, sumsq, absmax, limit count; NaN/Inf count; fp8 sum, sumsq, absmax, limit count


@triton.jit
def _scan_kernel(x_ptr, row_stride, H, stats_ptr, codes_ptr, scales_ptr,
                 QUANT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < H
    xf = tl.load(x_ptr + row * row_stride + offs, mask=inside, other=0.0).to(tl.float32)
    out = stats_ptr + row * 9  # _COLS
    bad = (xf != xf) | (tl.abs(xf) == float("inf"))
    v = xf.to(tl.bfloat16).to(tl.float32)  # the stored bf16 value
    av = tl.abs(v)
    tl.store(out + 0, tl.sum(v, axis=0))
    tl.store(out + 1, tl.sum(v * v, axis=0))
    tl.store(out + 2, tl.max(av, axis=0))
    tl.store(out + 3, tl.sum((av >= 448.0).to(tl.float32), axis=0))
    tl.store(out + 4, tl.sum(bad.to(tl.float32), axis=0))
    if QUANT:
        amax = tl.max(tl.abs(xf), axis=0)
        scale = tl.maximum(amax, 1e-12) * 0.002232142857142857  # float32(1/448), as fp8_quantize multiplies
        q = tl.math.div_rn(xf, scale)
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        q8 = q.to(tl.float8e4nv)
        codes = q8.to(tl.uint8, bitcast=True)
        tl.store(codes_ptr + row * H + offs, codes, mask=inside)
        tl.store(scales_ptr + row, scale)
        qv = q8.to(tl.float32)
        aq = tl.abs(qv)
        tl.store(out + 5, tl.sum(qv, axis=0))
        tl.store(out + 6, tl.sum(qv * qv, axis=0))
        tl.store(out + 7, tl.max(aq, axis=0))
        tl.store(out + 8, tl.sum((aq == 448.0).to(tl.float32), axis=0))  # codes 0x7E / 0xFE (0x7F is NaN)


def _fields(sums: torch.Tensor, H: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[T, 4]`` (sum, sumsq, absmax, limit count) -> float64 ``[T, 5]`` in :data:`FIELDS`' order."""
    out = torch.empty((sums.shape[0], len(FIELDS)), dtype=torch.float64, device=sums.device)
    out[:, 0] = H
    out[:, 1:] = sums
    if scales is not None:
        s = scales.double()
        out[:, 1:4] *= torch.stack([s, s * s, s], dim=1)
    return out


def scan_rows(x: torch.Tensor, fp8: bool) -> tuple:
    """:func:`~hs_dataset.codec.state_scan.scan_state` of a CUDA tensor ``[T, H]`` (last dimension contiguous):
    the fields of its :class:`~hs_dataset.codec.state_scan.StateScan`, in order."""
    assert FP8_MAX == 448.0  # the kernel's constants
    T, H = x.shape
    stats = torch.empty((T, _COLS), dtype=torch.float32, device=x.device)
    codes = torch.empty((T, H) if fp8 else (1,), dtype=torch.uint8, device=x.device)
    scales = torch.empty((T,) if fp8 else (1,), dtype=torch.float32, device=x.device)
    if T:
        block = triton.next_power_of_2(H)
        _scan_kernel[(T,)](x, x.stride(0), H, stats, codes, scales, QUANT=fp8, BLOCK=block,
                           num_warps=max(4, min(32, block // 512)))
    return (stats[:, 4] > 0, _fields(stats[:, :4], H), (codes, scales) if fp8 else None,
            _fields(stats[:, 5:], H, scales) if fp8 else None)

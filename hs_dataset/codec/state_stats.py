"""The statistics of stored states counted where the states are made: on the GPU, in the SGLang plugin.

A build records for each state column the number of values, their sum and sum of squares, the largest
magnitude and the values at the float8 e4m3 limit (:class:`hs_dataset.integrity.value_stats.ColumnStats`).
Counted on the builder's host, these cost more than writing the rows: on the H200's host at Kimi width the
counting threads held a build into /dev/shm to 0.42x of the engine's prefill (they wait for the GIL
between kernel calls while the build's own threads run Python). The plugin already reads every state on
the GPU (NaN/Inf counts, fp8 quantization), so it counts these there too, in the same read
(:func:`hs_dataset.codec.state_scan.scan_state`, a Triton kernel; :func:`token_stats` here is its PyTorch
form, for the CPU and as the reference), and hands each request's totals to the builder with its rows.

The values counted are those stored, as :mod:`hs_dataset.integrity.value_stats` counts them from a shard:
bf16 values as bf16; fp8 as ``code * scale``, each token's scale applied in float64. Per token, the sums are
float32 reductions of its ``H`` values; tokens add up in float64. So these equal a recount from the shards
within :data:`hs_dataset.integrity.summary.REL_TOLERANCE`, and the counts exactly. NaN and Inf are not
counted here: a sample holding any is not stored (``on_nonfinite``; the plugin counts their positions).

Imports nothing but torch and NumPy: the SGLang plugin loads it in the scheduler process.
"""

from __future__ import annotations

import numpy as np
import torch

from hs_dataset.codec.fp8 import FP8_MAX

__all__ = ["FIELDS", "ROWS_AT_ONCE", "add_stats", "span_stats", "token_stats"]

FIELDS = ("values", "sum", "sumsq", "absmax", "fp8_limit")  # a state's statistics: float64 [..., len(FIELDS)]
_ABSMAX = FIELDS.index("absmax")
_ADDED = [i for i, f in enumerate(FIELDS) if f != "absmax"]
ROWS_AT_ONCE = 4096  # tokens reduced at once: bounds the temporaries (a 4,096 x 7,168 bf16 copy is 59 MB)
_LIMIT_CODE = 0x7E  # the e4m3fn magnitude code of 448


def token_stats(x: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Per token of one stored state ``[T, H]``: float64 ``[T, 5]`` (:data:`FIELDS`), on ``x``'s device.

    Args:
        x: the bf16 values, or, with ``scales``, the float8 e4m3fn codes as ``uint8``.
        scales: float32 ``[T]``, each token's scale (:mod:`hs_dataset.codec.fp8`).
    """
    T, H = x.shape
    out = torch.empty((T, len(FIELDS)), dtype=torch.float64, device=x.device)
    out[:, 0] = H
    for a in range(0, T, ROWS_AT_ONCE):
        c = x[a:a + ROWS_AT_ONCE]
        if scales is None:
            v = c
            limit = (v.abs() >= FP8_MAX).sum(dim=-1)  # what an unscaled fp8 cast would saturate
        else:
            v = c.view(torch.float8_e4m3fn).to(torch.bfloat16)  # exact: every e4m3 value is a bf16 value
            limit = (torch.bitwise_and(c, 0x7F) == _LIMIT_CODE).sum(dim=-1)
        lo, hi = torch.aminmax(v, dim=-1)
        o = out[a:a + ROWS_AT_ONCE]
        o[:, 1] = v.sum(dim=-1, dtype=torch.float32)
        o[:, 2] = torch.linalg.vector_norm(v, dim=-1, dtype=torch.float32).double().square()
        o[:, 3] = torch.maximum(-lo, hi)
        o[:, 4] = limit
    if scales is not None:
        s = scales.double()
        out[:, 1] *= s
        out[:, 2] *= s * s
        out[:, 3] *= s.abs()
    return out


def span_stats(per_token: "np.ndarray | torch.Tensor", spans: list[tuple[int, int]]) -> np.ndarray:
    """Add up ``per_token`` (``[S, T, 5]``: :func:`token_stats` of ``S`` states, on the CPU) over each span of
    tokens ``(offset, length)``: float64 ``[S, len(spans), 5]`` (the largest magnitude is the span's largest).

    NumPy, two reductions for all spans at once: the plugin runs it on its completion thread in SGLang's
    scheduler process, where every call that lets go of the GIL waits to take it back from the scheduler's
    thread (up to the 5 ms switch interval while that thread runs Python: between builds' passes it polls
    for requests). Done as a dozen PyTorch calls per request, that wait held a pass's completion for about a
    second once the engine went idle, and the last rows of a build arrived that much late (``benchmarks/compact.py``'s
    capture rows)."""
    pt = np.asarray(per_token, dtype=np.float64)
    S, T, F = pt.shape
    out = np.zeros((S, len(spans), F), dtype=np.float64)
    order = sorted((off, n, i) for i, (off, n) in enumerate(spans) if n)
    if not order:
        return out
    if any(a + n > b for (a, n, _), (b, _, _) in zip(order, order[1:])) or order[-1][0] + order[-1][1] > T:
        raise ValueError(f"spans {spans} overlap or run past the {T} tokens")
    # np.*.reduceat: element 2j reduces [start_j, end_j) (the next index); the last end may be T, which reduceat
    # takes as "to the end" when it is left out
    idx = [x for off, n, _ in order for x in (off, off + n)]
    if idx[-1] == T:
        idx.pop()
    sums = np.add.reduceat(pt, idx, axis=1)[:, ::2]
    peaks = np.maximum.reduceat(pt[..., _ABSMAX], idx, axis=1)[:, ::2]
    rows = [i for _, _, i in order]
    out[:, rows] = sums
    out[:, rows, _ABSMAX] = peaks
    return out


def add_stats(total: np.ndarray, part: np.ndarray) -> None:
    """``total += part`` in place for statistics ``[..., 5]`` (:data:`FIELDS`), the largest magnitude the larger
    (NumPy, for the reason :func:`span_stats` gives)."""
    total[..., _ADDED] += part[..., _ADDED]
    np.maximum(total[..., _ABSMAX], part[..., _ABSMAX], out=total[..., _ABSMAX])

"""The GPU path of the teacher's logsumexp (:func:`hs_dataset.codec.teacher.teacher_topk`): one Triton program
per position.

Each program reads its position's logits once in their own dtype (bf16, as ``lm_head`` gives them) in blocks,
and keeps a running maximum and sum of ``exp(x - max)`` per lane in float32 (the online softmax), then adds the
lanes up: ``logsumexp`` of the float32 values without a float32 copy of the logits (the PyTorch path makes one,
``[chunk, vocab]`` float32, and reads it again). The GPU test holds it to ``torch.logsumexp`` of the float32
logits within 1e-5.

The same pass also takes the maximum of each segment of ``seg`` consecutive logits, from which
:func:`~hs_dataset.codec.teacher.topk_of_segments` takes the top-k among the best segments' logits only (``torch.topk``
over the whole vocabulary took a third of the teacher's time: 0.34 ms a 1,024-position chunk at vocabulary 32,000).

Imports Triton at module level: loaded only on a GPU, by :func:`~hs_dataset.codec.teacher.teacher_topk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["row_logsumexp"]

_BLOCK = 2048


@triton.jit
def _lse_kernel(x_ptr, row_stride, V, out_ptr, seg_ptr, NSEG, BLOCK: tl.constexpr, SEG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    m = tl.full([BLOCK], -3.0e38, tl.float32)  # finite: exp(m - m_new) of a lane with no value yet is 1, not NaN
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
        if SEG > 0:  # each segment's maximum (a segment past the vocabulary is not stored)
            segs = start // SEG + tl.arange(0, BLOCK // SEG)
            tl.store(seg_ptr + row * NSEG + segs, tl.max(tl.reshape(x, (BLOCK // SEG, SEG)), axis=1), mask=segs < NSEG)
    mx = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - mx), axis=0)
    tl.store(out_ptr + row, mx + tl.log(total))


def row_logsumexp(logits: torch.Tensor, seg: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logsumexp`` of each row of the CUDA tensor ``logits`` ``[n, vocab]`` (last dimension contiguous), in
    float32: ``[n]``; with ``seg`` (a power of two up to 2,048), also the maximum of each segment of ``seg``
    consecutive logits, float32 ``[n, ceil(vocab / seg)]`` (else None)."""
    n, v = logits.shape
    out = torch.empty((n,), dtype=torch.float32, device=logits.device)
    nseg = -(-v // seg) if seg else 0
    segmax = torch.empty((n, nseg), dtype=torch.float32, device=logits.device) if seg else None
    if n:
        _lse_kernel[(n,)](logits, logits.stride(0), v, out, out if segmax is None else segmax, nseg,
                          BLOCK=_BLOCK, SEG=seg)
    return out, segmax

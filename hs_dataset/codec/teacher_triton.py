"""The GPU path of the teacher's logsumexp (:func:`hs_dataset.codec.teacher.teacher_topk`): one Triton program
per position.

Each program reads its position's logits once in their own dtype (bf16, as ``lm_head`` gives them) in blocks,
and keeps a running maximum and sum of ``exp(x - max)`` per lane in float32 (the online softmax), then adds the
lanes up: ``logsumexp`` of the float32 values without a float32 copy of the logits (the PyTorch path makes one,
``[chunk, vocab]`` float32, and reads it again). The GPU test holds it to ``torch.logsumexp`` of the float32
logits within 1e-5.

Imports Triton at module level: loaded only on a GPU, by :func:`~hs_dataset.codec.teacher.teacher_topk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["row_logsumexp"]

_BLOCK = 2048


@triton.jit
def _lse_kernel(x_ptr, row_stride, V, out_ptr, BLOCK: tl.constexpr):
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
    mx = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - mx), axis=0)
    tl.store(out_ptr + row, mx + tl.log(total))


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` of each row of the CUDA tensor ``logits`` ``[n, vocab]`` (last dimension contiguous), in
    float32: ``[n]``."""
    n, v = logits.shape
    out = torch.empty((n,), dtype=torch.float32, device=logits.device)
    if n:
        _lse_kernel[(n,)](logits, logits.stride(0), v, out, BLOCK=_BLOCK)
    return out

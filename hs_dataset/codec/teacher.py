"""The teacher's top-k: what an EAGLE-3 distillation loss needs of the target's next-token distribution.

At each position the target's logits are ``lm_head(final)`` (the final post-norm state times the output
embedding, in the model's dtype, as the model computes them), over the full vocabulary. Instead of the
final state (14 KB a token at Kimi width) a build can store, at loss-masked positions, the top-``k`` token
ids and their log-probabilities ``log_softmax(logits)`` (float32) and the full-vocabulary logsumexp
(float32): ``k * 8 + 4`` bytes (516 for k = 64). The argmax is the first id (ids are sorted by
probability, highest first). The same function runs on the GPU in the SGLang plugin and on the device
of the transformers reference, so both backends store the same numbers (up to the matrix product's
rounding on each device).

Torch only: the SGLang plugin imports this module in the scheduler process.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from hs_dataset.layout import parse_teacher

__all__ = ["SEGMENT_CANDIDATES", "TEACHER_CHUNK_BYTES", "chunk_rows", "parse_teacher", "segment_for", "segment_max",
           "teacher_topk", "teacher_topk_spans", "warm_up"]

TEACHER_CHUNK_BYTES = 256 << 20  # the logits of one matrix product, at least 1,024 positions (chunk_rows)
SEGMENT_CANDIDATES = 8192  # at most this many candidates a row for the top-k kernel (k <= 512); beyond, torch.topk

_kernel_error: str | None = None  # why the Triton kernels are not used in this process (warm_up could not compile it)


def chunk_rows(vocab: int, itemsize: int = 2) -> int:
    """Positions per matrix product: logits of about :data:`TEACHER_CHUNK_BYTES`, at least 1,024 positions
    (4,194 at the stand-in's vocabulary of 32,000; 1,024 at Kimi's 163,840: 0.34 GB of bf16 logits). From 1,024 to
    16,384 positions a chunk moves the teacher's time by less than the runs' spread (``benchmarks/teacher_cost.py``),
    so the chunk is chosen to bound the logits' memory."""
    return max(1024, TEACHER_CHUNK_BYTES // (itemsize * max(vocab, 1)))


def segment_for(vocab: int, k: int) -> int:
    """Logits a segment for the top-k kernel: the power of two at or above ``sqrt(vocab / k)`` (16 to 2,048), which
    keeps the two things it sorts about the same size (the segments' maxima, ``vocab / segment``, and the best
    segments' logits, ``k * segment``): 32 at the stand-in's vocabulary of 32,000 and k = 64, 64 at Kimi's 163,840,
    the fastest of the sizes tried at each (``benchmarks/teacher_cost.py``)."""
    return min(2048, max(16, 1 << max(0, math.ceil(math.sqrt(vocab / max(k, 1))) - 1).bit_length()))


def teacher_topk(final: torch.Tensor, weight: torch.Tensor, k: int, *, chunk: int | None = None,
                 kernel: bool | None = None, segment: int | None = None,
                 logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``log_softmax(final @ weight.T)`` per row: ids int32 ``[n, k]`` (highest first, the lower id
    first among tied values on the GPU path), log-probs float32 ``[n, k]``, logsumexp float32 ``[n]``; on
    ``final``'s device. With ``logits``, the top-``k``'s logits (float32) instead of their log-probs: what a rank
    holding part of the vocabulary hands to the merge (:mod:`hs_dataset.codec.teacher_shards`).

    ``weight``: the output embedding ``[vocab, H]`` (only the vocabulary's rows: no padding rows). The
    product runs in ``final``'s dtype (bf16, as the model's ``lm_head``), the softmax in float32.

    Args:
        chunk: positions per matrix product (default: :func:`chunk_rows` of the vocabulary).
        kernel: on a CUDA tensor (default, unless :func:`warm_up` could not compile it), two Triton kernels
            (:mod:`hs_dataset.codec.teacher_triton`) read the logits as they are (their float32 values are the same
            numbers): no float32 copy of the ``[chunk, vocab]`` logits. The first takes each row's logsumexp and the
            maximum of each ``segment`` consecutive logits; the second, in one program a row, the row's ``k``
            segments with the highest maxima and the top-``k`` of their ``k * segment`` logits (exact: no logit left
            out is higher than the lowest of those ``k`` maxima). ``segment``: default :func:`segment_for`;
            ``0``: ``torch.topk`` of the whole vocabulary instead of the second kernel.
            Otherwise (the CPU, ``kernel=False``) the logits are copied to float32 first and PyTorch takes both:
            the reference the GPU test holds the kernels to.
    """
    if kernel is None:
        kernel = _kernel_error is None and final.is_cuda
    if kernel:
        from hs_dataset.codec.teacher_triton import row_logsumexp, segment_topk  # optional: Triton, on a GPU only
    n = final.shape[0]
    ids = torch.empty((n, k), dtype=torch.int32, device=final.device)
    logprobs = torch.empty((n, k), dtype=torch.float32, device=final.device)
    lse = torch.empty((n,), dtype=torch.float32, device=final.device)
    w = weight.to(final.dtype)
    chunk = chunk or chunk_rows(w.shape[0], w.element_size())
    if segment is None:
        segment = segment_for(w.shape[0], k)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        x = torch.nn.functional.linear(final[a:b], w)
        if kernel and segment and (1 << (k - 1).bit_length()) * segment <= SEGMENT_CANDIDATES:
            s, segmax = row_logsumexp(x, segment)
            # the kernel writes logit - lse: with zeros for lse, the logit itself
            segment_topk(x, cast(torch.Tensor, segmax), torch.zeros_like(s) if logits else s, segment, ids[a:b],
                         logprobs[a:b])
            lse[a:b] = s
            del x
            continue
        if kernel:
            s, _ = row_logsumexp(x)
            vals, top = x.topk(k, dim=-1)
        else:
            x = x.float()
            s = torch.logsumexp(x, dim=-1)
            vals, top = x.topk(k, dim=-1)
        ids[a:b] = top
        if logits:
            logprobs[a:b] = vals
        else:
            torch.sub(vals.float(), s[:, None], out=logprobs[a:b])
        lse[a:b] = s
        del x
    return ids, logprobs, lse


def teacher_topk_spans(final: torch.Tensor, weight: torch.Tensor, spans: list[tuple[int, int, int]], *,
                       logits: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`teacher_topk` of the rows ``final[off:off + n]`` of each span ``(off, n, k)`` (one prefill pass's
    requests), in that order: spans that follow one another with the same ``k`` are computed in one call, so
    a pass of short requests takes as few matrix products and top-k launches as one long request. ``logits``: as
    :func:`teacher_topk`'s."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(spans)
    i = 0
    while i < len(order):
        j = i + 1
        while (j < len(order) and spans[order[j]][0] == spans[order[j - 1]][0] + spans[order[j - 1]][1]
               and spans[order[j]][2] == spans[order[i]][2]):
            j += 1
        lo = spans[order[i]][0]
        hi = spans[order[j - 1]][0] + spans[order[j - 1]][1]
        ids, logprobs, lse = teacher_topk(final[lo:hi], weight, spans[order[i]][2], logits=logits)
        for m in order[i:j]:
            a, b = spans[m][0] - lo, spans[m][0] - lo + spans[m][1]
            out[m] = (ids[a:b], logprobs[a:b], lse[a:b])
        i = j
    return [cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], t) for t in out]  # every span's is set


def segment_max(logits: torch.Tensor, segment: int) -> torch.Tensor:
    """The maximum of each ``segment`` consecutive logits of each row, float32 ``[n, ceil(vocab / segment)]`` (what
    the Triton kernel takes in its logsumexp pass; this is the PyTorch reference of it)."""
    n, v = logits.shape
    pad = -v % segment
    x = torch.nn.functional.pad(logits.float(), (0, pad), value=float("-inf"))
    return x.view(n, -1, segment).amax(-1)


def warm_up(vocab: int, dtype: torch.dtype = torch.bfloat16, k: int = 64) -> str | None:
    """Compile the kernels for a vocabulary of ``vocab`` and a top-``k`` on the current GPU (Triton compiles on first
    use, a second or more, and again for another vocabulary, segment size or power of two at or above ``k``): the
    SGLang plugin calls it when the model is loaded, for ``k`` = 64, so a build of ``topk:64`` does not wait for it
    (another ``k`` may compile at its first pass).

    Returns:
        None, or why the kernels cannot be used here (Triton missing, a compiler failure):
        :func:`teacher_topk` then takes the PyTorch path in this process.
    """
    global _kernel_error
    try:
        teacher_topk(torch.zeros((2, 16), dtype=dtype, device="cuda"), torch.ones((vocab, 16), device="cuda"),
                     min(k, vocab), kernel=True)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure of the optional kernels leaves the PyTorch path
        _kernel_error = f"{type(e).__name__}: {str(e)[:300]}"
    return _kernel_error

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

from typing import cast

import torch

from hs_dataset.layout import parse_teacher

__all__ = ["TEACHER_CHUNK_BYTES", "TOPK_SEGMENT", "chunk_rows", "parse_teacher", "segment_max", "teacher_topk",
           "teacher_topk_spans", "topk_of_segments", "warm_up"]

TEACHER_CHUNK_BYTES = 256 << 20  # the logits of one matrix product, at least 1,024 positions (chunk_rows)
TOPK_SEGMENT = 64  # the kernel path's top-k looks at the k best segments of this many logits (topk_of_segments)

_kernel_error: str | None = None  # why the Triton logsumexp is not used in this process (warm_up could not compile it)


def chunk_rows(vocab: int, itemsize: int = 2) -> int:
    """Positions per matrix product: logits of about :data:`TEACHER_CHUNK_BYTES`, at least 1,024 positions
    (4,194 at the stand-in's vocabulary of 32,000; 1,024 at Kimi's 163,840: 0.34 GB of bf16 logits). Each chunk
    also launches the top-k's kernels (0.24 ms a 1,024-position chunk on the H200; how that grows with the chunk
    is what ``benchmarks/teacher_cost.py --chunks`` measures, not yet run)."""
    return max(1024, TEACHER_CHUNK_BYTES // (itemsize * max(vocab, 1)))


def teacher_topk(final: torch.Tensor, weight: torch.Tensor, k: int, *, chunk: int | None = None,
                 kernel: bool | None = None, segment: int = TOPK_SEGMENT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``log_softmax(final @ weight.T)`` per row: ids int32 ``[n, k]`` (highest first),
    log-probs float32 ``[n, k]``, logsumexp float32 ``[n]``; on ``final``'s device.

    ``weight``: the output embedding ``[vocab, H]`` (only the vocabulary's rows: no padding rows). The
    product runs in ``final``'s dtype (bf16, as the model's ``lm_head``), the softmax in float32.

    Args:
        chunk: positions per matrix product (default: :func:`chunk_rows` of the vocabulary).
        kernel: on a CUDA tensor (default, unless :func:`warm_up` could not compile it), the logsumexp is a
            Triton kernel over the logits as they are (:mod:`hs_dataset.codec.teacher_triton`) and the top-k is
            taken of them as they are (their float32 values are the same numbers): no float32 copy of the
            ``[chunk, vocab]`` logits. The same pass takes the maximum of each ``segment`` consecutive logits, and
            the top-k is taken among the ``k`` segments with the highest maxima only (:func:`topk_of_segments`;
            ``segment=0``: of the whole vocabulary).
            Otherwise (the CPU, ``kernel=False``) the logits are copied to float32 first and PyTorch takes both:
            the reference the GPU test holds the kernel to.
    """
    if kernel is None:
        kernel = _kernel_error is None and final.is_cuda
    if kernel:
        from hs_dataset.codec.teacher_triton import row_logsumexp  # optional: Triton, on a GPU only
    n = final.shape[0]
    ids = torch.empty((n, k), dtype=torch.int32, device=final.device)
    logprobs = torch.empty((n, k), dtype=torch.float32, device=final.device)
    lse = torch.empty((n,), dtype=torch.float32, device=final.device)
    w = weight.to(final.dtype)
    chunk = chunk or chunk_rows(w.shape[0], w.element_size())
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        logits = torch.nn.functional.linear(final[a:b], w)
        if kernel:
            s, segmax = row_logsumexp(logits, segment)
            vals, top = topk_of_segments(logits, segmax, k, segment) if segmax is not None else logits.topk(k, dim=-1)
        else:
            logits = logits.float()
            s = torch.logsumexp(logits, dim=-1)
            vals, top = logits.topk(k, dim=-1)
        ids[a:b] = top
        torch.sub(vals.float(), s[:, None], out=logprobs[a:b])
        lse[a:b] = s
        del logits
    return ids, logprobs, lse


def teacher_topk_spans(final: torch.Tensor, weight: torch.Tensor,
                       spans: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`teacher_topk` of the rows ``final[off:off + n]`` of each span ``(off, n, k)`` (one prefill pass's
    requests), in that order: spans that follow one another with the same ``k`` are computed in one call, so
    a pass of short requests takes as few matrix products and top-k launches as one long request."""
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
        ids, logprobs, lse = teacher_topk(final[lo:hi], weight, spans[order[i]][2])
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


def topk_of_segments(logits: torch.Tensor, segmax: torch.Tensor, k: int,
                     segment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.topk(k)`` (values, int64 ids; highest first) taken among the logits of each row's ``k`` segments
    with the highest maxima (``segmax``: :func:`segment_max`), ``k * segment`` candidates instead of the vocabulary.

    Exact (up to which of tied logits is taken): the ``k`` chosen segments' maxima are ``k`` logits at least as
    high as the lowest of them, ``t``, and every logit of another segment is at most its segment's maximum, at
    most ``t``: so no logit left out is higher than any of the top-``k`` taken.
    """
    n, v = logits.shape
    kk = min(k, segmax.shape[1])
    best = segmax.topk(kk, dim=-1, sorted=False).indices  # [n, kk]
    cols = (best[:, :, None] * segment + torch.arange(segment, device=logits.device)).reshape(n, kk * segment)
    cand = logits.gather(1, cols.clamp_max(v - 1))
    cand.masked_fill_(cols >= v, float("-inf"))  # the last segment's positions past the vocabulary
    vals, j = cand.topk(k, dim=-1)
    return vals, cols.gather(1, j)


def warm_up(vocab: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Compile the logsumexp kernel for a vocabulary of ``vocab`` on the current GPU (Triton compiles on first
    use, a second or more, and again for a vocabulary of another divisibility): the SGLang plugin calls it when
    the model is loaded, so no build waits for it.

    Returns:
        None, or why the kernel cannot be used here (Triton missing, a compiler failure):
        :func:`teacher_topk` then takes the PyTorch path in this process.
    """
    global _kernel_error
    try:
        teacher_topk(torch.zeros((2, 16), dtype=dtype, device="cuda"), torch.ones((vocab, 16), device="cuda"),
                     min(4, vocab), kernel=True)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure of the optional kernel leaves the PyTorch path
        _kernel_error = f"{type(e).__name__}: {str(e)[:300]}"
    return _kernel_error

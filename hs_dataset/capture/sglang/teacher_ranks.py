"""The teacher's top-k when the output embedding is split over the TP ranks (SGLang's ``ParallelLMHead`` with
``tp_size > 1``): each rank's part of one pass, one all-gather, the merge on rank 0
(:mod:`hs_dataset.codec.teacher_shards`).

It runs on every TP rank in the LogitsProcessor hook, on the engine's stream (as SGLang's own all-gather of the
logits), before rank 0 copies the pass into the rings (:func:`hs_dataset.capture.sglang.ring_copy.copy_pass`, which
takes the merged teacher from here). The rings are rank 0's: which requests of the pass ask for the teacher, and
with which ``k``, every rank reads from their ids (``-k<k>``, :func:`hs_dataset.capture.transport.make_rid`). So
every rank computes the same spans in the same order and the all-gather matches on all of them, whatever rank 0
then does with a request (the teacher of one it fails is dropped).

Imports torch, the transport and the codec only (it runs in SGLang's scheduler processes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hs_dataset.capture.transport import request_spans, rid_teacher_k
from hs_dataset.codec.teacher_shards import sharded_teacher

__all__ = ["pass_teachers", "vocab_shard"]

Teacher = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def vocab_shard(lm_head: Any, vocab: int) -> tuple[int, int] | None:
    """``(first token id, tokens)`` of the vocabulary this rank's output embedding holds, when it is split over ranks
    (its first rows; the padding rows after them are not tokens); None when it holds the whole vocabulary."""
    if int(getattr(lm_head, "tp_size", 1) or 1) <= 1:
        return None
    idx = lm_head.shard_indices
    start, end = int(idx.org_vocab_start_index), int(idx.org_vocab_end_index)
    if vocab:
        end = min(end, vocab)
    return start, max(0, end - start)


def pass_teachers(fb: Any, final: torch.Tensor, lm_head: Any, prefix: str, vocab: int, ranks: int, rank: int,
                  all_gather: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Teacher] | None:
    """Every TP rank calls it for each EXTEND pass of ours (a collective when a request of the pass asks for the
    teacher). Returns, on rank 0, each asking request's teacher of its rows in this pass, ``{rid: (ids, logprobs,
    lse)}`` (``{}`` on the other ranks, or when the output embedding is split over another number of ranks than
    ``ranks``: rank 0 then fails those requests, naming why); None when this rank's output embedding holds the whole
    vocabulary (rank 0 computes the teacher alone, as with one GPU).

    ``fb``: SGLang's ``ForwardBatch`` (``rids``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu``); ``final``: the
    pass's final states ``[rows, H]``; ``vocab``: the model's vocabulary (0: the embedding's own);
    ``all_gather``: a tensor -> the ranks' tensors concatenated along the first dimension, in rank order."""
    shard = vocab_shard(lm_head, vocab)
    if shard is None:
        return None
    if int(lm_head.tp_size) != ranks:
        return {}
    asks = [(rid, off, n, rid_teacher_k(rid, prefix))
            for rid, off, _, n in request_spans(list(fb.rids), list(fb.extend_seq_lens_cpu),
                                                list(fb.extend_prefix_lens_cpu), prefix)]
    asks = [a for a in asks if a[3]]
    if not asks:
        return {}
    k = max(a[3] for a in asks)  # one k for the pass: each request's top-k is the first of its own
    start, rows = shard
    tops = sharded_teacher(final, lm_head.weight[:rows], start, [(off, n) for _, off, n, _ in asks], k, ranks,
                           all_gather, merge=rank == 0)
    return {rid: t if own == k else (t[0][:, :own].contiguous(), t[1][:, :own].contiguous(), t[2])
            for (rid, _, _, own), t in zip(asks, tops)}

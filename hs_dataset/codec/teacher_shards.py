"""The teacher over a vocabulary split across tensor-parallel ranks: each rank's top-k of its rows, and the merge.

With ``tp_size > 1`` SGLang's output embedding (``ParallelLMHead``) holds on each rank a contiguous range of the
vocabulary (``shard_indices.org_vocab_start_index`` .. ``org_vocab_end_index``; its padding rows follow them and are
not tokens). The final state is the same on every rank. So each rank takes, of its own rows,

* the top-``k`` logits and their token ids (:func:`hs_dataset.codec.teacher.teacher_topk` with ``logits=True``,
  plus the range's start),
* the logsumexp of its logits,

packed into one float32 ``[T, 2k + 1]`` tensor (:func:`shard_topk`); one all-gather brings every rank's to each, and
:func:`merge_shards` gives the teacher of the whole vocabulary:

* ``lse = logsumexp`` of the ranks' logsumexps;
* the top-``k`` among the ranks' ``R * k`` candidates, highest first and the lower id first among tied values (the
  GPU path's order): exact, since each of the whole vocabulary's top-``k`` is among its own rank's top-``k``;
* their log-probs ``logit - lse``, as the one-rank path computes them.

The ``lse`` is the one-rank path's up to float32 rounding (a sum of ``R`` terms instead of one), so the log-probs
are too (``tests/codec/test_teacher_shards.py``: 1e-5, ranks in processes over ``torch.distributed``). What
crosses ranks is ``(2k + 1) * 4`` bytes a position and rank (516 for k = 64), not the ``vocab / R`` logits.

Torch only: the SGLang plugin imports this module in its scheduler processes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hs_dataset.codec.teacher import teacher_topk_spans

__all__ = ["merge_shards", "shard_topk", "sharded_teacher"]


def shard_topk(final: torch.Tensor, weight: torch.Tensor, start: int, spans: list[tuple[int, int]],
               k: int) -> torch.Tensor:
    """One rank's part, packed: for the rows ``final[off:off + n]`` of each span ``(off, n)``, back to back in that
    order, float32 ``[rows, 2k + 1]``: the top-``k`` logits of ``final @ weight.T`` (highest first), their token ids
    (``start`` + the row of ``weight``; int32 bits), then the logsumexp.

    ``weight``: this rank's rows of the output embedding that are tokens (none of its padding), token ids ``start``
    onwards. A rank with fewer than ``k`` of them (or none) fills the rest with ``-inf`` and id -1, which the merge
    never takes before a real token."""
    rows = sum(n for _, n in spans)
    out = torch.empty((rows, 2 * k + 1), dtype=torch.float32, device=final.device)
    vals, ids, lse = out[:, :k], out[:, k:2 * k].view(torch.int32), out[:, 2 * k]
    have = min(k, int(weight.shape[0]))
    vals.fill_(float("-inf"))
    ids.fill_(-1)
    lse.fill_(float("-inf"))
    if not have or not rows:
        return out
    a = 0
    for (i, lp, s), (_, n) in zip(teacher_topk_spans(final, weight, [(off, n, have) for off, n in spans], logits=True),
                                  spans):
        vals[a:a + n, :have] = lp
        torch.add(i, start, out=ids[a:a + n, :have])
        lse[a:a + n] = s
        a += n
    return out


def merge_shards(gathered: torch.Tensor, ranks: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole vocabulary's teacher from the ranks' :func:`shard_topk` parts stacked in rank order
    (``[ranks * rows, 2k + 1]``, as an all-gather along the first dimension gives them): ids int32 ``[rows, k]``
    (highest first; the lower id first among tied values), log-probs float32 ``[rows, k]``, logsumexp ``[rows]``."""
    parts = gathered.view(ranks, -1, 2 * k + 1)
    rows = parts.shape[1]
    lse = torch.logsumexp(parts[:, :, 2 * k], dim=0)
    vals = parts[:, :, :k].permute(1, 0, 2).reshape(rows, ranks * k)
    ids = parts[:, :, k:2 * k].contiguous().view(torch.int32).permute(1, 0, 2).reshape(rows, ranks * k)
    # highest value first, the lower id first among tied ones: order by id, then a stable sort by value
    by_id = ids.argsort(dim=1, stable=True)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    best = vals.argsort(dim=1, descending=True, stable=True)[:, :k]
    return ids.gather(1, best), vals.gather(1, best) - lse[:, None], lse


def sharded_teacher(final: torch.Tensor, weight: torch.Tensor, start: int, spans: list[tuple[int, int]], k: int,
                    ranks: int, all_gather: Callable[[torch.Tensor], torch.Tensor], *, merge: bool = True
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every rank calls it with the same ``spans`` and ``k`` (a collective): this rank's :func:`shard_topk`, then
    ``all_gather`` (a tensor -> the ranks' tensors concatenated along the first dimension, in rank order), then
    :func:`merge_shards`. Returns each span's ``(ids, logprobs, lse)``, in order; ``merge=False`` (a rank that
    writes nothing): takes part in the all-gather and returns ``[]``."""
    gathered = all_gather(shard_topk(final, weight, start, spans, k))
    if not merge:
        return []
    merged = merge_shards(gathered, ranks, k)
    out, a = [], 0
    for _, n in spans:
        out.append((merged[0][a:a + n], merged[1][a:a + n], merged[2][a:a + n]))
        a += n
    return out

"""One order of a version's rows per epoch, dealt to any number of ranks, resumable at another world size.

**The order** (:func:`epoch_order`) is a function of ``(seed, epoch)`` only (and of the version's shard
sizes and ``block_shards``, fixed for a run): the shards are permuted, taken in blocks of
``block_shards`` consecutive shards, and the rows of each block permuted. A stretch of the order thus
touches few shards: a reader fetches whole shards, and each shard is read by (nearly) one rank.

**The deal** (:func:`rank_share`): the positions of the order not yet seen this epoch (``remaining``, a
list of ``[start, stop)`` intervals: the whole order at the start of an epoch) are cut into
``world_size`` consecutive stretches whose lengths differ by at most one; rank ``r`` reads stretch
``r``. Every rank splits its stretch into the same number of batches (:func:`batch_sizes`: at most
``batch_size`` rows each, sizes differing by at most one), so DDP ranks take the same number of steps,
and every row of the epoch is read exactly once. Which node a rank sits on does not enter: 1 node x 4
ranks, 2 x 2 and 4 x 1 read the same rows in the same order.

**Resume** (:func:`after_batches`): after every rank has taken ``k`` batches, the positions not yet seen
are each rank's stretch less its first ``k`` batches; a job that comes back with another world size deals
exactly those (each once) over its ranks.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["Intervals", "after_batches", "batch_sizes", "epoch_order", "num_batches", "rank_share", "total"]

Intervals = list[tuple[int, int]]


def epoch_order(shard_rows: Sequence[int], seed: int, epoch: int, block_shards: int = 1) -> np.ndarray:
    """The epoch's order: global row indices (the version's order: shards ascending, rows in each) as int64.

    Args:
        shard_rows: rows of each shard, in the version's order.
        seed, epoch: the order is a function of these (non-negative integers).
        block_shards: shards whose rows are mixed together (1: a shard's rows stay together).
    """
    starts = np.concatenate([[0], np.cumsum(np.asarray(shard_rows, dtype=np.int64))])
    rng = np.random.Generator(np.random.PCG64([int(seed), int(epoch)]))
    shards = rng.permutation(len(shard_rows))
    out = []
    for b in range(0, len(shards), max(1, block_shards)):
        rows = np.concatenate([np.arange(starts[s], starts[s + 1], dtype=np.int64)
                               for s in shards[b:b + block_shards]])
        out.append(rng.permutation(rows))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def total(intervals: Intervals) -> int:
    """Positions in ``intervals``."""
    return sum(b - a for a, b in intervals)


def _take(intervals: Intervals, start: int, count: int) -> Intervals:
    """Positions ``start .. start + count - 1`` of ``intervals`` read as one list, as intervals."""
    out: Intervals = []
    for a, b in intervals:
        n = b - a
        if start >= n:
            start -= n
            continue
        lo = a + start
        hi = min(b, lo + count)
        if hi > lo:
            out.append((lo, hi))
        count -= hi - lo
        start = 0
        if count <= 0:
            break
    return out


def _merge(intervals: Intervals) -> Intervals:
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


def _shares(n: int, world_size: int) -> list[int]:
    base, extra = divmod(n, world_size)
    return [base + (r < extra) for r in range(world_size)]


def rank_share(remaining: Intervals, rank: int, world_size: int) -> Intervals:
    """The positions rank ``rank`` reads: its stretch of ``remaining`` (see the module)."""
    sizes = _shares(total(remaining), world_size)
    return _take(remaining, sum(sizes[:rank]), sizes[rank])


def num_batches(remaining: Intervals, world_size: int, batch_size: int) -> int:
    """Batches every rank takes: enough for the longest stretch in batches of at most ``batch_size``."""
    return math.ceil(math.ceil(total(remaining) / world_size) / batch_size)


def batch_sizes(rows: int, batches: int) -> list[int]:
    """A stretch of ``rows`` in ``batches`` batches, sizes differing by at most one (larger first)."""
    return _shares(rows, batches) if batches else []


def after_batches(remaining: Intervals, world_size: int, batch_size: int, batches: int) -> Intervals:
    """The positions not yet seen once every rank has taken its first ``batches`` batches."""
    k = num_batches(remaining, world_size, batch_size)
    out: Intervals = []
    for r in range(world_size):
        share = rank_share(remaining, r, world_size)
        n = total(share)
        seen = sum(batch_sizes(n, k)[:batches])
        out += _take(share, seen, n - seen)
    return _merge(out)

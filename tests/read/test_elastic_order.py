"""The elastic order: one order per (seed, epoch), dealt to any world size in equal batch counts, and a mid-epoch
state that leaves exactly the positions not yet seen, whatever world size takes them over."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hs_dataset.read.elastic_order import after_batches, batch_sizes, epoch_order, num_batches, rank_share, total


def positions(intervals) -> list[int]:
    return [p for a, b in intervals for p in range(a, b)]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 300), w1=st.integers(1, 9), w2=st.integers(1, 9), batch=st.integers(1, 7),
       steps=st.integers(0, 60))
def test_a_mid_epoch_state_leaves_exactly_the_unseen_positions_for_any_world_size(rows, w1, w2, batch, steps):
    whole = [(0, rows)]
    k = num_batches(whole, w1, batch)
    steps = min(steps, k)
    seen = []
    for r in range(w1):
        share = positions(rank_share(whole, r, w1))
        sizes = batch_sizes(len(share), k)
        assert len(sizes) == k and max(sizes, default=0) <= batch  # every rank the same number of batches
        seen += share[:sum(sizes[:steps])]
    left = after_batches(whole, w1, batch, steps)
    assert sorted(seen + positions(left)) == list(range(rows))  # each position once: seen, or left
    later = [p for r in range(w2) for p in positions(rank_share(left, r, w2))]
    assert sorted(later) == positions(left)


def test_the_order_is_a_function_of_seed_and_epoch_and_keeps_a_shards_rows_together():
    shards = [3, 5, 2, 4]
    a, b = epoch_order(shards, 1, 0), epoch_order(shards, 1, 0)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(14))
    assert not np.array_equal(a, epoch_order(shards, 1, 1)) and not np.array_equal(a, epoch_order(shards, 2, 0))
    starts = np.cumsum([0] + shards)
    shard_of = np.searchsorted(starts, a, side="right") - 1
    assert sum(shard_of[1:] != shard_of[:-1]) == len(shards) - 1  # each shard's rows in one run
    mixed = epoch_order(shards, 1, 0, block_shards=2)
    assert sorted(mixed.tolist()) == list(range(14)) and total([(0, 14)]) == 14

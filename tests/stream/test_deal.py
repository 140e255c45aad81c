"""The deal (hs_dataset.stream.deal): every row to exactly one rank per epoch, balanced, the same for the
same seed, and computable for a rank without the total (a stream deals rows before the build ends)."""

from __future__ import annotations

import pytest

from hs_dataset.stream.deal import epoch_order, owner, position, rows_of_rank


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("total", [0, 1, 7, 64, 101])
def test_every_row_goes_to_exactly_one_rank(world, total):
    for seed in (0, 1234):
        for epoch in (0, 1, 2):
            dealt = []
            for rank in range(world):
                n = rows_of_rank(total, rank, world, seed, epoch)
                positions = [position(j, rank, world, seed, epoch) for j in range(n)]
                assert positions == sorted(positions) and all(owner(g, world, seed, epoch) == rank for g in positions)
                dealt += positions
                even = rows_of_rank(total, rank, world, seed, epoch, even=True)
                assert even == total // world and positions[:even] == [position(j, rank, world, seed, epoch)
                                                                       for j in range(even)]
            assert sorted(dealt) == list(range(total))
            assert max(map(len, [[g for g in dealt if owner(g, world, seed, epoch) == r] for r in range(world)]),
                       default=0) - total // world <= 1


def test_the_order_is_the_seeds():
    assert epoch_order(50, 3, 0).tolist() == list(range(50))  # epoch 0: the build's order, as it streams
    assert epoch_order(50, 3, 1).tolist() == epoch_order(50, 3, 1).tolist()
    assert sorted(epoch_order(50, 3, 1).tolist()) == list(range(50))
    assert epoch_order(50, 3, 1).tolist() != epoch_order(50, 3, 2).tolist() != epoch_order(50, 4, 2).tolist()
    deal = [[owner(g, 4, s, 0) for g in range(40)] for s in (0, 1)]
    assert deal[0] != deal[1]  # the seed moves the rows between ranks

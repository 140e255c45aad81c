"""Which rows each trainer rank reads in an epoch, and in what order: deterministic given the seed.

A build's rows have one global order, the version's (parts ascending, each part's rows in the order
they were written): row ``g`` is the ``g``-th row of :func:`hs_dataset.read.open_dataset` of the finished
build. An epoch orders them as a list ``order`` (epoch 0: the global order itself, the order in which
a build produces them, so a stream can hand each row out as soon as it exists; a later epoch: a seeded
permutation of all rows, ``torch.randperm`` with a generator seeded by ``seed + epoch``, as
``DistributedSampler`` does) and deals that list out in *rounds* of ``world_size`` consecutive
entries: in round ``j`` each rank gets exactly one entry, the rank of position ``j * world_size + k``
being ``(k + shift(seed, epoch, j)) % world_size`` (a seeded rotation per round). So:

* every row goes to exactly one rank per epoch, and the ranks' counts differ by at most one
  (``even=True``: the last, incomplete round is left out, so that every rank gets
  ``rows // world_size`` and DDP ranks take the same number of steps);
* rank ``r``'s ``j``-th row is at position :func:`position` ``(j, r)``, known without the total:
  a stream deals rows before the build has finished;
* the same seed gives the same rows in the same order, read from the stream or from the version.
"""

from __future__ import annotations

import torch

__all__ = ["epoch_order", "owner", "position", "rows_of_rank", "shift"]

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def shift(seed: int, epoch: int, round_: int, world_size: int) -> int:
    """The seeded rotation of round ``round_``: position ``round_ * world_size + k`` goes to rank
    ``(k + shift) % world_size``."""
    return _mix(_mix(_mix(seed & _MASK) ^ epoch) ^ round_) % world_size


def position(j: int, rank: int, world_size: int, seed: int, epoch: int) -> int:
    """The position in the epoch's order of rank ``rank``'s ``j``-th row (0-based)."""
    return j * world_size + (rank - shift(seed, epoch, j, world_size)) % world_size


def owner(g: int, world_size: int, seed: int, epoch: int) -> int:
    """The rank that gets position ``g`` of the epoch's order."""
    j, k = divmod(g, world_size)
    return (k + shift(seed, epoch, j, world_size)) % world_size


def rows_of_rank(total: int, rank: int, world_size: int, seed: int, epoch: int, even: bool = False) -> int:
    """How many rows rank ``rank`` gets of an epoch of ``total`` rows (``even``: ``total // world_size``, every rank)."""
    full, rest = divmod(total, world_size)
    if even or rest == 0:
        return full
    return full + (position(full, rank, world_size, seed, epoch) < total)


def epoch_order(total: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of all ``total`` rows: the global order in epoch 0, else a seeded permutation."""
    if epoch == 0:
        return torch.arange(total)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(total, generator=g)

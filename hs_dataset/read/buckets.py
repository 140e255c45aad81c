"""Batches of similar lengths: short and long samples are not padded together.

With samples from 100 to 128k tokens in one build, a batch padded to its longest sample can be mostly
padding. :func:`length_buckets` groups row indices by length (``boundaries``), shuffles within each
group (seeded, per epoch), fills each batch up to a padded-token budget (``max_batch_tokens``:
batch size x longest sample), and shuffles the batches; :class:`LengthBucketSampler` is the same as a
``torch.utils.data`` batch sampler::

    lengths = ds["num_tokens"]
    loader = DataLoader(ds.with_format(TORCH_FORMAT), collate_fn=DrafterCollator(),
                        batch_sampler=LengthBucketSampler(lengths, max_batch_tokens=65536, seed=0))

A sample longer than the budget gets a batch of its own (read long ones by windows:
:mod:`hs_dataset.read.windows`).
"""

from __future__ import annotations

import bisect
import random
from typing import Iterator, Sequence

from torch.utils.data import Sampler

__all__ = ["DEFAULT_BOUNDARIES", "LengthBucketSampler", "length_buckets"]

DEFAULT_BOUNDARIES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def length_buckets(lengths: Sequence[int], max_batch_tokens: int, *, boundaries: Sequence[int] = DEFAULT_BOUNDARIES,
                   seed: int = 0, epoch: int = 0, shuffle: bool = True) -> list[list[int]]:
    """Row indices in batches of similar length: each batch's ``len(batch) * max(lengths)`` stays within
    ``max_batch_tokens`` (a longer sample alone). Deterministic given ``seed`` and ``epoch``; every index once."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens={max_batch_tokens}: must be >= 1")
    edges = sorted(boundaries)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(bisect.bisect_left(edges, int(n)), []).append(i)
    rng = random.Random(f"{seed}:{epoch}")
    batches: list[list[int]] = []
    for g in sorted(groups):
        idx = groups[g]
        if shuffle:
            rng.shuffle(idx)
        batch: list[int] = []
        longest = 0
        for i in idx:
            n = int(lengths[i])
            if batch and max(longest, n) * (len(batch) + 1) > max_batch_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, n)
        if batch:
            batches.append(batch)
    if shuffle:
        rng.shuffle(batches)
    return batches


class LengthBucketSampler(Sampler[list[int]]):
    """:func:`length_buckets` as a batch sampler (``DataLoader(..., batch_sampler=...)``); call
    :meth:`set_epoch` each epoch for a new order (the same for the same seed and epoch)."""

    def __init__(self, lengths: Sequence[int], max_batch_tokens: int, *,
                 boundaries: Sequence[int] = DEFAULT_BOUNDARIES, seed: int = 0, shuffle: bool = True):
        self.lengths = [int(n) for n in lengths]
        self.max_batch_tokens, self.boundaries, self.seed, self.shuffle = max_batch_tokens, tuple(boundaries), seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        return length_buckets(self.lengths, self.max_batch_tokens, boundaries=self.boundaries, seed=self.seed,
                              epoch=self.epoch, shuffle=self.shuffle)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())

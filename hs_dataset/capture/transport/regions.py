"""The ring's data area as a free list of page-aligned regions (the consumer's allocator), and the lease
of one request's region."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hs_dataset.capture.transport.format import _ALIGN, SlotInfo, _align

__all__ = ["FreeList", "Lease"]


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@dataclass
class Lease:
    """A request's reserved region, from reservation until nothing references its views."""

    seq: int
    offset: int
    nbytes: int
    info: SlotInfo
    base: torch.Tensor | None = None  # the region's bytes, once handed out
    abandoned: bool = False
    in_pieces: bool = False  # handed out piece by piece as positions arrive (always, for a windowed region)
    # the pieces handed out and not yet released, as (stop position, their bytes)
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    consumed: int = 0  # positions released (for a windowed region: to the producer, which may write them again)


class FreeList:
    """First-fit allocation of page-aligned regions in ``[0, capacity)``; freed regions coalesce."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, size), coalesced

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new region of ``nbytes`` (rounded up to a page), or None when none fits now."""
        size = _align(max(nbytes, 1), _ALIGN)
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                return start
        return None

    def release(self, offset: int, nbytes: int) -> None:
        """Give back the region at ``offset`` (of ``nbytes``, as allocated)."""
        size = _align(max(nbytes, 1), _ALIGN)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

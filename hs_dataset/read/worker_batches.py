"""Batches made in DataLoader workers, in shared memory that is reused once the training process lets go of it.

A worker's batch reaches the training process through shared memory (as ``default_collate``'s does); fresh
shared memory costs a page fault and a zeroed page per 4 KiB on its first write, which on a small VM costs
as much as reading the bytes from disk. So each worker keeps a few buffers (:class:`WorkerBuffers`) and
writes a batch's states into one that is free:

* the worker marks a buffer taken (its flag in a small shared array) before it writes into it;
* the batch travels as a :class:`SharedBatch`, which the training process unpickles through
  :func:`_arrived`: that registers a weak reference to the batch's storage there, and frees (flag back to 0)
  every buffer whose storage the training process no longer holds: no tensor, no view of it is left;
* a worker with no free buffer, or past ``count`` buffers, allocates fresh shared memory as before.

So a buffer is written again only after the training process dropped every tensor over it (a batch handed
on to a third process is not followed: copy it first). Nothing here runs outside DataLoader workers.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SharedBatch", "WorkerBuffers"]

_FREE, _TAKEN = 0, 1


class WorkerBuffers:
    """A DataLoader worker's reusable shared-memory buffers (see the module).

    Args:
        count: buffers kept per worker: the batches of a worker in flight (``prefetch_factor``, default 2),
            plus one the trainer holds and one being written. 0: fresh memory for every batch. Once the other
            workers of a streaming DataLoader have ended, all of its ``prefetch_factor * num_workers`` batches
            in flight come from the last one: it then takes fresh memory for those past ``count``.
    """

    def __init__(self, count: int):
        self.count = count
        self.flags = torch.zeros(max(count, 1), dtype=torch.int32).share_memory_()  # _FREE / _TAKEN, per buffer
        self.storages: list[torch.UntypedStorage] = []

    def take(self, nbytes: int) -> tuple[int, torch.UntypedStorage]:
        """A buffer of at least ``nbytes``: ``(index, storage)``, marked taken; index -1: fresh, not kept."""
        flags = self.flags.numpy()
        free = [i for i, st in enumerate(self.storages) if flags[i] == _FREE]
        fits = [i for i in free if self.storages[i].nbytes() >= nbytes]
        if fits:
            i = min(fits, key=lambda k: self.storages[k].nbytes())
        elif len(self.storages) < self.count or free:
            size = max([nbytes] + [st.nbytes() for st in self.storages])  # every buffer as large as the largest batch
            storage = torch.UntypedStorage._new_shared(size)
            if len(self.storages) < self.count:
                i = len(self.storages)
                self.storages.append(storage)
            else:  # a free buffer too small for this batch: replaced by a larger one
                i = free[0]
                self.storages[i] = storage
        else:
            return -1, torch.UntypedStorage._new_shared(nbytes)
        flags[i] = _TAKEN
        return i, self.storages[i]


class SharedBatch(dict):
    """A batch (a dict of tensors) whose arrival in the training process frees the worker buffers no longer held."""

    def __init__(self, batch: dict[str, Any], buffers: WorkerBuffers, index: int, key: str):
        super().__init__(batch)
        self._release = (buffers.flags, index, key)

    def __reduce__(self) -> tuple[Any, ...]:
        return _arrived, (dict(self), *self._release)


_lock = threading.Lock()
_held: list[tuple[torch.Tensor, int, StorageWeakRef]] = []  # (a worker's flags, buffer index, its storage here)


def _arrived(batch: dict[str, Any], flags: torch.Tensor, index: int, key: str) -> dict[str, Any]:
    """In the training process: follow this batch's buffer, free the buffers of batches that are gone."""
    with _lock:
        still = []
        for f, i, ref in _held:
            if ref.expired():
                f[i] = _FREE
            else:
                still.append((f, i, ref))
        if index >= 0:
            still.append((flags, index, StorageWeakRef(batch[key].untyped_storage())))
        _held[:] = still
    return batch

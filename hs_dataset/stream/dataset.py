"""The trainer's side: :func:`open_stream`, a ``torch.utils.data.IterableDataset`` over a build as it runs.

Epoch 0 hands out each of this rank's rows as soon as the build has it (:mod:`hs_dataset.stream.rows`:
from the spool, zero-copy, before its part is committed; else from ``data/`` once committed); later
epochs read the finished version (:func:`hs_dataset.read.open_dataset`) in a seeded order. Which rows a
rank gets and in what order is :mod:`hs_dataset.stream.deal`'s: each row to exactly one rank per
epoch, the same for the same seed, whether read while the build runs or after. The rows are
:func:`hs_dataset.read.decode_row`'s (what ``iter_torch`` gives), so ``DrafterCollator`` batches them
as it batches a finished build's.

Resume: :meth:`StreamDataset.state_dict` is the rank's place (epoch, rows handed out): save it with
the training checkpoint and give it back with :meth:`StreamDataset.load_state_dict` after a restart;
the rank goes on from there, losing and repeating nothing of the epoch (the rows it took since then
are read again from the spool or, once their part is committed, from ``data/``). It has the
torchdata ``Stateful`` methods, which ``StatefulDataLoader`` calls.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Generator, Iterable, Iterator, Protocol, cast

import pyarrow as pa
import torch
import torch.utils.data

from hs_dataset.errors import StreamError
from hs_dataset.read.decode import decode_row
from hs_dataset.read.iterate import READ_AHEAD_BYTES, _read_ahead
from hs_dataset.read.ranked import rank_and_world
from hs_dataset.read.safe_views import SafeViews
from hs_dataset.stream.deal import epoch_order, position, rows_of_rank
from hs_dataset.stream.rows import LocalRows

__all__ = ["RowSource", "StreamDataset", "open_stream"]


class RowSource(Protocol):
    """Rows of a build by position (:class:`~hs_dataset.stream.rows.LocalRows`, or the Ray relay's client)."""

    where: dict[str, float]

    def row(self, g: int, stop: threading.Event | None = None, timeout: float | None = None) -> pa.Table | None: ...

    def wait_known(self, n: int, stop: threading.Event | None = None, timeout: float | None = None) -> int: ...

    def total(self) -> int | None: ...

    def start_at(self, g: int) -> None: ...

    def unregister(self) -> None: ...

    def close(self) -> None: ...


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    rank, world_size = rank_and_world(rank, world_size)
    if not 0 <= rank < world_size:
        raise StreamError(f"rank {rank} of world size {world_size}: a rank is 0 to world_size - 1")
    return rank, world_size


class StreamDataset(torch.utils.data.IterableDataset):
    """This rank's rows of a build, epoch after epoch (see the module); made by :func:`open_stream`.

    Iterating it runs one epoch (:attr:`epoch`, then the next one: no ``set_epoch`` is needed, though
    :meth:`set_epoch` sets it as ``DistributedSampler``'s does). Use it in the training process
    (``DataLoader(ds, batch_size=..., collate_fn=DrafterCollator())``, ``num_workers=0``): it reads
    ahead on its own thread, and a worker process could not hand its place back for a resume.

    Attributes:
        epoch: the epoch the next iteration runs. seed, rank, world_size, even: the deal.
        stats: rows handed out, the seconds the trainer waited for them (``wait_s``), and how many came
            from the spool, from committed shards and from the finished version.
    """

    def __init__(self, make_source: Callable[[int, int, int], RowSource], name: str, *, seed: int, rank: int,
                 world_size: int, even: bool, columns: Iterable[str] | None, prefetch_bytes: int,
                 timeout: float | None):
        super().__init__()
        self.name = name
        self.seed, self.rank, self.world_size, self.even = seed, rank, world_size, even
        self.columns = list(columns) if columns is not None else None
        self.prefetch_bytes, self.timeout = prefetch_bytes, timeout
        self.epoch = 0
        self._position = 0  # rows of this epoch handed out
        self._make_source = make_source
        self._source: RowSource | None = None
        self.stats: dict[str, Any] = {"rows": 0, "wait_s": 0.0}

    def set_epoch(self, epoch: int) -> None:
        """Run epoch ``epoch`` next (from its start)."""
        self.epoch, self._position = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        """This rank's place: save it with the training checkpoint (the rows handed out so far count as trained)."""
        return {"epoch": self.epoch, "position": self._position, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "even": self.even}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a :meth:`state_dict` of the same deal.

        Raises:
            StreamError: the state is of another seed, rank, world size or ``even``.
        """
        for key in ("seed", "rank", "world_size", "even"):
            if state.get(key) != getattr(self, key):
                raise StreamError(f"{self.name}: the resume state is of {key}={state.get(key)!r}, this stream has "
                                  f"{key}={getattr(self, key)!r}; the rows a rank gets depend on it: open the stream "
                                  f"with {key}={state.get(key)!r}")
        self.epoch, self._position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if torch.utils.data.get_worker_info() is not None:
            raise StreamError("a StreamDataset reads ahead on its own thread and keeps its place for a resume: use "
                              "it with DataLoader(..., num_workers=0)")
        if self._source is None:
            self._source = self._make_source(self.seed, self.world_size, self.rank)
        epoch, start = self.epoch, self._position
        stop = threading.Event()
        # the producer's waits for the build watch ``stop``: set before the read-ahead is closed, it ends them
        items = cast(Generator[tuple[int, dict], None, None],
                     _read_ahead(self._rows(self._source, epoch, start, stop), self.prefetch_bytes, cost=_row_bytes))
        try:
            while True:
                t = time.perf_counter()
                item = next(items, None)
                self.stats["wait_s"] += time.perf_counter() - t
                if item is None:
                    break
                j, row = item
                self._position = j + 1
                self.stats["rows"] += 1
                yield row
            self.epoch, self._position = epoch + 1, 0
        finally:
            stop.set()
            items.close()
            self._source.unregister()  # until the next iteration: the builder keeps no rows for a rank not reading
            self.stats.update(self._source.where)

    def _rows(self, src: RowSource, epoch: int, start: int, stop: threading.Event) -> Iterator[tuple[int, dict]]:
        W, r, seed = self.world_size, self.rank, self.seed
        if epoch == 0:
            src.start_at(position(start, r, W, seed, 0))
            j = start
            while True:
                if self.even and src.wait_known((j + 1) * W, stop, self.timeout) < (j + 1) * W:
                    break  # the last round is incomplete: left out
                table = src.row(position(j, r, W, seed, 0), stop, self.timeout)
                if table is None:  # past the end of the finished build
                    break
                yield j, self._decode(table)
                j += 1
            return
        total = src.wait_known(1 << 62, stop, self.timeout)  # the finished version
        order = epoch_order(total, seed, epoch)
        for j in range(start, rows_of_rank(total, r, W, seed, epoch, self.even)):
            table = src.row(int(order[position(j, r, W, seed, epoch)]), stop, self.timeout)
            if table is None:
                raise StreamError(f"{self.name}: the finished build has fewer rows than it had ({total})")
            yield j, self._decode(table)

    def _decode(self, table: pa.Table) -> dict[str, Any]:
        # made after the table's mapping, so that it finds it: writes copy pages, never reach a file; populate: the
        # pages are faulted in here, on the read-ahead thread
        with SafeViews(populate=True) as views:
            return decode_row(table, 0, self.columns, views=views)

    def close(self) -> None:
        """Leave the build (the builder stops keeping rows for this rank)."""
        if self._source is not None:
            self._source.close()
            self._source = None


def _row_bytes(item: tuple[int, dict[str, Any]]) -> int:
    return sum(v.numel() * v.element_size() for v in item[1].values() if isinstance(v, torch.Tensor))


def open_stream(address: str | os.PathLike, *, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                even: bool = False, columns: Iterable[str] | None = None, prefetch_bytes: int = READ_AHEAD_BYTES,
                timeout: float | None = None) -> StreamDataset:
    """A build as a training stream: rows as the build makes them, then the finished version (see the module).

    Args:
        address: the build directory (``hs-dataset build --output``; the build runs on this node with
            ``--stream``, or has finished, or runs elsewhere and commits into this shared directory), or
            ``ray:NAME`` for a build on another node of a Ray cluster, run with ``--stream ray:NAME``.
        seed: the deal and the order of later epochs.
        rank, world_size: this rank of the training job (default: ``torch.distributed``'s when it is
            initialized, else the ``RANK`` and ``WORLD_SIZE`` variables torchrun sets, else 0 of 1).
        even: every rank gets ``rows // world_size`` rows per epoch (the last incomplete round is left
            out; DDP ranks then take the same number of steps); default: every row, ranks differ by one.
        columns: the hidden-state columns to decode (default: all).
        prefetch_bytes: rows read ahead on a thread (at least one).
        timeout: seconds to wait for a row before giving up (default: wait, e.g. for the build to be run again).

    Returns:
        A :class:`StreamDataset` (``torch.utils.data.IterableDataset``) of ``decode_row`` dicts.

    Raises:
        StreamError: a rank outside the world size; ``ray:`` without Ray.
    """
    r, w = _rank_and_world(rank, world_size)
    text = os.fspath(address)
    make: Callable[[int, int, int], RowSource]
    if text.startswith("ray:"):
        from hs_dataset.stream.relay import RelayRows  # optional: Ray

        def make(s: int, world: int, k: int) -> RowSource:
            return RelayRows(text[len("ray:"):].lstrip("/"), seed=s, world=world, rank=k)
    else:
        def make(s: int, world: int, k: int) -> RowSource:
            return LocalRows(text, seed=s, world=world, rank=k)
    return StreamDataset(make, text, seed=seed, rank=r, world_size=w, even=even, columns=columns,
                         prefetch_bytes=prefetch_bytes, timeout=timeout)

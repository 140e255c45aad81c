"""Iterating a dataset as dicts of torch tensors, the next rows read ahead on a thread.

:func:`iter_torch` works on a map-style ``Dataset`` (:func:`hs_dataset.read.open.open_dataset`,
``load_dataset``) and on a streaming ``IterableDataset``; each row is what
:func:`hs_dataset.read.decode.decode_row` gives.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any, Callable, Iterable, Iterator

import datasets
import pyarrow as pa
import torch

from hs_dataset.codec.rows import state_slice
from hs_dataset.read.decode import check_fp8_mode, decode_row, state_columns_of
from hs_dataset.read.safe_views import SafeViews
from hs_dataset.read.shard_checks import BlockChecks

__all__ = ['READ_AHEAD_BYTES', 'iter_torch']


READ_AHEAD_BYTES = 256 << 20  # read-ahead per unit of ``prefetch``: two 117 MB Kimi rows
_ASK_AHEAD_BYTES = 64 << 20  # the disk is asked for the states of the rows after the one being read in, this many bytes


def iter_torch(ds, batch_size: int = 16, columns: Iterable[str] | None = None,
               prefetch: int = 1, fp8: str = "decode") -> Iterator[dict[str, Any]]:
    """Iterate a ``Dataset`` or a streaming ``IterableDataset`` as dicts of torch tensors (see decode_row).

    Args:
        ds: a map-style ``datasets.Dataset`` (:func:`open_dataset`, ``load_dataset(...)``) or a
            streaming ``datasets.IterableDataset`` (``open_dataset(..., streaming=True)``,
            ``load_dataset(..., streaming=True)``).
        batch_size: rows read as one Arrow batch.
        columns: the hidden-state columns to decode (default: all).
        prefetch: read-ahead on a background thread while the caller works on the current rows
            (0: none): the coming rows are read and decoded there, up to ``prefetch * READ_AHEAD_BYTES``
            of states (at least one row); a mapped shard's pages are read in from disk there too, so
            the caller's copy into the training batch never waits for the disk.
        fp8: ``"decode"`` (default): fp8-stored states decoded to bf16 here; ``"codes"``: the stored codes and
            scales (see :func:`~hs_dataset.read.decode.decode_row`), to decode on the GPU
            (:func:`~hs_dataset.read.collate.decode_on`).

    Raises:
        TypeError: a column holds neither bf16 nor fp8 bits.
    """
    cols = list(columns) if columns is not None else None
    check_fp8_mode(fp8)
    tables = ds.with_format("arrow").iter(batch_size=batch_size)
    mapped = isinstance(ds, datasets.Dataset)
    rows = _decoded_rows(tables, cols, populate=prefetch > 0, per_table=not mapped, fp8=fp8)
    if prefetch > 0:  # the read-ahead thread also hashes the blocks it reads (hs_dataset.read.shard_checks)
        rows = _read_ahead(rows, prefetch * READ_AHEAD_BYTES, cost=_state_bytes)
    yield from rows


def _decoded_rows(tables: Iterable[pa.Table], columns: list[str] | None, *, populate: bool,
                  per_table: bool, fp8: str = "decode") -> Iterator[dict[str, Any]]:
    """``per_table``: a fresh :class:`SafeViews` (a fresh read of the process's mappings) for each table, for
    streaming, where file mappings can come and go between batches and an address can change hands. One pass
    of block checks for the whole loop: a block is hashed once per loop (an epoch), never remembered after.
    ``populate`` (a map-style dataset): the disk is asked for the coming rows' states ahead (:func:`_asked_ahead`)."""
    checks = BlockChecks()
    if per_table:
        for table in tables:
            with SafeViews(populate=populate, checks=checks) as views:
                for i in range(table.num_rows):
                    yield decode_row(table, i, columns, views=views, fp8=fp8)
        return
    rows = ((table, i) for table in tables for i in range(table.num_rows))
    first = next(rows, None)  # the dataset's files are mapped by now: SafeViews reads the process's mappings
    if first is None:
        return
    with SafeViews(populate=populate, checks=checks) as views:
        ordered = itertools.chain([first], rows)
        for table, i in _asked_ahead(ordered, views, columns) if populate else ordered:
            yield decode_row(table, i, columns, views=views, fp8=fp8)


def _asked_ahead(rows: Iterable[tuple[pa.Table, int]], views: SafeViews,
                 columns: list[str] | None) -> Iterator[tuple[pa.Table, int]]:
    """``rows``, each handed on once the disk has been asked for the states of the rows after it, at least
    :data:`_ASK_AHEAD_BYTES` of them (the last rows: all there are): reading a row's states in and hashing them
    (:mod:`hs_dataset.read.safe_views`) never leaves the disk idle, in file order or not, and nothing is read
    that the loop does not read (``benchmarks/verified_reads.py`` without ``--hot``)."""
    coming: collections.deque[tuple[tuple[pa.Table, int], int]] = collections.deque()
    asked = 0  # the state bytes of the rows in ``coming``
    for table, i in rows:
        states = [state_slice(table.column(c), i)[0].to_numpy(zero_copy_only=True)
                  for c in (columns if columns is not None else state_columns_of(table))]
        for arr in states:
            views.will_need(arr)
        n = sum(arr.nbytes for arr in states)
        coming.append(((table, i), n))
        asked += n
        while asked - coming[0][1] >= _ASK_AHEAD_BYTES:
            row, n = coming.popleft()
            asked -= n
            yield row
    for row, _ in coming:
        yield row


def _state_bytes(row: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in row.values() if isinstance(v, torch.Tensor))


_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _read_ahead(items: Iterable[Any], depth: int, cost: Callable[[Any], int] | None = None) -> Iterator[Any]:
    """Yield ``items``, produced ahead on a daemon thread; errors re-raise here.

    At most ``depth`` items wait, or with ``cost``, items whose costs add up to at most ``depth``
    (always at least one). When the consumer stops, the producer finishes its current item, closes
    ``items`` (on its own thread) and exits; the consumer waits for that.
    """
    cond = threading.Condition()
    waiting: collections.deque = collections.deque()
    queued = [0]  # the cost of the waiting items
    stop = threading.Event()

    def put(item: Any, c: int) -> bool:
        with cond:
            while not stop.is_set() and waiting and queued[0] + c > depth:
                cond.wait(0.1)
            if stop.is_set():
                return False
            waiting.append((item, c))
            queued[0] += c
            cond.notify_all()
            return True

    def produce() -> None:
        end: Any = _END
        try:
            for item in items:
                if not put(item, cost(item) if cost else 1):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            end = _Failed(e)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
        put(end, 0)

    thread = threading.Thread(target=produce, name="hs_dataset-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            with cond:
                while not waiting:
                    cond.wait()
                item, c = waiting.popleft()
                queued[0] -= c
                cond.notify_all()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()  # the consumer stopped (or failed): the producer finishes its current item and exits
        with cond:
            cond.notify_all()
        thread.join()  # a thread still inside pyarrow's reader at interpreter exit aborts the process

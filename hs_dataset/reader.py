"""The reader: dataset rows -> torch bf16 tensors, without upcasts, and safe to write to.

``load_dataset`` gives nested Python lists for ``Array2D`` columns, and ``with_format("torch")``
copies every value into an int64 tensor (the uint16 bit patterns as numbers, not bf16). Read
through Arrow instead::

    ds = open_dataset("kimi-hs")                      # or load_dataset(dir_or_repo[, streaming=True])
    for sample in hs_dataset.reader.iter_torch(ds):   # dicts of torch tensors, states torch.bfloat16 [T, H]
        ...
    ds = ds.with_format(TORCH_FORMAT)                 # or: ds[i], ds.iter(n), DataLoader(ds, ...) give the same

A local build directory is best opened with :func:`open_dataset`: it memory-maps the shards
where they are, whereas ``load_dataset(dir)`` first copies every shard into the ``datasets`` cache.

Both :func:`open_dataset` and :func:`load_verified` (a published version or a local build, map-style
or ``streaming=True``) refuse a build whose shards do not add up to what its ``hs_dataset.json``
records: a missing or extra shard, a shard of another size or other rows (:class:`IntegrityError`).
Plain ``load_dataset(..., streaming=True)`` cannot check that; ``hs-dataset verify`` checks the
content hashes too.

Tensors are never views of the read-only shard mappings (an in-place op there is a segfault):
large states are private copy-on-write mappings of the same bytes (:mod:`hs_dataset.private_map`:
zero-copy to read, a write copies a page and never reaches the file), small values are copied,
and a streaming dataset's batches are already private memory. fp8-stored columns are decoded to
bf16 (one multiply). Batching: :class:`~hs_dataset.collate.DrafterCollator`.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import datasets
import pyarrow as pa
import torch

from .collate import DrafterCollator, empty_batch_tensor
from .encode import fp8_decode
from .errors import IntegrityError
from .layout import DATA_DIR, FINAL_COLUMN, MESSAGES_COLUMN, layer_of, scale_column
from .private_map import SafeViews
from .torch_format import TORCH_FORMAT
from .verify import Problem

READ_AHEAD_BYTES = 256 << 20  # map-style read-ahead per unit of ``prefetch``: two 117 MB Kimi rows


def _chunk_and_index(col: pa.ChunkedArray | pa.Array, i: int) -> tuple[pa.Array, int]:
    if isinstance(col, pa.Array):
        return col, i
    for chunk in col.chunks:
        if i < len(chunk):
            return chunk, i
        i -= len(chunk)
    raise IndexError("row index out of range")


def _as_tensor(values: pa.Array, views: SafeViews) -> torch.Tensor:
    """A torch tensor of a primitive Arrow array without nulls, made by ``views``."""
    return views.tensor(values.to_numpy(zero_copy_only=True))


def column_bits(col: pa.ChunkedArray | pa.Array, i: int = 0, *, views: SafeViews | None = None) -> torch.Tensor:
    """Row ``i`` of an ``Array2D(shape=(None, H))`` column as its raw stored integer tensor ``[T, H]``.

    ``views`` (see :mod:`hs_dataset.private_map`): how tensors over Arrow memory are made; by default
    a :class:`~hs_dataset.private_map.SafeViews` for this call (tensors safe to write to).
    """
    views = views or SafeViews()
    chunk, j = _chunk_and_index(col, i)
    storage = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
    outer = storage.offsets
    s, e = outer[j].as_py(), outer[j + 1].as_py()
    inner = storage.values
    a, b = inner.offsets[s].as_py(), inner.offsets[e].as_py()
    flat = _as_tensor(inner.values.slice(a, b - a), views)
    T = e - s
    return flat.view(T, (b - a) // T if T else 0)


def list_values(col: pa.ChunkedArray | pa.Array, i: int = 0, *, views: SafeViews | None = None) -> torch.Tensor:
    """Row ``i`` of a ``List(Value(...))`` column as a 1-D tensor (``views``: as in :func:`column_bits`)."""
    chunk, j = _chunk_and_index(col, i)
    values = chunk.values.slice(chunk.offsets[j].as_py(), chunk.value_lengths()[j].as_py())
    return _as_tensor(values, views or SafeViews())


def decode_state(table: pa.Table, column: str, i: int = 0, *, views: SafeViews | None = None) -> torch.Tensor:
    """One hidden-state column of row ``i`` as ``torch.bfloat16 [T, H]`` (``views``: as in :func:`column_bits`).

    Raises:
        TypeError: the column holds neither bf16 nor fp8 bits.
    """
    views = views or SafeViews()
    bits = column_bits(table.column(column), i, views=views)
    if bits.dtype == torch.uint16:
        return bits.view(torch.bfloat16)
    if bits.dtype == torch.uint8:
        return fp8_decode(bits, list_values(table.column(scale_column(column)), i, views=views))
    raise TypeError(f"column {column!r} holds {bits.dtype}, not a hidden-state encoding")


def state_columns_of(table: pa.Table) -> list[str]:
    """Hidden-state columns of a table: the layers in ascending order, then the final state."""
    layers = sorted((c for c in table.column_names if layer_of(c) is not None), key=layer_of)
    return layers + ([FINAL_COLUMN] if FINAL_COLUMN in table.column_names else [])


def decode_row(table: pa.Table, i: int = 0, columns: Iterable[str] | None = None, *,
               views: SafeViews | None = None) -> dict[str, Any]:
    """Row ``i`` of an Arrow table (``ds.with_format("arrow")[k]`` or a batch) as torch tensors.

    Returns ``id`` (str), ``input_ids`` (int32 [T]), ``loss_mask`` (uint8 [T]), every
    hidden-state column (or those in ``columns``) as ``torch.bfloat16 [T, H]``, and in regenerate
    builds ``messages`` (the conversation as JSON text). Every tensor can be written to in place
    without touching the dataset's files. ``views``: as in :func:`column_bits`.
    """
    views = views or SafeViews()
    out: dict[str, Any] = {}
    names = table.column_names
    for c in ("id", MESSAGES_COLUMN):  # MESSAGES_COLUMN: regenerate builds
        if c in names:
            out[c] = table.column(c)[i].as_py()
    for c in ("input_ids", "loss_mask"):
        if c in names:
            out[c] = list_values(table.column(c), i, views=views)
    for c in columns if columns is not None else state_columns_of(table):
        out[c] = decode_state(table, c, i, views=views)
    return out


def open_dataset(path: str | os.PathLike):
    """A finished build directory (``OUT`` of ``hs-dataset build``) as a map-style ``datasets.Dataset``.

    Arrow shards are memory-mapped in place (``Dataset.from_file``): nothing is copied or converted,
    so opening a 1 TB dataset takes milliseconds and its pages are read on first access. Parquet
    shards have no zero-copy form and go through ``load_dataset`` (which converts them into the
    ``datasets`` cache).

    Raises:
        NotABuildError: ``path`` is not a finished build (no ``hs_dataset.json``).
        IntegrityError: a recorded shard is missing or of another size or row count, or ``data/``
            holds a file that is not recorded (run ``hs-dataset verify`` for the full check).
    """
    import datasets

    root = Path(path)
    meta, shards = _checked_listing(root)
    if not shards:
        raise FileNotFoundError(f"{root} holds no data/train-*.arrow or data/train-*.parquet shards")
    if not shards[0]["name"].endswith(".arrow"):
        return datasets.load_dataset(str(root), split="train")
    parts = [datasets.Dataset.from_file(str(root / DATA_DIR / s["name"])) for s in shards]
    wrong = [Problem(f"{DATA_DIR}/{s['name']}", f"holds {len(d)} rows, {s['rows']} recorded")
             for s, d in zip(shards, parts) if len(d) != int(s["rows"])]
    if wrong:
        raise IntegrityError(f"{root}: {'; '.join(map(str, wrong))}. Run `hs-dataset verify {root}`", wrong)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _checked_listing(root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A local build's metadata and shards, once ``data/`` is checked to hold exactly them."""
    from .verify import VerifyReport, check_listing, data_files, read_meta, recorded_shards

    meta = read_meta(root)
    problems, rows = check_listing(meta, data_files(root), str(root))
    shards = recorded_shards(meta, str(root))
    VerifyReport(str(root), True, len(shards), rows, problems,
                 repair=f"Refusing to read it: run `hs-dataset verify {root}`, then the build again to repair it."
                 ).raise_if_bad()
    return meta, shards


def load_verified(path_or_repo: str | os.PathLike, *, revision: str | None = None, split: str = "train",
                  streaming: bool = False, token: str | None = None, **kwargs: Any):
    """``load_dataset`` of a published version (or a local build), after checking that its shards are
    exactly the ones its ``hs_dataset.json`` records (names, sizes, rows add up): the check that
    ``streaming=True`` cannot make itself. A local build, map-style, is :func:`open_dataset`.

    Args:
        path_or_repo: a build directory, or a dataset repo id (``org/name``).
        revision: the version (tag) of a repo; the check and the load read the same commit.
        split, streaming, kwargs: passed to ``datasets.load_dataset``.
        token: for the Hub. The Hub is ``HF_ENDPOINT``'s (``datasets.load_dataset`` reads no other), so the
            check and the load reach the same one.

    Raises:
        IntegrityError: a shard is missing, extra or of another size (names them).
        NotABuildError: no ``hs_dataset.json``.
    """
    import datasets

    root = Path(path_or_repo)
    if root.is_dir():
        if not streaming:
            return open_dataset(root)
        _checked_listing(root)
        return datasets.load_dataset(str(root), split=split, streaming=True, **kwargs)
    from .verify import verify_repo

    report = verify_repo(str(path_or_repo), revision=revision, quick=True, token=token)
    report.raise_if_bad()
    return datasets.load_dataset(str(path_or_repo), revision=report.commit, split=split, streaming=streaming,
                                 token=token, **kwargs)


def iter_torch(ds, batch_size: int = 16, columns: Iterable[str] | None = None,
               prefetch: int = 1) -> Iterator[dict[str, Any]]:
    """Iterate a ``Dataset`` or a streaming ``IterableDataset`` as dicts of torch tensors (see decode_row).

    Args:
        ds: a map-style ``datasets.Dataset`` (:func:`open_dataset`, ``load_dataset(...)``) or a
            streaming ``datasets.IterableDataset``.
        batch_size: rows read as one Arrow batch.
        columns: the hidden-state columns to decode (default: all).
        prefetch: read-ahead on a background thread while the caller works on the current rows
            (0: none). Streaming: ``prefetch`` Arrow batches are read ahead (measured 1.7x on 2
            cores). Map-style: the coming rows' pages are read in from disk ahead, up to
            ``prefetch * READ_AHEAD_BYTES`` of them (at least one row), so the caller's copy into
            the training batch never waits for the disk.
    """
    cols = list(columns) if columns is not None else None
    tables = ds.with_format("arrow").iter(batch_size=batch_size)
    mapped = isinstance(ds, datasets.Dataset)
    if prefetch > 0 and not mapped:
        tables = _read_ahead(tables, prefetch)
    rows = _decoded_rows(tables, cols, populate=mapped and prefetch > 0, per_table=not mapped)
    if prefetch > 0 and mapped:
        rows = _read_ahead(rows, prefetch * READ_AHEAD_BYTES, cost=_state_bytes)
    yield from rows


def _decoded_rows(tables: Iterable[pa.Table], columns: list[str] | None, *, populate: bool,
                  per_table: bool) -> Iterator[dict[str, Any]]:
    """``per_table``: a fresh :class:`SafeViews` (a fresh read of the process's mappings) for each table, for
    streaming, where file mappings can come and go between batches and an address can change hands."""
    views: SafeViews | None = None
    try:
        for table in tables:
            if views is None or per_table:
                if views is not None:
                    views.close()
                views = SafeViews(populate=populate)
            for i in range(table.num_rows):
                yield decode_row(table, i, columns, views=views)
    finally:
        if views is not None:
            views.close()


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


__all__ = ["READ_AHEAD_BYTES", "TORCH_FORMAT", "DrafterCollator", "column_bits", "decode_row", "decode_state",
           "empty_batch_tensor", "iter_torch", "list_values", "load_verified", "open_dataset", "state_columns_of"]

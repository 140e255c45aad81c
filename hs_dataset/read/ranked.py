"""Training on many nodes from one published version: each rank reads its share, fetching only those shards.

:func:`open_ranked` gives this rank's batches of a version on the Hub (``org/name``) or in object
storage (``s3://bucket/prefix``, any fsspec URL). The epoch's order and the deal are
:mod:`hs_dataset.read.elastic_order`'s: one order per ``(seed, epoch)``, each rank a consecutive stretch
of it, every rank the same number of batches, every row once. Rank ``r`` reads about ``1 / world_size``
of the shards, so a node fetches only the shards its ranks read: over all nodes, an epoch fetches the
version about once (a shard cut between two ranks is fetched by both: ``hs-dataset plan`` says how many
shards keep that small). Shards come through a :class:`~hs_dataset.read.shard_cache.ShardCache` bounded
by ``cache_bytes`` per node (shared evenly by the node's ranks), each checked against its recorded hash
as it arrives; the next shards are fetched while the current ones are read, and rows are decoded on a
background thread (:func:`hs_dataset.read.decode.decode_row`).

Resume: :meth:`RankedReader.state_dict` after a step (the same on every rank, as the ranks step
together) and :meth:`RankedReader.load_state_dict` in the new job, at any world size: it reads exactly
the rows not yet seen in that epoch, each once.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hs_dataset.errors import ConfigError
from hs_dataset.hub.remote import RemoteVersion, open_remote
from hs_dataset.read.decode import check_fp8_mode, decode_row
from hs_dataset.read.elastic_order import (Intervals, after_batches, batch_sizes, epoch_order, num_batches, rank_share)
from hs_dataset.read.safe_views import SafeViews
from hs_dataset.read.shard_cache import ShardCache

__all__ = ["RankedReader", "open_ranked", "rank_and_world"]

STATE_KEYS = ("seed", "block_shards", "rows")


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's, else torchrun's ``RANK`` / ``WORLD_SIZE`` (0, 1)."""
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        else:
            r, w = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    return rank, world_size


def _layout(rank: int | None, world_size: int | None, local_rank: int | None,
            local_world_size: int | None) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, ranks on this node): given, else torch.distributed / torchrun's variables."""
    rank, world_size = rank_and_world(rank, world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if local_world_size is None \
        else local_world_size
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size):
        raise ConfigError(f"rank {rank} of {world_size} (local {local_rank} of {local_world_size}): a rank is 0 to "
                          "world_size - 1", field="rank", value=rank)
    return rank, world_size, local_rank, local_world_size


class RankedReader:
    """This rank's batches of a published version (see the module); made by :func:`open_ranked`.

    Iterating it reads what is left of the current epoch (all of it, unless resumed); :meth:`set_epoch`
    starts an epoch. ``len()`` is the batches every rank takes in it.

    Attributes:
        epoch, seed, rank, world_size, batch_size, block_shards: the deal.
        cache: the shard cache (``fetched_bytes``, ``peak_bytes``).
    """

    def __init__(self, remote: RemoteVersion, cache: ShardCache, *, batch_size: int, seed: int, rank: int,
                 world_size: int, block_shards: int, prefetch: int, columns: list[str] | None,
                 collate_fn: Callable[[list[dict[str, Any]]], Any] | None, fp8: str):
        self.remote, self.cache = remote, cache
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.block_shards, self.prefetch, self.columns, self.fp8 = block_shards, prefetch, columns, fp8
        self.collate_fn = collate_fn
        self._shard_rows = [int(s["rows"]) for s in remote.shards]
        self._starts = np.concatenate([[0], np.cumsum(self._shard_rows)])
        self.rows = int(self._starts[-1])
        self.epoch = 0
        self._remaining: Intervals = [(0, self.rows)]
        self._taken = 0  # batches handed out of the current deal

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (as ``DistributedSampler.set_epoch``)."""
        self.epoch, self._remaining, self._taken = int(epoch), [(0, self.rows)], 0

    def __len__(self) -> int:
        return num_batches(self._remaining, self.world_size, self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch is: the positions of its order not yet seen once every rank took as many batches as this one."""
        left = after_batches(self._remaining, self.world_size, self.batch_size, self._taken)
        return {"epoch": self.epoch, "seed": self.seed, "block_shards": self.block_shards, "rows": self.rows,
                "remaining": [list(iv) for iv in left]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a run at any world size.

        Raises:
            ConfigError: the state is of another version, seed or ``block_shards``.
        """
        mine = {"seed": self.seed, "block_shards": self.block_shards, "rows": self.rows}
        wrong = [f"{k}: {state.get(k)} -> {mine[k]}" for k in STATE_KEYS if state.get(k) != mine[k]]
        if wrong:
            raise ConfigError(f"the saved reader state is of another deal ({'; '.join(wrong)}): open the reader with "
                              "the saved seed and block_shards, on the same version", field="state")
        self.epoch = int(state["epoch"])
        self._remaining = [(int(a), int(b)) for a, b in state["remaining"]]
        self._taken = 0

    def __iter__(self) -> Iterator[Any]:
        remaining = self._remaining
        order = epoch_order(self._shard_rows, self.seed, self.epoch, self.block_shards)
        mine = np.concatenate([order[a:b] for a, b in rank_share(remaining, self.rank, self.world_size)] or
                              [np.zeros(0, dtype=np.int64)])
        sizes = batch_sizes(len(mine), num_batches(remaining, self.world_size, self.batch_size))
        out: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(mine, sizes, out, stop), daemon=True,
                                  name="hs-ranked-read")
        worker.start()
        try:
            for _ in sizes:
                item = out.get()
                if isinstance(item, BaseException):
                    raise item
                self._taken += 1
                yield self.collate_fn(item) if self.collate_fn is not None else item
            self._remaining, self._taken = [], 0  # the epoch is done
        finally:
            stop.set()
            while worker.is_alive():
                try:
                    out.get(timeout=0.05)
                except queue.Empty:
                    pass

    def _produce(self, rows: np.ndarray, sizes: list[int], out: queue.Queue, stop: threading.Event) -> None:
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, s in enumerate(shard_of.tolist()):
            first.setdefault(s, i)
            last[s] = i
        upcoming = sorted(first, key=first.__getitem__)
        names = [str(s["name"]) for s in self.remote.shards]
        pinned: set[int] = set()
        tables: dict[int, pa.Table] = {}
        ahead = 0
        views = SafeViews()
        try:
            i = 0
            for n in sizes:
                batch = []
                for _ in range(n):
                    s = int(shard_of[i])
                    if s not in pinned:
                        self.cache.pin(names[s], wait=True)
                        pinned.add(s)
                    while ahead < len(upcoming) and first[upcoming[ahead]] <= i:
                        ahead += 1
                    for t in upcoming[ahead:ahead + self.prefetch]:  # the next shards, fetched while these are read
                        if t not in pinned:
                            if not self.cache.pin(names[t], wait=False):
                                break
                            pinned.add(t)
                    if s not in tables:
                        tables[s] = _open_table(self.cache.path(names[s]))
                    batch.append(decode_row(tables[s], int(rows[i] - self._starts[s]), self.columns, views=views,
                                            fp8=self.fp8))
                    if last[s] == i:
                        del tables[s]
                        pinned.discard(s)
                        self.cache.release(names[s])
                    i += 1
                while not stop.is_set():
                    try:
                        out.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the training thread, raised there
            out.put(e)
        finally:
            for s in pinned:
                self.cache.release(names[s])
            views.close()


def _open_table(path: Path) -> pa.Table:
    """A checked shard as an Arrow table over its memory mapping."""
    if path.suffix == ".parquet":
        return pq.read_table(str(path), memory_map=True)
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


def open_ranked(source: str, *, revision: str | None = None, cache_dir: str | os.PathLike, cache_bytes: int,
                batch_size: int, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                local_rank: int | None = None, local_world_size: int | None = None, block_shards: int = 1,
                prefetch: int = 2, columns: Iterable[str] | None = None,
                collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None, fp8: str = "decode",
                token: str | None = None, storage_options: dict[str, Any] | None = None) -> RankedReader:
    """This rank's reader of a published version on the Hub or in object storage (see the module).

    Args:
        source: ``org/name`` (the Hub) or an fsspec URL of a store (``s3://bucket/prefix``).
        revision: the version (default: the newest).
        cache_dir: this node's shard cache (each local rank uses a subfolder of its own).
        cache_bytes: the most bytes the node's cache holds (split evenly between its ranks; each needs two
            of the largest shard).
        batch_size: the most rows in a batch.
        seed: the order's seed (the same on every rank).
        rank, world_size: default: ``torch.distributed``, else torchrun's ``RANK`` / ``WORLD_SIZE``.
        local_rank, local_world_size: this rank on its node (default: ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``).
        block_shards: shards whose rows are mixed in the order (each rank holds that many at once).
        prefetch: shards fetched ahead of the one being read.
        columns: the hidden-state columns to decode (default: all).
        collate_fn: makes a batch of the list of rows (e.g. ``DrafterCollator()``; default: the list).
        fp8: ``"decode"`` or ``"codes"`` (:func:`~hs_dataset.read.decode.decode_row`).
        token: for the Hub. storage_options: for fsspec.

    Returns:
        The reader (an iterable of batches; ``state_dict`` / ``load_state_dict``).

    Raises:
        ConfigError: a bad rank, batch size or cache bound (the cache must hold two of the largest shard per rank).
        HubAccessError: no such repo, store or version.
        IntegrityError: the remote listing differs from ``hs_dataset.json``; while reading, a shard whose
            fetched copy differs from its recorded hash (named).
    """
    check_fp8_mode(fp8)
    if batch_size < 1 or block_shards < 1 or prefetch < 0 or seed < 0:
        raise ConfigError(f"batch_size={batch_size}, block_shards={block_shards}, prefetch={prefetch}, seed={seed}: "
                          "batch_size and block_shards must be >= 1, prefetch and seed >= 0", field="batch_size")
    r, w, lr, lw = _layout(rank, world_size, local_rank, local_world_size)
    remote = open_remote(source, revision=revision, token=token, storage_options=storage_options)
    per_rank = int(cache_bytes) // lw
    largest = max((int(s["bytes"]) for s in remote.shards), default=0)
    if per_rank < largest * min(block_shards, len(remote.shards)):
        raise ConfigError(f"cache_bytes={cache_bytes:,} gives each of this node's {lw} ranks {per_rank:,} bytes, less "
                          f"than {block_shards} of the largest shard ({largest:,} bytes): give at least "
                          f"{lw * largest * (block_shards + 1):,}", field="cache_bytes", value=cache_bytes)
    cache = ShardCache(Path(cache_dir) / f"local-rank-{lr}", per_rank, remote)
    return RankedReader(remote, cache, batch_size=batch_size, seed=seed, rank=r, world_size=w,
                        block_shards=block_shards, prefetch=prefetch,
                        columns=list(columns) if columns is not None else None, collate_fn=collate_fn, fp8=fp8)

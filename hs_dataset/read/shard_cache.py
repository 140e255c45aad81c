"""A local cache of a version's shards, bounded in bytes: fetched whole, checked, evicted least recently used.

One :class:`ShardCache` per process (a rank), in a folder of its own. A shard is fetched
(:meth:`hs_dataset.hub.remote.RemoteVersion.fetch`) into a temporary name and takes its name in the cache
only once its size, rows and content hash match the version's ``hs_dataset.json``; so a name in the
cache is a whole, checked shard, and a file left by an earlier run is hashed again before its first use
in this process (a damaged one is deleted and fetched again).

The bound holds at every moment: space is reserved for a shard before its fetch starts, by evicting
shards no reader holds, least recently used first; what is held (:meth:`pin`) is never evicted. A
prefetch that does not fit is declined (the reader asks again later); a shard that must be read now and
does not fit even with everything else evicted is a :class:`~hs_dataset.errors.ConfigError` naming the
bound to give.
"""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hs_dataset.errors import ConfigError
from hs_dataset.hub.remote import RemoteVersion
from hs_dataset.integrity.checksums import check_shard

__all__ = ["ShardCache"]


class ShardCache:
    """Shards of ``remote`` under ``folder``, at most ``max_bytes`` on disk (see the module).

    Args:
        folder: the cache folder (the version's files go in a subfolder named by its commit or id).
        max_bytes: the bound.
        remote: the version.
        threads: fetches running at once.

    Attributes:
        fetched_bytes: bytes fetched by this cache. peak_bytes: the most bytes held and reserved at once.
    """

    def __init__(self, folder: str | os.PathLike, max_bytes: int, remote: RemoteVersion, threads: int = 2):
        self.folder = Path(folder) / remote.key
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.remote = remote
        self._sizes = {str(s["name"]): int(s["bytes"]) for s in remote.shards}
        self._lock = threading.Lock()
        self._ready: collections.OrderedDict[str, bool] = collections.OrderedDict()  # name -> checked here; LRU first
        self._inflight: dict[str, Future[int]] = {}
        self._pins: collections.Counter[str] = collections.Counter()
        self._used = 0
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="hs-shard-fetch")
        self.fetched_bytes = 0
        self.peak_bytes = 0
        for p in sorted(self.folder.iterdir(), key=lambda p: p.stat().st_mtime):
            if p.is_dir():
                continue  # a fetch's staging folder (the Hub client's records)
            if p.name.startswith("."):
                p.unlink(missing_ok=True)  # a partial copy of a killed run
            elif self._sizes.get(p.name) == p.stat().st_size:
                self._ready[p.name] = False
                self._used += self._sizes[p.name]
            else:
                p.unlink(missing_ok=True)
        self._evict(0)

    def pin(self, name: str, *, wait: bool) -> bool:
        """Hold ``name`` (never evicted while held) and start its fetch when it is not here.

        Args:
            name: the shard.
            wait: it is needed now: make room by evicting everything not held, else raise; without
                ``wait`` (a prefetch), return False when it does not fit now.

        Raises:
            ConfigError: ``wait`` and the bound cannot hold it beside the shards held.
        """
        with self._lock:
            if name in self._ready or name in self._inflight:
                self._pins[name] += 1
                if name in self._ready:
                    self._ready.move_to_end(name)
                return True
            size = self._sizes[name]
            if not self._evict(size):
                if not wait:
                    return False
                held = sum(self._sizes[n] for n, c in self._pins.items() if c)
                raise ConfigError(f"a shard cache of {self.max_bytes:,} bytes cannot hold {name} ({size:,} bytes) "
                                  f"beside the {held:,} bytes of shards being read: give each rank at least "
                                  f"{2 * max(self._sizes.values()):,} bytes (two of the largest shard: one read, one "
                                  "fetched ahead)", field="cache_bytes", value=self.max_bytes)
            self._used += size
            self.peak_bytes = max(self.peak_bytes, self._used)
            self._pins[name] += 1
            self._inflight[name] = self._pool.submit(self._fetch, name)
            return True

    def path(self, name: str) -> Path:
        """The checked local copy of ``name`` (pinned first), once fetched.

        Raises:
            IntegrityError: the fetched copy was refused (names the shard).
        """
        with self._lock:
            fut = self._inflight.get(name)
        if fut is not None:
            try:
                fut.result()
            except BaseException:
                with self._lock:
                    self._inflight.pop(name, None)
                    self._used -= self._sizes[name]
                raise
            with self._lock:
                self._inflight.pop(name, None)
                self._ready[name] = True
        p = self.folder / name
        with self._lock:
            checked = self._ready.get(name)
        if checked is False:  # left by an earlier run: hashed again before it is read here
            why = check_shard(p, next(s for s in self.remote.shards if s["name"] == name), quick=False)
            if why is not None:
                p.unlink(missing_ok=True)
                with self._lock:
                    self._ready.pop(name, None)
                    self._used -= self._sizes[name]
                    self._pins[name] -= 1
                self.pin(name, wait=True)
                return self.path(name)
            with self._lock:
                self._ready[name] = True
        return p

    def release(self, name: str) -> None:
        """Stop holding ``name``: it stays cached until room is needed."""
        with self._lock:
            self._pins[name] -= 1
            if self._pins[name] <= 0:
                del self._pins[name]

    def close(self) -> None:
        """Stop fetching (the files fetched stay)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _fetch(self, name: str) -> int:
        n = self.remote.fetch(name, self.folder / name)
        with self._lock:
            self.fetched_bytes += n
        return n

    def _evict(self, size: int) -> bool:
        """Evict shards not held, least recently used first, until ``size`` more bytes fit (lock held)."""
        for victim in list(self._ready):
            if self._used + size <= self.max_bytes:
                break
            if self._pins.get(victim):
                continue
            del self._ready[victim]
            (self.folder / victim).unlink(missing_ok=True)
            self._used -= self._sizes[victim]
        return self._used + size <= self.max_bytes

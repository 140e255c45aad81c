"""A reader's view of a build on this node: where row ``g`` of the version is now, and its Arrow table.

Row ``g`` (the ``g``-th row of the finished version, :mod:`hs_dataset.stream.deal`) is read from the
first place that has it:

1. the spool of the running attempt (:mod:`hs_dataset.stream.spool`), mapped in place: the row as it
   was generated, possibly before its part is committed;
2. ``data/``, once its part is committed (its record lists the shards; each shard passes the quick
   check against the record before its first row is read), mapped in place;
3. :func:`hs_dataset.read.open_dataset` of the finished build (whose shards' hashes the reader checks
   before their first row is handed out).

A build run without ``--stream`` (or on another node, sharing ``OUT``) has no spool here: its rows
come as their parts are committed. A part's row count is known from its ``part`` event or its record;
positions follow the parts in order. When the attempt ends unfinished (an error, a kill), the rows of
its uncommitted parts are gone with its spool; the reader waits for the next attempt (the same build
command, run again), which generates those parts again from the same source rows.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from hs_dataset.errors import IntegrityError, StreamError
from hs_dataset.integrity.checksums import check_shard
from hs_dataset.layout import DATA_DIR, META_FILE, STATE_DIR
from hs_dataset.read.open import open_dataset
from hs_dataset.stream.spool import (EventTail, announcement, builder_alive, map_row, process_start, remove_spool,
                                     row_path, write_json)

__all__ = ["LocalRows"]

logger = logging.getLogger(__name__)

_POLL_S = (0.002, 0.05)  # a reader waiting for a row polls, backing off from 2 to 50 ms
_OPEN_SHARDS = 4  # committed shards kept mapped


class LocalRows:
    """Rows of the build at ``out`` by position, for one reader (see the module).

    Args:
        out: the build directory.
        seed, world, rank: the reader's deal (recorded for the builder: it spools the rows this rank takes).
    """

    def __init__(self, out: str | os.PathLike, *, seed: int, world: int, rank: int):
        self.out, self.state = Path(out), Path(out) / STATE_DIR
        self.seed, self.world, self.rank = seed, world, rank
        self.id = uuid.uuid4().hex[:12]
        # rows read from each place; spool_latency_s: the seconds from spool file written to taken, summed
        self.where: dict[str, float] = {"spool": 0, "committed": 0, "version": 0, "spool_latency_s": 0.0}
        self._token: str | None = None
        self._spool: Path | None = None
        self._tail: EventTail | None = None
        self._n_parts: int | None = None
        self._counts: dict[int, int] = {}  # part -> written rows (final)
        self._seen: dict[int, int] = {}  # part -> rows announced so far by this attempt
        self._prefix: list[int] = [0]  # positions where parts 0, 1, 2... start, for the parts of known counts
        self._records: dict[int, dict[str, Any]] = {}
        self._shards: dict[str, pa.Table] = {}
        self._version: datasets.Dataset | None = None
        self._finished = False
        self._taken = -1
        self._want = False  # a reader of epoch 0 now: registered with each attempt's spool
        self._registered: Path | None = None
        self._lock = threading.Lock()

    # -- what is known ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read what changed: the announcement, new events, newly committed parts, the end."""
        if self._finished:
            return
        a = announcement(self.out)
        if a is not None and a["token"] != self._token:
            self._new_attempt(a)
        if self._tail is not None:
            for e in self._tail.poll():
                self._apply(e)
        alive = a is not None and builder_alive(a)
        if a is not None and not alive and a.get("ended") is None and a.get("spool"):
            remove_spool(a["spool"])  # a killed builder's spool: nobody else removes it
        if (self.out / META_FILE).exists() and not alive:  # a build about to change data/ removes it first
            self._finish()
            return
        while self._extend():
            pass

    def _new_attempt(self, a: dict[str, Any]) -> None:
        self._token = a["token"]
        self._seen = {}
        self._records, self._shards = {}, {}  # the new attempt's recovery may have dropped some
        self._counts = {p: n for p, n in self._counts.items() if self._record(p) is not None}  # a redone part may differ
        self._prefix = self._prefix[:1]
        self._spool = Path(a["spool"]) if a.get("spool") else None
        self._tail = EventTail(self._spool) if self._spool is not None and self._spool.is_dir() else None
        self._registered = None
        if self._tail is not None and self._want:
            self._register()

    def _apply(self, e: dict[str, Any]) -> None:
        kind = e.get("e")
        if kind == "start":
            self._n_parts = len(e["parts"])
            self._counts.update({int(p): int(n) for p, n in e["done"].items()})
        elif kind == "row":
            self._seen[int(e["part"])] = int(e["row"]) + 1
        elif kind == "part":
            self._counts[int(e["part"])] = int(e["rows"])

    def _extend(self) -> bool:
        """Add the next part to the known prefix when its row count is known."""
        p = len(self._prefix) - 1
        if self._n_parts is not None and p >= self._n_parts:
            return False
        n = self._counts.get(p)
        if n is None:
            r = self._record(p)
            if r is None:
                return False
            n = self._counts[p] = int(r["counts"]["written"])
        self._prefix.append(self._prefix[-1] + n)
        return True

    def known_rows(self) -> int:
        """Rows whose place is known (the build has them, committed or not)."""
        if self._finished:
            return self.total() or 0
        p = len(self._prefix) - 1
        return self._prefix[-1] + self._seen.get(p, 0)

    def total(self) -> int | None:
        """The finished version's rows (None while the build runs)."""
        return len(self._version) if self._version is not None else None

    def _finish(self) -> None:
        self._version = open_dataset(self.out).with_format("arrow")
        self._finished = True
        self.unregister()
        self._shards.clear()

    # -- rows ---------------------------------------------------------------------------------------
    def row(self, g: int, stop: threading.Event | None = None, timeout: float | None = None) -> pa.Table | None:
        """The one-row table of position ``g``, waiting until the build has it; None past the end of the build.

        Raises:
            StreamError: ``timeout`` seconds passed without the row (or ``stop`` was set).
            IntegrityError: a committed shard does not match its part record.
        """
        found: list[pa.Table | None] = []

        def ready() -> bool:
            table = self._try(g)
            found.append(table)
            return table is not None or (self._finished and g >= (self.total() or 0))

        self._wait(ready, f"row {g}", stop, timeout)
        return found[-1]

    def wait_known(self, n: int, stop: threading.Event | None = None, timeout: float | None = None) -> int:
        """Wait until the build has ``n`` rows or has finished -> the rows it has (``known_rows``)."""
        self._wait(lambda: self._finished or self.known_rows() >= n, f"{n} rows", stop, timeout)
        return self.known_rows()

    def _wait(self, ready: Any, what: str, stop: threading.Event | None, timeout: float | None) -> None:
        t0 = time.monotonic()
        pause = _POLL_S[0]
        while True:
            with self._lock:
                self.refresh()
                if ready():
                    return
            if stop is not None and stop.is_set():
                raise StreamError("the stream was closed while waiting for a row")
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise StreamError(f"{self.out} has no {what} after {timeout:g} s: is the build running? (start it, or "
                                  "run the same `hs-dataset build ... --stream` command again: it resumes)")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])

    def _try(self, g: int) -> pa.Table | None:
        if self._finished:
            if g >= (self.total() or 0):
                return None
            assert self._version is not None
            self.where["version"] += 1
            return self._version[g]
        where = self._locate(g)
        if where is None:
            return None
        part, k = where
        if self._spool is not None:
            path = row_path(self._spool, part, k)
            table = map_row(path)
            if table is not None:
                self._took(g)
                self.where["spool"] += 1
                try:
                    self.where["spool_latency_s"] += max(0.0, time.time() - path.stat().st_mtime)
                except OSError:
                    pass  # removed meanwhile: the mapping holds it
                return table
        r = self._record(part)
        if r is None:
            return None
        self._took(g)
        self.where["committed"] += 1
        return self._committed_row(r, k)

    def _locate(self, g: int) -> tuple[int, int] | None:
        if g < self._prefix[-1]:
            p = bisect.bisect_right(self._prefix, g) - 1
            return p, g - self._prefix[p]
        p = len(self._prefix) - 1
        k = g - self._prefix[-1]
        return (p, k) if k < self._seen.get(p, 0) else None

    def _record(self, part: int) -> dict[str, Any] | None:
        r = self._records.get(part)
        if r is None:
            try:
                r = json.loads((self.state / "parts" / f"part-{part:05d}.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            self._records[part] = r
        return r

    def _committed_row(self, record: dict[str, Any], k: int) -> pa.Table:
        for f in record["files"]:
            if k < int(f["rows"]):
                return self._shard(f).slice(k, 1)
            k -= int(f["rows"])
        raise IntegrityError(f"{self.out}: part {record['part']}'s record lists fewer rows than the stream dealt")

    def _shard(self, entry: dict[str, Any]) -> pa.Table:
        name = entry["name"]
        table = self._shards.get(name)
        if table is None:
            path = self.out / DATA_DIR / name
            if not name.endswith(".arrow"):
                raise StreamError(f"{path}: a stream reads Arrow shards only: build with --set file_format=arrow")
            why = check_shard(path, entry, quick=True)
            if why is not None:
                raise IntegrityError(f"{path} {why}: refusing its rows. Run `hs-dataset verify {self.out}`, then the "
                                     "build command again to repair it")
            table = pa.ipc.open_stream(pa.memory_map(str(path), "r")).read_all()
            while len(self._shards) >= _OPEN_SHARDS:
                self._shards.pop(next(iter(self._shards)))
            self._shards[name] = table
        return table

    # -- the reader's record, for the builder -------------------------------------------------------
    def start_at(self, g: int) -> None:
        """The reader's next position is ``g``: positions before it are not needed from the spool."""
        with self._lock:
            self._taken, self._want = g - 1, True
            if self._registered is not None:
                self._write_record()
            elif self._tail is not None and not self._finished:
                self._register()

    def _took(self, g: int) -> None:
        if g > self._taken:
            self._taken = g
            if self._registered is not None:
                self._write_record()

    def _register(self) -> None:
        assert self._spool is not None
        self._registered = self._spool / "readers" / f"{self.id}.json"
        self._write_record()

    def _write_record(self) -> None:
        """This reader's record in the spool (none when the spool went away: the attempt ended)."""
        assert self._registered is not None
        try:
            write_json(self._registered, {"id": self.id, "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                                          "seed": self.seed, "world": self.world, "rank": self.rank, "epoch": 0,
                                          "taken": self._taken})
        except OSError:
            self._registered = None

    def unregister(self) -> None:
        """Leave the spool: the builder stops keeping rows for this reader."""
        self._want = False
        if self._registered is not None:
            self._registered.unlink(missing_ok=True)
            self._registered = None

    def close(self) -> None:
        with self._lock:
            self.unregister()
            self._shards.clear()
            self._version = None

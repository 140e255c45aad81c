"""The builder's side of a stream: every generated row into the spool, within a byte budget.

:class:`StreamPublisher` is a :class:`~hs_dataset.write.sink.RowSink`: ``hs-dataset build --stream``
(or ``build(..., sink=StreamPublisher())``) hands it each row as the shard writer gets it. A
publisher thread writes the row into the spool (:mod:`hs_dataset.stream.spool`: one copy, into
shared memory) while the build goes on; the build's thread only queues it (two rows at most).

Which rows are spooled: those that an attached reader (a trainer rank on this node, or the Ray
relay for other nodes) will take: the rank the row is dealt to (:mod:`hs_dataset.stream.deal`) is
attached and has not gone past it. A row nobody attached needs is not written (no reader, no cost:
a build with no trainer never waits); its reader reads it from ``data/`` once its part is committed.

Backpressure: when the spool's rows add up to more than ``budget_bytes``, the publisher waits for
the readers to take rows (the builder's queue fills, the build's thread waits, and the engine slows
down) instead of letting memory grow. A reader that has died is dropped at once; one that takes
nothing for ``stall_s`` seconds while the build waits is left behind: its oldest rows are removed
(it reads them from ``data/`` once committed) and the build goes on. A spool that cannot be written
(``/dev/shm`` full) skips the row the same way. The stream never fails the build.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from hs_dataset.errors import ConfigError
from hs_dataset.layout import STATE_DIR
from hs_dataset.stream.deal import owner
from hs_dataset.stream.spool import (EventLog, announce, announcement, announcement_record, new_spool, process_start,
                                     read_readers, remove_spool, row_path, spool_root, write_row)
from hs_dataset.write.resume import part_record

__all__ = ["DEFAULT_BUDGET_BYTES", "DEFAULT_STALL_S", "StreamPublisher", "StreamStats"]

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 4 << 30  # 36 Kimi-K2.5 rows of 2048 tokens (117 MB each): ~3 s of a build at disk speed
DEFAULT_STALL_S = 30.0  # a trainer step (forward + backward of a drafter) takes far less
_POLL_S = (0.001, 0.02)  # the wait for readers polls their records, backing off from 1 to 20 ms


@dataclass(kw_only=True)
class StreamStats:
    """What a publisher did (recorded in ``stream.json`` at the end; the benchmark reads it).

    Attributes:
        rows: rows generated while it ran. spooled: written into the spool. skipped: needed by no
            attached reader (or the spool was full). evicted: removed before their reader took them
            (the reader stalled). budget_bytes: the spool's budget. peak_bytes: the most bytes the spool
            held at once. waited_s: the time the build waited for readers (backpressure). write_s: the
            time spent writing rows into the spool.
    """

    rows: int = 0
    spooled: int = 0
    skipped: int = 0
    evicted: int = 0
    budget_bytes: int
    peak_bytes: int = 0
    waited_s: float = 0.0
    write_s: float = 0.0


@dataclass
class _Spooled:
    path: Path
    nbytes: int
    refs: int  # the readers that will still take it


class StreamPublisher:
    """Publishes a build's rows to the trainers on this node (see the module).

    Args:
        budget_bytes: the most bytes of rows the spool holds before the build waits for its readers.
        stall_s: how long the build waits for a reader that takes nothing before it leaves it behind.
        root: where the spool folder goes (default ``/dev/shm``).
        queue_rows: rows queued between the build's thread and the publisher's.

    Raises:
        ConfigError: the spool's file system has less room than ``budget_bytes``.
    """

    def __init__(self, *, budget_bytes: int = DEFAULT_BUDGET_BYTES, stall_s: float = DEFAULT_STALL_S,
                 root: str | Path | None = None, queue_rows: int = 2):
        self.budget_bytes, self.stall_s = int(budget_bytes), float(stall_s)
        self.root = Path(root) if root is not None else spool_root()
        self.stats = StreamStats(budget_bytes=self.budget_bytes)
        self.spool: Path | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_rows))
        self._thread: threading.Thread | None = None
        self._out: Path | None = None
        self._record: dict[str, Any] = {}
        self._counts: dict[int, int] = {}  # part -> its written rows, once known
        self._order: list[int] = []  # the parts, ascending
        self._offset: tuple[int, int] = (-1, 0)  # (part, position of its first row)
        self._spooled: OrderedDict[int, _Spooled] = OrderedDict()  # position -> the row in the spool
        self._waiting: dict[str, deque[int]] = {}  # reader id -> the spooled positions it will take, ascending
        self._bytes = 0
        self._readers: dict[str, dict[str, Any]] = {}
        self._closing = False
        self._framing = 0  # the bytes a row's file takes beyond its buffers (schema, metadata, padding): learnt
        self._progress_at = time.monotonic()
        self._warned: set[str] = set()
        self._behind: dict[str, int] = {}  # stalled readers -> the position they had taken: no rows for them
        self._failed = False

    # -- RowSink (the build's thread) -----------------------------------------------------------------
    def start(self, out: Path, parts: list[tuple[int, int, int]], done: set[int]) -> None:
        """Create this attempt's spool, announce it in ``out`` and start the publisher's thread."""
        self._out = Path(out)
        self.root.mkdir(parents=True, exist_ok=True)
        free = self._free_bytes()
        if free < self.budget_bytes:
            raise ConfigError(f"the stream's spool needs {self.budget_bytes / 2**30:.2f} GiB in {self.root}, which has "
                              f"{free / 2**30:.2f} GiB free: lower --stream-bytes, or give {self.root} more room "
                              "(docker: --shm-size)", field="stream_bytes", value=self.budget_bytes)
        old = announcement(self._out)
        if old is not None and old.get("spool"):
            remove_spool(old["spool"])  # a killed attempt's spool
        token, self.spool = new_spool(self.root)
        self._log = EventLog(self.spool)
        self._order = [i for i, _, _ in parts]
        for i in sorted(done):
            self._counts[i] = _written(self._out, i)
        self._log.append({"e": "start", "token": token, "parts": [list(p) for p in parts],
                          "done": {str(i): self._counts[i] for i in sorted(done)}})
        self._record = announcement_record(token, self.spool)
        announce(self._out, self._record)
        self._thread = threading.Thread(target=self._run, name="hs_dataset-stream", daemon=True)
        self._thread.start()

    def row(self, part: int, index: int, sample_id: str, table: pa.Table) -> None:
        self._queue.put(("row", part, index, sample_id, table))

    def generated(self, part: int, rows: int) -> None:
        self._queue.put(("part", part, rows))

    def committed(self, part: int) -> None:
        self._queue.put(("commit", part))

    def end(self, finished: bool) -> None:
        """Stop the thread, remove the spool and record the end in ``stream.json`` (never raises)."""
        if self._thread is None:
            return
        self._closing = True  # the rows still queued are not spooled: their parts are committed, or redone
        try:
            self._queue.put(("end", finished))
            self._thread.join()
            self._thread = None
            self._record["ended"] = {"finished": finished, "stats": asdict(self.stats)}
            if self._out is not None:
                announce(self._out, self._record)
        except Exception:
            logger.exception("hs_dataset stream: could not record the end of the stream")

    # -- the publisher's thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            event = self._queue.get()
            kind = event[0]
            try:
                if kind == "end":
                    self._finish(event[1])
                    return
                if not self._failed:
                    self._handle(event)
            except Exception:  # the stream never fails the build: its readers fall back to the committed parts
                self._failed = True
                logger.exception("hs_dataset stream: publishing failed; the trainers read the rows from data/ as "
                                 "their parts are committed")
                self._safe_log({"e": "failed"})

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "row":
            _, part, index, sample_id, table = event
            self._publish(part, index, sample_id, table)
        elif kind == "part":
            self._counts[event[1]] = event[2]
            self._log.append({"e": "part", "part": event[1], "rows": event[2]})
        elif kind == "commit":
            self._log.append({"e": "commit", "part": event[1]})

    def _position(self, part: int, index: int) -> int:
        if self._offset[0] != part:
            before = [q for q in self._order if q < part]
            unknown = [q for q in before if q not in self._counts]
            if unknown:
                raise RuntimeError(f"part {part} generated before part {unknown[0]}'s row count is known")
            self._offset = (part, sum(self._counts[q] for q in before))
        return self._offset[1] + index

    def _publish(self, part: int, index: int, sample_id: str, table: pa.Table) -> None:
        self.stats.rows += 1
        g = self._position(part, index)
        self._refresh()
        needs = [rid for rid, r in self._readers.items() if _needs(r, g) and rid not in self._behind]
        event: dict[str, Any] = {"e": "row", "part": part, "row": index, "id": sample_id, "spooled": False}
        if needs and not self._closing:
            nbytes = table.nbytes + self._framing  # what the file will take: the buffers and the stream's framing
            self._wait_for_room(nbytes)
            assert self.spool is not None
            path = row_path(self.spool, part, index)
            t = time.monotonic()
            try:
                nbytes = write_row(path, table)
            except OSError as e:  # /dev/shm full: this row is read from data/ once committed
                if "spool" not in self._warned:
                    self._warned.add("spool")
                    logger.warning("hs_dataset stream: cannot write %s (%s): such rows are read from data/ once "
                                   "their part is committed", path, e)
            else:
                self.stats.write_s += time.monotonic() - t
                self._framing = max(self._framing, nbytes - table.nbytes)
                self._spooled[g] = _Spooled(path, nbytes, len(needs))
                for rid in needs:
                    self._waiting.setdefault(rid, deque()).append(g)
                self._bytes += nbytes
                self.stats.spooled += 1
                self.stats.peak_bytes = max(self.stats.peak_bytes, self._bytes)
                event["spooled"] = True
        if not event["spooled"]:
            self.stats.skipped += 1
        self._log.append(event)

    def _wait_for_room(self, nbytes: int) -> None:
        t0 = time.monotonic()
        pause = _POLL_S[0]
        while self._spooled and self._bytes + nbytes > self.budget_bytes and not self._closing:
            self._refresh()
            if self._bytes + nbytes <= self.budget_bytes or not self._spooled:
                break
            if time.monotonic() - self._progress_at > self.stall_s:
                self._leave_behind()
                continue
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
        self.stats.waited_s += time.monotonic() - t0

    def _refresh(self) -> None:
        """Read the readers' records; remove the rows that no live reader will still take."""
        assert self.spool is not None
        readers = {}
        for record in read_readers(self.spool):
            if record.get("epoch", 0) == 0 and process_start(int(record["pid"])) == record.get("pid_start"):
                readers[str(record["id"])] = record
        self._readers = readers
        for rid, taken in list(self._behind.items()):
            if rid not in readers or int(readers[rid]["taken"]) != taken:
                del self._behind[rid]  # it took a row again (or went away): it is waited for again
        freed = False
        for rid in list(self._waiting):
            r, waiting = readers.get(rid), self._waiting[rid]
            while waiting and (r is None or int(r["taken"]) >= waiting[0]):  # taken, or the reader is gone
                self._release(waiting.popleft())
                freed = True
            if not waiting:
                del self._waiting[rid]
        if freed or not self._spooled:
            self._progress_at = time.monotonic()

    def _leave_behind(self) -> None:
        """The readers holding the oldest row took nothing for ``stall_s``: drop their rows and spool none for
        them until they take a row again (they read such rows from ``data/`` once committed)."""
        g = next(iter(self._spooled))
        for rid, waiting in list(self._waiting.items()):
            if not waiting or waiting[0] != g:
                continue
            r = self._readers.get(rid, {})
            self._behind[rid] = int(r.get("taken", -1))
            logger.warning("hs_dataset stream: reader %s (rank %s of %s, pid %s) took no row for %.0f s while the build "
                           "waited for it: the build goes on, and that reader reads its rows from data/ once their "
                           "part is committed", rid, r.get("rank"), r.get("world"), r.get("pid"), self.stall_s)
            while waiting:
                self._release(waiting.popleft())
                self.stats.evicted += 1
            del self._waiting[rid]
        if g in self._spooled:  # held by no stalled reader (cannot happen): never wait on it again
            self._drop(g)
            self.stats.evicted += 1
        self._progress_at = time.monotonic()

    def _release(self, g: int) -> None:
        s = self._spooled.get(g)
        if s is not None:
            s.refs -= 1
            if s.refs <= 0:
                self._drop(g)

    def _drop(self, g: int) -> None:
        s = self._spooled.pop(g)
        s.path.unlink(missing_ok=True)
        self._bytes -= s.nbytes

    def _finish(self, finished: bool) -> None:
        self._safe_log({"e": "end", "finished": finished})
        try:
            self._log.close()
        except OSError:
            pass
        if self.spool is not None:
            remove_spool(self.spool)  # readers keep what they mapped; the rest is in data/ (or redone by a rerun)
        self._spooled.clear()
        self._waiting.clear()
        self._bytes = 0

    def _safe_log(self, event: dict[str, Any]) -> None:
        try:
            self._log.append(event)
        except OSError:
            pass

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


def _needs(reader: dict[str, Any], g: int) -> bool:
    """Whether ``reader`` (an attached rank reading epoch 0) will still take position ``g``."""
    return owner(g, int(reader["world"]), int(reader["seed"]), 0) == int(reader["rank"]) and int(reader["taken"]) < g


def _written(out: Path, part: int) -> int:
    record = json.loads(part_record(out / STATE_DIR, part).read_text(encoding="utf-8"))
    return int(record["counts"]["written"])

"""The spool: where a running build leaves its rows for the trainers on its node, in shared memory.

One build run (an *attempt*: a rerun after a crash is a new one) has one spool folder on a memory
file system, ``/dev/shm/hs_dataset-stream-<token>/``, announced in the build directory::

    OUT/.hs_build/stream.json          token, spool folder, the builder's pid (+ its start time), host;
                                       at the end: "ended": {"finished": ..., "stats": {...}}
    <spool>/events.jsonl               one JSON line per event, appended by the builder (below)
    <spool>/rows/PPPPP-KKKKKK.arrow    row K of part P: an Arrow IPC stream of one record batch, the
                                       one-row table the shard writer got (same schema, same values)
    <spool>/readers/<id>.json          one per attached reader: pid, seed, world size, rank, the last
                                       position it took; the builder reads them for its budget

Events: ``start`` (the parts, those committed already with their rows), ``row`` (part, index, sample
id, and whether it was spooled: a row no attached reader needs is not), ``part`` (a part's final row
count), ``commit`` (its record is written: its rows are in ``data/``), ``end``; ``failed`` when the
publisher could not go on (its readers then get the rows as their parts are committed). A row file
appears complete (written under a temporary name, then renamed); the builder deletes it once every
reader that needs it took it (a reader maps it first, so its tensors stay valid). Every row is in
the spool or, once its part is committed, in ``data/``: the spool is a fast path, never the only copy
of a committed row. A killed builder leaves its spool behind; the next attempt and any reader that
sees the builder gone remove it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa

from hs_dataset.atomic import atomic_write
from hs_dataset.layout import STATE_DIR

__all__ = ["ANNOUNCE_FILE", "EventLog", "EventTail", "SPOOL_PREFIX", "announce", "announcement", "announcement_record",
           "builder_alive", "map_row", "new_spool", "process_start", "read_readers", "remove_spool", "row_path",
           "spool_root", "write_json", "write_row"]

ANNOUNCE_FILE = "stream.json"  # in OUT/.hs_build/
SPOOL_PREFIX = "hs_dataset-stream-"


def spool_root() -> Path:
    """Where spools go: ``/dev/shm`` (memory), else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def process_start(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/<pid>/stat``), None when it does not run."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def new_spool(root: Path | None = None) -> tuple[str, Path]:
    """A fresh spool folder ``(token, path)``, with its ``rows/`` and ``readers/``."""
    token = uuid.uuid4().hex[:12]
    path = (root or spool_root()) / f"{SPOOL_PREFIX}{token}"
    (path / "rows").mkdir(parents=True)
    (path / "readers").mkdir()
    return token, path


def remove_spool(path: str | os.PathLike) -> None:
    """Remove a spool folder (only a folder named like one)."""
    p = Path(path)
    if p.name.startswith(SPOOL_PREFIX):
        shutil.rmtree(p, ignore_errors=True)


def announcement(out: Path) -> dict[str, Any] | None:
    """The build's ``stream.json`` (None: no stream was ever started there, or it cannot be read)."""
    try:
        a = json.loads((out / STATE_DIR / ANNOUNCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return a if isinstance(a, dict) and "token" in a else None


def builder_alive(a: dict[str, Any]) -> bool:
    """Whether the builder that wrote announcement ``a`` still runs (same host: its pid and start time)."""
    if a.get("ended") is not None:
        return False
    if a.get("host") != socket.gethostname():
        return True  # another node's builder: its spool is not ours to judge (nor to read)
    return process_start(int(a["pid"])) == a.get("pid_start")


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Replace a small JSON file atomically (no fsync: in memory, or a record a process kill must not tear)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)


def announce(out: Path, record: dict[str, Any]) -> None:
    atomic_write(out / STATE_DIR / ANNOUNCE_FILE, json.dumps(record))


def row_path(spool: Path, part: int, index: int) -> Path:
    return spool / "rows" / f"{part:05d}-{index:06d}.arrow"


def write_row(path: Path, table: pa.Table) -> int:
    """Write a one-row table as an Arrow IPC stream, complete or not at all -> its bytes."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as f:
            with pa.ipc.new_stream(f, table.schema) as w:
                w.write_table(table)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def map_row(path: Path) -> pa.Table | None:
    """A spooled row, memory-mapped (its buffers are the file's pages), or None when it is gone."""
    try:
        source = pa.memory_map(str(path), "r")
    except (FileNotFoundError, pa.ArrowIOError):
        return None
    return pa.ipc.open_stream(source).read_all()


def read_readers(spool: Path) -> list[dict[str, Any]]:
    """The attached readers' records (unreadable ones skipped: one being replaced is read next time)."""
    out = []
    for p in (spool / "readers").glob("*.json"):
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


class EventLog:
    """The builder's side of ``events.jsonl``: one line per event, each written with one ``write``."""

    def __init__(self, spool: Path):
        self._fd = os.open(spool / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, event: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class EventTail:
    """A reader's side of ``events.jsonl``: the complete lines appended since the last call."""

    def __init__(self, spool: Path):
        self.path = spool / "events.jsonl"
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line]


def announcement_record(token: str, spool: Path) -> dict[str, Any]:
    """The announcement of a starting attempt by this process."""
    return {"token": token, "spool": str(spool), "pid": os.getpid(), "pid_start": process_start(os.getpid()),
            "host": socket.gethostname(), "started": time.time(), "ended": None}

"""Shard files written in the background, a thread each: the build hands a row to its file and goes on.

``datasets``' ``ArrowWriter`` hands the stream it is given (a :class:`BackgroundFile`, by
:mod:`hs_dataset.write.parts`) to ``pyarrow.RecordBatchStreamWriter``, which calls its ``write`` with every
buffer of a row; a row's states are passed as they are (a ``pyarrow.Buffer`` over the capture's own memory, the
ring for SGLang: no copy). ``write`` queues the buffer and returns, and the file's own thread writes the queue
in order with ``os.write`` (which releases the GIL). So the build's thread does not
wait for the disk while it has the next rows to prepare, and the shard of a part that is finished is still
being written while the next part's shard starts: several files are written at once.

Why files and not threads within a file: a buffered write holds the file's inode lock on tmpfs and ext4, so
threads writing pieces of one file wait for each other, while files written side by side do not
(``benchmarks/file_writes.py``).

What bounds it: a queued buffer keeps the row it belongs to alive (for a capture, its ring region, which
the engine then waits for), and all files of the process together queue at most :data:`QUEUE_BYTES`
(``write`` waits beyond that). A file is whole once :func:`drain` returns for its folder: the commit
drains a part's staging folder before it moves its shards (:mod:`hs_dataset.write.parts`); a write that
failed (a full disk) is raised there, or by the file's next ``write``, as an ``OSError`` naming the file.
Each file's thread also hashes what it writes (xxh3-128, the shards' content hash, which releases the GIL),
so the commit does not read a shard back to hash it: :func:`drain` returns the
digests, :func:`written` finds a shard's (unless it was rewritten since).
:func:`abandon` drops what a discarded part still had queued.

A coded build (``compression=zstd``, ``file_format=parquet``: :mod:`hs_dataset.codec.coding`) opens its shards
with a ``coding``: each shard's thread, once the shard is written,
codes it from a mapping of the file into ``.coded-<name>.tmp-<pid>`` beside it, counting its rows and hashing the coded
bytes as it writes them (not read back). So a part's shards are coded one by one while the next shards are
captured, each on its own thread, and the commit finds them coded instead of coding them itself.
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import xxhash

from hs_dataset.atomic import tmp_path, write_all
from hs_dataset.codec.coding import Source, code_shard

__all__ = ["QUEUE_BYTES", "BackgroundFile", "CodedShard", "Written", "abandon", "code_file", "drain", "written"]

# Queued across all files: about 36 Kimi-width rows of 2,048 tokens, up to 8 shard files of 512 MiB written at once
# (a smaller queue made the build wait for it: benchmarks/build_cpu.py --queue-mib)
QUEUE_BYTES = 4 << 30


@dataclass(frozen=True)
class CodedShard:
    """A staging shard coded by its writer: the coded file beside it, its rows and content hash (xxh3-128)."""

    path: str
    rows: int
    digest: str


@dataclass(frozen=True)
class Written:
    """What a file's thread did: the xxh3-128 digest of the bytes it wrote, and the shard coded, if asked."""

    digest: str
    coded: CodedShard | None = None


class _Budget:
    """Bytes queued and not yet written, across the process's files; ``take`` waits while over the limit."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queued = 0

    def take(self, n: int) -> None:
        with self._cv:
            while self._queued and self._queued + n > QUEUE_BYTES:  # one buffer alone always passes
                self._cv.wait()
            self._queued += n

    def give(self, n: int) -> None:
        with self._cv:
            self._queued -= n
            self._cv.notify_all()


_BUDGET = _Budget()
_files_lock = threading.Lock()
_files: list[BackgroundFile] = []  # open or still writing, until drain or abandon takes them


class _HashedFile(io.RawIOBase):
    """A new file written in order, hashing what is written (xxh3-128: its content hash, as ``file_digest``)."""

    def __init__(self, path: str):
        super().__init__()
        self.name = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._hash = xxhash.xxh3_128()
        self._offset = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        write_all(self._fd, view)
        self._hash.update(view)
        self._offset += len(view)
        return len(view)

    def tell(self) -> int:
        return self._offset

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def code_file(coding: str, src: Source, dst: str, state_columns: tuple[str, ...] = ()) -> CodedShard:
    """Code the Arrow IPC stream ``src`` into the new file ``dst`` (:func:`hs_dataset.codec.coding.code_shard`),
    counting its rows and hashing the coded bytes as they are written (the file is not read back)."""
    out = _HashedFile(dst)
    rows = code_shard(coding, src, out, state_columns)
    return CodedShard(dst, rows, out.hexdigest())


class BackgroundFile(io.RawIOBase):
    """A file opened for writing whose writes a thread of its own carries out, in order (module docstring)."""

    def __init__(self, path: str, coding: str | None = None, state_columns: tuple[str, ...] = ()):
        """``coding``: once written, the thread codes the file (an Arrow IPC stream) into
        ``.coded-<name>.tmp-<pid>`` beside it (:func:`hs_dataset.codec.coding.code_shard`, ``state_columns`` for
        Parquet's byte planes)."""
        super().__init__()
        self.name = os.path.abspath(path)  # drain() and abandon() find a part's files by their absolute folder
        self._fd = os.open(path, (os.O_RDWR if coding else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC, 0o644)
        st = os.fstat(self._fd)
        self.key = (st.st_dev, st.st_ino)  # the file, while it is not rewritten
        self._coding, self._state_columns = coding, state_columns
        self.coded: CodedShard | None = None
        self._hash = xxhash.xxh3_128()  # of the bytes written, in order (by the thread)
        self._offset = 0
        self._queue: deque[memoryview] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._dropped = False
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="hs_dataset-write", daemon=True)
        self._thread.start()
        with _files_lock:
            _files.append(self)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._error is not None:
            raise self._error
        view = memoryview(data).cast("B")  # holds the buffer (and what it is a view of) until it is written
        n = len(view)
        if n:
            _BUDGET.take(n)
            with self._cv:
                self._queue.append(view)
                self._cv.notify()
            self._offset += n
        return n

    def tell(self) -> int:
        return self._offset

    def close(self) -> None:
        """Returns at once: the thread writes what is queued, then closes the file (see :func:`drain`)."""
        if not self.closed:
            with self._cv:
                self._closing = True
                self._cv.notify()
        super().close()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._closing:
                        self._cv.wait()
                    if not self._queue:
                        break
                    view = self._queue.popleft()
                n = len(view)
                try:
                    if self._error is None and not self._dropped:
                        write_all(self._fd, view)
                        self._hash.update(view)
                except OSError as e:
                    self._error = OSError(e.errno, e.strerror, self.name)
                finally:
                    del view  # the row it belonged to may go (a ring region is then reclaimed)
                    _BUDGET.give(n)
            if self._coding and self._offset and self._error is None and not self._dropped:
                self._code()
        finally:
            os.close(self._fd)

    def _code(self) -> None:
        """Code the file just written from a mapping of it, into ``.coded-<name>.tmp-<pid>`` beside it."""
        dst = str(tmp_path(Path(os.path.dirname(self.name)) / f"coded-{os.path.basename(self.name)}"))
        try:
            # Not closed here: Arrow's threads may let go of the last slice of it a moment after the coding
            # returns (closing it then fails); it is unmapped when the last reference goes.
            buf = pa.py_buffer(mmap.mmap(self._fd, self._offset, prot=mmap.PROT_READ))
            self.coded = code_file(str(self._coding), buf, dst, self._state_columns)
            del buf
        except Exception as e:  # noqa: BLE001 - raised by drain, naming the file
            self._error = e if isinstance(e, OSError) else RuntimeError(f"{self.name}: coding it failed: {e}")

    def _finish(self, drop: bool) -> Exception | None:
        if drop:
            self._dropped = True
        self.close()
        self._thread.join()
        return self._error


def _take(folder: str | os.PathLike) -> list[BackgroundFile]:
    prefix = os.path.join(os.path.abspath(folder), "")
    with _files_lock:
        mine = [f for f in _files if f.name.startswith(prefix)]
        _files[:] = [f for f in _files if not f.name.startswith(prefix)]
    return mine


def drain(folder: str | os.PathLike) -> dict[tuple[int, int, int], Written]:
    """Wait until every file opened under ``folder`` is written (and coded, if asked) and closed; raise the
    first write's or coding's error.

    Returns:
        what each file's thread did, keyed by (device, inode, size): look a file up with :func:`written`.
    """
    files = _take(folder)
    errors = [e for e in (f._finish(drop=False) for f in files) if e is not None]
    if errors:
        raise errors[0]
    return {(*f.key, f._offset): Written(f._hash.hexdigest(), f.coded) for f in files}


def written(drained: Mapping[tuple[int, int, int], Written], path: str | os.PathLike) -> Written | None:
    """What :func:`drain` returned for the file now at ``path`` (None: not written whole through a
    :class:`BackgroundFile`, e.g. rewritten since: hash or code it from the file)."""
    st = os.stat(path)
    return drained.get((st.st_dev, st.st_ino, st.st_size))


def abandon(folder: str | os.PathLike) -> None:
    """Drop what the files under ``folder`` still have queued and close them (a part being discarded)."""
    for f in _take(folder):
        f._finish(drop=True)

"""Crash-safe file writes: a reader sees a file's old or new content, never a part of it.

Imports nothing heavy: every stage that writes a record uses it (the build, the merge, redaction).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ['atomic_write', 'fsync_dir', 'fsync_file', 'tmp_path', 'write_all']


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until all of ``data`` is written (a pipe or a large write may take part of it)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def tmp_path(path: Path) -> Path:
    """Where a file of this package is written before it is renamed to ``path``: ``.<name>.tmp-<pid>`` beside it
    (the one name a next build recognizes as a killed write's leftover, :data:`hs_dataset.write.output.TMP_RE`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that readers see the old or the new content, never a part.

    The text goes to ``.<name>.tmp-<pid>`` (removed if writing fails; a killed writer's leftover
    is removed by the next build), is fsynced, then renamed over ``path``; the folder is fsynced.
    """
    tmp = tmp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())

"""Ring files on disk: the memory file system check, private ring folders with an owner lock, and
the removal of what a killed builder left (see :mod:`hs_dataset.capture.transport`)."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import uuid
from pathlib import Path

from hs_dataset.capture.transport.format import OWNER_LOCK, PRIVATE_DIR_PREFIX, RING_PREFIX, _locked_by_someone

__all__ = ["MEMORY_FS", "file_system_type", "private_dir", "remove_stale"]

MEMORY_FS = ("tmpfs", "hugetlbfs", "ramfs")


def file_system_type(path: str | os.PathLike) -> str | None:
    """The type of the file system holding ``path`` (Linux ``/proc/self/mounts``; None elsewhere)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = os.path.realpath(path), "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def remove_stale(directory: str | os.PathLike) -> list[str]:
    """Delete the ring files in ``directory`` and the private ring folders (``hs_dataset-*``) in it
    whose owner died (nobody holds their lock); returns what was removed."""
    removed: list[str] = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        if p.name.startswith(RING_PREFIX) and p.is_file():
            lock = p
        elif p.name.startswith(PRIVATE_DIR_PREFIX) and p.is_dir():
            lock = p / OWNER_LOCK
        else:
            continue
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            if p.is_dir() and time.time() - p.stat().st_mtime > 60:  # died before taking its lock
                shutil.rmtree(p, ignore_errors=True)
                removed.append(str(p))
            continue
        try:
            if _locked_by_someone(fd):
                continue
        finally:
            os.close(fd)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(str(p))
    return removed


def private_dir(parent: str | os.PathLike) -> tuple[Path, int]:
    """A new ring folder ``<parent>/hs_dataset-<id>`` and the fd of its held owner lock."""
    d = Path(parent) / f"{PRIVATE_DIR_PREFIX}{uuid.uuid4().hex[:12]}"
    d.mkdir(parents=True)
    fd = os.open(d / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return d, fd

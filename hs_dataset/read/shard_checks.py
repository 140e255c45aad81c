"""Damaged bytes are never handed out: a shard's content hash is checked before the first of its rows is read.

Every tensor the reader makes over a build's shard (:mod:`hs_dataset.read.safe_views`: ``iter_torch``,
``TORCH_FORMAT``, ``decode_row``, the collator, in DataLoader workers too) first asks
:func:`ensure_intact` about the file it comes from. The first time a shard is met, its whole content is
hashed (xxh3-128, :mod:`hs_dataset.integrity.checksums`) and compared with the build's
``hs_dataset.json``; a shard that differs raises :class:`~hs_dataset.errors.IntegrityError` naming it,
and none of its rows is handed out. The hash reads the shard once from disk, in order, which also
brings it into the page cache: the rows are then read from memory. A shard that matched is not hashed
again while this machine runs (until it reboots) unless the file changes (its size, modification time
or inode): the verdict is kept in a small marker file under ``$XDG_CACHE_HOME/hs_dataset/verified``
(``~/.cache``), so DataLoader workers and later epochs share it; a lock makes one process hash a shard
while the others wait.

A version downloaded by :func:`hs_dataset.read.open_dataset` has each file hashed as it arrives (a damaged
one is deleted and refused) and is read as a local build; streaming ``open_dataset(dir, streaming=True)``
reads the mapped shards, so it is covered too.

What is not covered: rows read without tensors (``ds[i]`` in the default format, plain
``load_dataset``), and streaming reads of datasets' own (``load_dataset(..., streaming=True)``, and
``open_dataset("org/name", streaming=True)`` over HTTP): their bytes are never mapped from the shard, so
there is no file to check as they are read; those paths check the listing, sizes and rows only, and
``hs-dataset verify`` the hashes.
``HS_DATASET_CHECK_SHARDS=0`` turns the check off (measured cost: README, "Load for training").
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from hs_dataset.errors import IntegrityError
from hs_dataset.integrity.checksums import HASH_KEY, file_digest
from hs_dataset.layout import DATA_DIR, META_FILE, SHARD_RE

__all__ = ["CHECK_ENV", "ensure_intact", "shard_checks_enabled"]

CHECK_ENV = "HS_DATASET_CHECK_SHARDS"
DOWNLOAD_RECORDS = ".cache/huggingface"  # in a folder huggingface_hub downloaded a version into (local_dir)

_lock = threading.Lock()
_intact: set[tuple[int, int, int, int]] = set()  # (device, inode, size, mtime_ns) hashed and matched here
_records: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {}  # build root -> (meta mtime_ns, shards by name)


def shard_checks_enabled() -> bool:
    """Whether reads check shard hashes (``HS_DATASET_CHECK_SHARDS``, default on)."""
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _recorded(root: Path) -> dict[str, dict[str, Any]] | None:
    """The shard entries of the build at ``root`` (None: not a finished build of ours)."""
    meta = root / META_FILE
    try:
        mtime = meta.stat().st_mtime_ns
    except OSError:
        return None
    with _lock:
        hit = _records.get(str(root))
    if hit is not None and hit[0] == mtime:
        return hit[1]
    try:
        shards = json.loads(meta.read_text(encoding="utf-8")).get("shards")
        by_name = {str(s["name"]): s for s in shards if isinstance(s, dict) and "name" in s}
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    with _lock:
        _records[str(root)] = (mtime, by_name)
    return by_name


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "no-boot-id"


def _marker_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "hs_dataset" / "verified" / _boot_id()


def ensure_intact(path: str | os.PathLike, st: os.stat_result | None = None, *, always: bool = False) -> None:
    """Raise :class:`IntegrityError` when ``path`` is a shard of a build whose content differs from its record.

    Files that are not shards of a finished build (``<root>/data/train-*`` beside ``<root>/hs_dataset.json``)
    pass unchecked. The first call for a shard hashes it (see the module docstring); later ones cost a
    ``stat``.

    Args:
        path: the file.
        st: its ``os.stat`` result, when the caller has it.
        always: check even when ``HS_DATASET_CHECK_SHARDS=0`` (a file just downloaded).

    Raises:
        IntegrityError: the shard's content hash, or its size, differs from ``hs_dataset.json``.
    """
    if not (always or shard_checks_enabled()):
        return
    p = Path(os.fsdecode(path))
    if p.parent.name != DATA_DIR or not SHARD_RE.match(p.name):
        return
    st = st or os.stat(p)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _intact:
        return
    entries = _recorded(p.parent.parent)
    entry = (entries or {}).get(p.name)
    if entry is None or HASH_KEY not in entry:
        return  # not a recorded shard of ours (or one written before checksums): nothing to check against
    where = f"{p.parent.parent}: {DATA_DIR}/{p.name}"
    if int(entry["bytes"]) != st.st_size:
        raise IntegrityError(f"{where} has {st.st_size} bytes, {entry['bytes']} recorded: refusing its rows. "
                             f"{_repair(p)}")
    marker_dir = _marker_dir()
    marker = marker_dir / hashlib.sha256(f"{key}:{entry[HASH_KEY]}".encode()).hexdigest()[:32]
    if not marker.exists():
        _hash_once(p, marker, entry[HASH_KEY], where)
    with _lock:
        _intact.add(key)


def _hash_once(p: Path, marker: Path, expected: str, where: str) -> None:
    """Hash ``p`` unless another process does it now (it holds the marker's lock); leave the marker on success."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = -1  # no cache to share: hash here, keep the verdict in this process only
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one process hashes a shard; the others wait for its verdict
            if marker.exists():
                return
        if file_digest(p) != expected:
            raise IntegrityError(f"{where}: its content hash differs from the xxh3_128 recorded in {META_FILE} "
                                 f"(damaged on disk since it was written): refusing its rows. {_repair(p)}")
        if fd >= 0:
            try:
                marker.write_text(expected)
            except OSError:
                pass
    finally:
        if fd >= 0:
            os.close(fd)


def _repair(p: Path) -> str:
    """What repairs the damaged shard ``p``: a download again (a downloaded version), or the build command."""
    root = p.parent.parent
    if (root / DOWNLOAD_RECORDS).is_dir():  # a version downloaded by hs_dataset.hub.download
        return f"This is a downloaded version: delete {p} and open the version again to download it again"
    return f"Run `hs-dataset verify {root}`, then the build command again to rebuild the damaged part"

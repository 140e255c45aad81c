"""Damaged bytes are never handed out: every block of a shard is hashed in the pass that reads it.

A build records, for every shard, the xxh3-64 of each 1 MiB block (``blocks_xxh3_64``,
:mod:`hs_dataset.integrity.checksums`). Every tensor the reader makes over a build's shard
(:mod:`hs_dataset.read.safe_views`: ``iter_torch``, ``TORCH_FORMAT``, ``decode_row``, the windows, the
collator, in DataLoader workers too) first asks a :class:`BlockChecks` about the bytes it comes from: the
blocks under them are hashed from the very memory the value is read from (which also brings them into the
page cache) and compared with the record; a block that differs raises
:class:`~hs_dataset.errors.IntegrityError` naming the shard and the block, and the value is not made.

A :class:`BlockChecks` lives for one pass (an ``iter_torch`` loop, one ``TORCH_FORMAT`` batch, one window
walk): a block read twice in it is hashed once, and nothing is remembered after it, in this process or
any other. So a bit that flips between two epochs (keeping the file's size, time and inode) is refused on
the next read, and a reader whose shard is replaced under it (a repair) compares the bytes it still maps
with the new record: it refuses them rather than serve the old rows.

Builds of format version 1 record only the whole-file hash: :func:`check_whole` hashes such a shard once
when :func:`~hs_dataset.read.open_dataset` opens it, and the readers check nothing more for it.
``HS_DATASET_CHECK_SHARDS=0`` turns the readers' checks off (``benchmarks/verified_reads.py`` measures
what they cost).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

from hs_dataset.errors import IntegrityError
from hs_dataset.integrity.checksums import (BLOCK_BYTES, BLOCK_SIZE_KEY, BLOCKS_KEY, DIGITS, HASH_KEY, block_digest,
                                            file_digest)
from hs_dataset.layout import DATA_DIR, META_FILE, SHARD_RE

__all__ = ["CHECK_ENV", "BlockChecks", "check_whole", "shard_checks_enabled"]

CHECK_ENV = "HS_DATASET_CHECK_SHARDS"
DOWNLOAD_RECORDS = ".cache/huggingface"  # in a folder huggingface_hub downloaded a version into (local_dir)
_DELETED = " (deleted)"  # /proc/self/maps' mark of a file no longer at its path

_lock = threading.Lock()
# build root -> (the manifest's (inode, size, mtime_ns), shards by name): the record, re-read when it changes
_records: dict[str, tuple[tuple[int, int, int], dict[str, dict[str, Any]]]] = {}

Memory = Callable[[int, int], Any]  # (file offset, length) -> a buffer over those bytes as mapped, or None


def shard_checks_enabled() -> bool:
    """Whether reads check shard hashes (``HS_DATASET_CHECK_SHARDS``, default on)."""
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _recorded(root: Path) -> dict[str, dict[str, Any]] | None:
    """The shard entries of the build at ``root`` (None: not a finished build of ours)."""
    meta = root / META_FILE
    try:
        st = meta.stat()
    except OSError:
        return None
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        hit = _records.get(str(root))
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        shards = json.loads(meta.read_text(encoding="utf-8")).get("shards")
        by_name = {str(s["name"]): s for s in shards if isinstance(s, dict) and "name" in s}
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    with _lock:
        _records[str(root)] = (key, by_name)
    return by_name


def _entry(path: str) -> tuple[Path, dict[str, Any]] | None:
    """``(shard path, its record)`` when ``path`` is a recorded shard of a finished build, else None."""
    p = Path(path[:-len(_DELETED)] if path.endswith(_DELETED) else path)
    if p.parent.name != DATA_DIR or not SHARD_RE.match(p.name):
        return None
    entry = (_recorded(p.parent.parent) or {}).get(p.name)
    return None if entry is None else (p, entry)


class BlockChecks:
    """The blocks verified in one pass of a reader (see the module); safe to share between threads."""

    def __init__(self) -> None:
        self.enabled = shard_checks_enabled()
        self._done: set[tuple[str, int, int]] = set()  # (path, inode, block) hashed and matched in this pass
        self._lock = threading.Lock()

    def check(self, path: str, inode: int, offset: int, nbytes: int, memory: Memory, size: int | None) -> None:
        """Raise :class:`IntegrityError` unless every block under bytes ``[offset, offset + nbytes)`` of the
        shard ``path`` (a file of ``inode``, mapped here) hashes to its record.

        Args:
            path: the file as ``/proc/self/maps`` names it (``" (deleted)"`` when it was replaced since).
            inode: the mapped file's inode.
            offset, nbytes: the bytes about to be read.
            memory: gives a block's bytes as mapped here (None: outside the mapping).
            size: the file's size now (None: not known, a file no longer at its path).
        """
        if not self.enabled:
            return
        found = _entry(path)
        if found is None or BLOCKS_KEY not in found[1]:
            return  # not a shard of ours, or of format version 1 (hashed whole at open: check_whole)
        p, entry = found
        block = int(entry.get(BLOCK_SIZE_KEY) or BLOCK_BYTES)
        recorded, total = str(entry[BLOCKS_KEY]), int(entry["bytes"])
        where = f"{p.parent.parent}: {DATA_DIR}/{p.name}"
        for b in range(offset // block, (offset + max(nbytes, 1) - 1) // block + 1):
            if (path, inode, b) in self._done:
                continue
            lo, n = b * block, min(block, total - b * block)
            if n <= 0 or (size is not None and size != total):
                raise IntegrityError(f"{where} has {size} bytes, {total} recorded: refusing its rows. {_repair(p)}")
            data = memory(lo, n)
            if data is None:
                raise IntegrityError(f"{where}: bytes {lo}..{lo + n} cannot be checked where they are mapped "
                                     f"(the file changed while being read): open the dataset again")
            if block_digest(data) != recorded[b * DIGITS:(b + 1) * DIGITS]:
                raise IntegrityError(f"{where}: block {b} (bytes {lo}..{lo + n}) differs from the {BLOCKS_KEY} "
                                     f"recorded in {META_FILE} (damaged on disk since it was written, or replaced "
                                     f"while being read): refusing its rows. {_repair(p)}")
            with self._lock:
                self._done.add((path, inode, b))


def check_whole(path: str | os.PathLike, *, always: bool = False) -> None:
    """Hash a recorded shard whole against its ``xxh3_128`` (a version 1 shard at open, a file just downloaded).

    Args:
        path: the shard.
        always: even when ``HS_DATASET_CHECK_SHARDS=0``.

    Raises:
        IntegrityError: its size or content hash differs from ``hs_dataset.json``.
    """
    if not (always or shard_checks_enabled()):
        return
    found = _entry(os.fsdecode(path))
    if found is None or HASH_KEY not in found[1]:
        return
    p, entry = found
    where = f"{p.parent.parent}: {DATA_DIR}/{p.name}"
    size = p.stat().st_size
    if size != int(entry["bytes"]):
        raise IntegrityError(f"{where} has {size} bytes, {entry['bytes']} recorded: refusing its rows. {_repair(p)}")
    if file_digest(p) != entry[HASH_KEY]:
        raise IntegrityError(f"{where}: its content hash differs from the xxh3_128 recorded in {META_FILE} "
                             f"(damaged on disk since it was written): refusing its rows. {_repair(p)}")


def _repair(p: Path) -> str:
    """What repairs the damaged shard ``p``: a download again (a downloaded version), or the build command."""
    root = p.parent.parent
    if (root / DOWNLOAD_RECORDS).is_dir():  # a version downloaded by hs_dataset.hub.download
        return f"This is a downloaded version: delete {p} and open the version again to download it again"
    return f"Run `hs-dataset verify {root}`, then the build command again to rebuild the damaged part"

"""Tensors over dataset memory that are safe to write to: private copy-on-write mappings.

``datasets`` (and :func:`hs_dataset.read.open_dataset`) memory-map the Arrow shards read-only,
and PyTorch has no read-only tensors: an in-place op on a tensor viewing those pages is a
segfault. :class:`SafeViews` hands out each large value instead as its own ``MAP_PRIVATE`` mapping
of the same file bytes: reading it costs what reading the shard's mapping costs (the same
page-cache pages), a write copies the 4 KiB page it touches into this process and never reaches
the file, and the mapping with its copied pages goes away with the last tensor viewing it (as
SpecForge's per-sample ``torch.load(mmap=True)`` behaves). A later read of the same row maps the
file again, so it never sees an earlier in-place edit. Values under :data:`MIN_MAP_BYTES` are
copied, which is cheaper than a mapping; memory that no file backs (a streaming dataset's batches,
in-memory tables) is writable already and is viewed as it is.

Which file and offset an address belongs to comes from ``/proc/self/maps``, read once per
:class:`SafeViews` (a read keeps the mappings of the tables it reads alive). Linux only: elsewhere
every value is copied. Before a value of a build's shard is handed out (mapped or copied), the blocks of
the shard under it are hashed from that memory and checked against the build's record
(:mod:`hs_dataset.read.shard_checks`).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import re
import sys
import warnings
from typing import Any

import numpy as np
import torch

from hs_dataset.read.shard_checks import BlockChecks

__all__ = ["MIN_MAP_BYTES", "SafeViews", "libc_madvise"]

MIN_MAP_BYTES = 1 << 20  # smaller values are copied: a copy of 1 MiB costs about what a mapping does
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault the pages in (reading them from disk) without touching them
_WILLNEED_CHUNK = 4 << 20  # the kernel reads at most max(read_ahead_kb, max_sectors_kb) per WILLNEED call (madvise or fadvise)
_PIPE_BYTES = 16 << 20  # a value is read in and hashed in parts of this many bytes (whole 1 MiB blocks)
_MAPS_LINE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ (\d+) +(/.*)$", re.M)
_COPY = object()  # file-backed, but not mappable again (deleted, replaced, unreadable): copy

_libc: Any = None


def _load_libc() -> Any:
    """libc with ``mmap``, ``munmap`` and ``madvise`` typed, or False off Linux (ctypes calls release the GIL)."""
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int64]
                libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc


def libc_madvise() -> Any:
    """libc's ``madvise(addr, length, advice)`` (GIL released while it runs), or None off Linux."""
    libc = _load_libc()
    return libc.madvise if libc else None


class _PrivateMapping:
    """``MAP_PRIVATE`` read/write mapping of ``nbytes`` bytes of ``fd`` at ``offset``, seen by numpy as a
    1-D ``dtype`` array (``np.asarray(m)``); unmapped when the last array or tensor viewing it is gone."""

    def __init__(self, fd: int, offset: int, nbytes: int, dtype: np.dtype):
        libc = _load_libc()
        start = offset - offset % mmap.PAGESIZE
        length = offset + nbytes - start
        addr = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, start)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap of a shard range failed")
        self._addr, self._len, self._munmap = addr, length, libc.munmap
        self._first, self._stop = start, offset + nbytes  # the file bytes it maps
        self.__array_interface__ = {"data": (addr + offset - start, False), "shape": (nbytes // dtype.itemsize,),
                                    "typestr": dtype.str, "version": 3}

    def holds(self, offset: int, n: int) -> bool:
        """Whether file bytes ``[offset, offset + n)`` are in this mapping."""
        return self._first <= offset and offset + n <= self._stop

    def buffer(self, offset: int, n: int) -> Any:
        """File bytes ``[offset, offset + n)`` as mapped here (see :meth:`holds`), a buffer without a copy."""
        return (ctypes.c_char * n).from_address(self._addr + offset - self._first)

    def populate(self, lo: int, stop: int) -> None:
        """Read file bytes ``[lo, stop)`` (within this mapping) in now, on this thread, so that the first access
        does not wait for the disk."""
        madvise = _load_libc().madvise
        a = self._addr + lo - self._first
        a -= a % mmap.PAGESIZE
        b = self._addr + stop - self._first
        if madvise(a, b - a, _MADV_POPULATE_READ) == 0:
            return
        for x in range(a, b, _WILLNEED_CHUNK):  # Linux < 5.14: ask for read-ahead
            madvise(x, min(_WILLNEED_CHUNK, b - x), _MADV_WILLNEED)

    def __del__(self) -> None:
        if getattr(self, "_munmap", None) is not None:
            self._munmap(self._addr, self._len)


def _view(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # numpy flags Arrow memory read-only; this memory is writable
        return torch.from_numpy(arr)


class SafeViews:
    """Makes tensors over Arrow memory that can be written to without touching any file (see the module).

    Args:
        populate: read each mapped value's pages in when it is made (on the calling thread; the
            reader's read-ahead thread does this so the consumer never waits for the disk).
        checks: the reader's pass of block checks (default: one of its own).
    """

    def __init__(self, populate: bool = False, checks: BlockChecks | None = None):
        self.populate = populate
        self.checks = checks or BlockChecks()
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, int, bytes]] = []  # (end, file offset at start, inode, path)
        self._fds: dict[tuple[bytes, int], Any] = {}
        self._linux = bool(_load_libc())
        if self._linux:
            try:
                with open("/proc/self/maps", "rb") as f:
                    text = f.read()
            except OSError:
                self._linux = False
                return
            for a, b, off, inode, path in _MAPS_LINE.findall(text):
                self._starts.append(int(a, 16))
                self._ranges.append((int(b, 16), int(off, 16), int(inode), path))

    def _locate(self, addr: int, nbytes: int) -> Any:
        """None (no file backs ``addr``), or ``(mapping line, fd or _COPY, file offset, file size or None)``."""
        k = bisect.bisect_right(self._starts, addr) - 1
        if k < 0 or addr >= self._ranges[k][0]:
            return None  # in no file mapping
        _, file_off, inode, path = self._ranges[k]
        fd = self._fds.get((path, inode))
        if fd is None:
            fd = self._fds[path, inode] = self._open(path, inode)
        return k, fd, file_off + addr - self._starts[k], None if fd is _COPY else os.fstat(fd).st_size

    def _check(self, where: Any, nbytes: int, private: "_PrivateMapping | None" = None) -> None:
        """Check the shard blocks under the value (:mod:`hs_dataset.read.shard_checks`), hashing them from the
        private mapping just made (its pages are the value's), else from the Arrow mapping of the shard (a block's
        edge beyond the value: the same page-cache pages, no copy), else from the file."""
        k, fd, offset, size = where
        start, (end, file_off, inode, path) = self._starts[k], self._ranges[k]

        def memory(lo: int, n: int) -> Any:
            if private is not None and private.holds(lo, n):
                return private.buffer(lo, n)
            if file_off <= lo and lo + n <= file_off + end - start:  # the Arrow mapping (a block's edge too)
                return (ctypes.c_char * n).from_address(start + lo - file_off)
            return None if fd is _COPY else os.pread(fd, n, lo)
        self.checks.check(os.fsdecode(path), inode, offset, nbytes, memory, size)

    def _populate_and_check(self, m: _PrivateMapping, where: Any, nbytes: int) -> None:
        """Read the value's pages in (``populate``) and check its blocks, in parts of :data:`_PIPE_BYTES`: the reader
        asked for the coming values already (:meth:`will_need`), so the disk reads on while a part is hashed
        (``benchmarks/verified_reads.py`` without ``--hot``, checked or not)."""
        if not self.populate:
            self._check(where, nbytes, m)
            return
        k, fd, offset, size = where
        cuts = [offset, *range(offset - offset % _PIPE_BYTES + _PIPE_BYTES, offset + nbytes, _PIPE_BYTES),
                offset + nbytes]
        for lo, stop in zip(cuts, cuts[1:]):
            m.populate(lo, stop)
            self._check((k, fd, lo, size), stop - lo, m)

    def will_need(self, arr: np.ndarray) -> None:
        """Ask the kernel to read the file bytes under ``arr`` (a zero-copy numpy view of Arrow memory, a value about
        to be read) into the page cache in the background; returns at once. Nothing for memory no file backs."""
        where = self._locate(arr.__array_interface__["data"][0], arr.nbytes) if self._linux and arr.nbytes else None
        if where is None or where[1] is _COPY:
            return
        fd, offset = where[1], where[2]
        for x in range(offset, offset + arr.nbytes, _WILLNEED_CHUNK):
            os.posix_fadvise(fd, x, min(_WILLNEED_CHUNK, offset + arr.nbytes - x), os.POSIX_FADV_WILLNEED)

    @staticmethod
    def _open(path: bytes, inode: int) -> Any:
        if path.endswith(b" (deleted)"):
            return _COPY
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return _COPY
        if os.fstat(fd).st_ino != inode:  # the path now names another file than the one mapped
            os.close(fd)
            return _COPY
        return fd

    def tensor(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` (a zero-copy numpy view of Arrow memory) as a tensor safe to write to; a shard's bytes are
        checked first (:mod:`hs_dataset.read.shard_checks`)."""
        if arr.nbytes == 0 or not self._linux:
            return torch.from_numpy(arr.copy())
        addr = arr.__array_interface__["data"][0]
        where = self._locate(addr, arr.nbytes)
        if where is None:
            return _view(arr)
        k, fd, offset, size = where
        # a mapping line split in two, or a file no longer there in full: a copy, never a bare view
        mappable = fd is not _COPY and addr + arr.nbytes <= self._ranges[k][0] and offset + arr.nbytes <= (size or 0)
        if mappable and arr.nbytes >= MIN_MAP_BYTES:
            try:
                m = _PrivateMapping(fd, offset, arr.nbytes, arr.dtype)
            except OSError:  # e.g. vm.max_map_count reached: copy instead
                pass
            else:
                self._populate_and_check(m, where, arr.nbytes)
                return torch.from_numpy(np.asarray(m)).view(arr.shape)
        self._check(where, arr.nbytes)
        return torch.from_numpy(arr.copy())

    def close(self) -> None:
        """Close the shard file descriptors (the mappings made stay valid)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            if fd is not _COPY:
                os.close(fd)

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "SafeViews":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

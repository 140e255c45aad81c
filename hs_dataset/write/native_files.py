"""Shard files that Arrow writes itself, one thread a file: the rows' buffers go to the file with ``write(2)``.

``datasets``' writer hands its output file to ``pyarrow.RecordBatchStreamWriter``. Through
:class:`NativeLocalFileSystem` (the local file system under the protocol ``hsds-native://``,
:func:`native_url` gives a folder's URL) that file is a ``pyarrow.OSFile``: pyarrow writes each buffer
of a row (for a capture, the ring's memory) straight into the file, with no Python call in between.
``datasets`` treats a file system other than fsspec's own local one as remote and writes straight into
the folder (no ``.incomplete`` rename), which the build's staging folder does not need.

Before, this module split every large write into 8 MiB pieces written by up to 8 threads with
``pwrite``. A buffered write holds the file's inode lock on tmpfs and ext4, so the pieces of one file
do not land in parallel: on the H200's host, into /dev/shm, 8 threads moved 2.68 GB/s at 2.12 CPU-s/GB
against 3.21 GB/s at 0.31 CPU-s/GB for one thread's ``write`` (``benchmarks/file_writes.py``,
``benchmarks/results/2026-12-03-h200-file-writes.json``; 4 and 8 files written side by side, a thread
each: 12.7 and 19.6 GB/s). On the 2-vCPU VM, the same Arrow stream of eight Kimi-width rows into
/dev/shm, three rounds in turn: through the pieces 0.56 / 2.29 / 1.11 GB/s, through ``pyarrow.OSFile``
2.59 / 2.67 / 2.86 GB/s.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pyarrow as pa
from fsspec import AbstractFileSystem, register_implementation
from fsspec.implementations.local import LocalFileSystem

__all__ = ["PROTOCOL", "NativeLocalFileSystem", "coding_threads", "native_url"]

PROTOCOL = "hsds-native"


def coding_threads() -> int:
    """Shards coded at once at a part's commit (zstd, Parquet): up to 8, the CPUs this process may use."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class NativeLocalFileSystem(AbstractFileSystem):
    """The local file system as ``hsds-native://`` paths, files opened for writing as ``pyarrow.OSFile``."""

    protocol = PROTOCOL
    root_marker = "/"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:]
        return LocalFileSystem._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "w" in mode:
            return pa.OSFile(path, "wb")
        return self._local._open(path, mode, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._local.ls(self._strip_protocol(path), detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._local.info(self._strip_protocol(path), **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._local.mkdir(self._strip_protocol(path), create_parents=create_parents, **kwargs)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        os.replace(self._strip_protocol(path1), self._strip_protocol(path2))

    def rm_file(self, path: str) -> None:
        os.unlink(self._strip_protocol(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for p in path if isinstance(path, list) else [path]:
            p = self._strip_protocol(p)
            if os.path.isdir(p):
                shutil.rmtree(p) if recursive else os.rmdir(p)
            elif os.path.exists(p):
                os.unlink(p)


register_implementation(PROTOCOL, NativeLocalFileSystem, clobber=True)


def native_url(path: str | os.PathLike) -> str:
    """``hsds-native://<absolute path>``: a folder ``datasets`` then writes into through ``pyarrow.OSFile``."""
    return f"{PROTOCOL}://{os.path.abspath(path)}"

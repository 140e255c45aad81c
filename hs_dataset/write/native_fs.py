"""The file system ``datasets`` writes a part's staging folder through: the local one under the protocol
``hsds-native://`` (:func:`native_url` gives a folder's URL), whose files opened for writing are
:class:`~hs_dataset.write.native_files.BackgroundFile` (written by a thread each, coded once written when the
folder is opened with :func:`coding_options`), and where a file still being written is moved by its thread after
its last write (:func:`~hs_dataset.write.native_files.move`).

``datasets`` treats a file system other than fsspec's own local one as remote and writes straight into the
folder (no ``.incomplete`` rename), which the build's staging folder does not need.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from fsspec import AbstractFileSystem, register_implementation
from fsspec.implementations.local import LocalFileSystem

from hs_dataset.write.native_files import BackgroundFile, move

__all__ = ["PROTOCOL", "NativeLocalFileSystem", "coding_options", "native_url"]

PROTOCOL = "hsds-native"


class NativeLocalFileSystem(AbstractFileSystem):
    """The local file system as ``hsds-native://`` paths, files opened for writing as :class:`BackgroundFile`."""

    protocol = PROTOCOL
    root_marker = "/"

    def __init__(self, coding: str | None = None, state_columns: tuple[str, ...] = (), **kwargs: Any):
        """``coding``, ``state_columns``: each file opened for writing is coded once written (:class:`BackgroundFile`)."""
        super().__init__(coding=coding, state_columns=tuple(state_columns), **kwargs)
        self._coding, self._state_columns = coding, tuple(state_columns)
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
        if "w" in mode:  # a shard is coded, never the folder's other files (dataset_info.json)
            return BackgroundFile(path, self._coding if path.endswith(".arrow") else None, self._state_columns)
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
        """A file still being written is moved by its thread after its last write (:func:`move`)."""
        move(self._strip_protocol(path1), self._strip_protocol(path2))

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
    """``hsds-native://<absolute path>``: a folder ``datasets`` then writes into through :class:`BackgroundFile`
    (its shards coded once written with ``storage_options=coding_options(...)``)."""
    return f"{PROTOCOL}://{os.path.abspath(path)}"


def coding_options(coding: str | None, state_columns: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``storage_options`` of a :func:`native_url` whose ``.arrow`` files are coded once written
    (``coding``: ``"zstd"``, ``"parquet"``, or None: not coded)."""
    return {"coding": coding, "state_columns": tuple(state_columns)} if coding else {}

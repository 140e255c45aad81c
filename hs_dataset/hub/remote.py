"""A published version read file by file: on the Hub (``org/name``) or in object storage (an fsspec URL).

:func:`open_remote` resolves the version once (a Hub revision to its commit, a store's version to its
pointer), reads its ``hs_dataset.json`` and checks the remote listing against it (every recorded shard
there at its size, nothing else in ``data/``) before any shard is fetched. :meth:`RemoteVersion.fetch`
then copies one shard to a local path, checked against its recorded size, rows and content hash as it
arrives: the path holds the shard only once it matched (a damaged copy is deleted and refused, naming
the shard). This is what the rank-aware reader (:mod:`hs_dataset.read.ranked`) fetches through.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from huggingface_hub import HfApi

from hs_dataset.errors import IntegrityError
from hs_dataset.hub.access import hub_errors
from hs_dataset.hub.objects import fetch_file, is_object_url, open_store
from hs_dataset.hub.versions import REPO_TYPE, remote_files
from hs_dataset.integrity.checksums import check_shard
from hs_dataset.integrity.verify import Problem, VerifyReport, check_listing, recorded_shards
from hs_dataset.layout import DATA_DIR, META_FILE

__all__ = ["RemoteVersion", "open_remote"]


@dataclass
class RemoteVersion:
    """One resolved version, its shards fetched one at a time, each checked as it arrives.

    Attributes:
        where: the version, for messages (``org/name@v1.0 (commit)``, ``s3://b/p@v1.0``).
        key: what names this version's files in a cache (the commit, or the store version's id).
        meta: its ``hs_dataset.json``.
        shards: its recorded shards, in the version's order.
    """

    where: str
    key: str
    meta: dict[str, Any]
    shards: list[dict[str, Any]]
    _copy: Callable[[str, Path], None]

    def fetch(self, name: str, dest: Path) -> int:
        """Copy shard ``name`` to ``dest``, checked (see the module); -> the bytes fetched.

        Raises:
            IntegrityError: the copy's size, rows or content hash differs from the record (nothing kept).
        """
        entry = next(s for s in self.shards if s["name"] == name)
        part = dest.with_name(f".part-{os.getpid()}-{dest.name}")  # the suffix kept: it says the format
        try:
            self._copy(f"{DATA_DIR}/{name}", part)
            why = check_shard(part, entry, quick=False)
            if why is not None:
                raise IntegrityError(f"{self.where}: {DATA_DIR}/{name} as fetched {why} (damaged where it is stored or "
                                     "on the way): refused, nothing of it kept. `hs-dataset verify` of the version names "
                                     "every damaged shard; the publisher pushes it again",
                                     [Problem(f"{DATA_DIR}/{name}", why)])
            size = part.stat().st_size
            os.replace(part, dest)
            return size
        finally:
            part.unlink(missing_ok=True)


def open_remote(source: str, *, revision: str | None = None, token: str | None = None,
                endpoint: str | None = None, storage_options: dict[str, Any] | None = None) -> RemoteVersion:
    """The version ``revision`` of ``source`` (a Hub repo id, or an fsspec URL of a store), its listing checked.

    Args:
        source: ``org/name`` (the Hub) or ``s3://bucket/prefix`` (any fsspec URL).
        revision: the version (default: the newest: ``main`` on the Hub).
        token, endpoint: for the Hub. storage_options: for fsspec.

    Raises:
        HubAccessError: no such repo, store or version; the Hub cannot be reached.
        NotABuildError: the version holds no ``hs_dataset.json``.
        IntegrityError: the remote files differ from what ``hs_dataset.json`` records.
    """
    if is_object_url(source):
        store = open_store(source, storage_options)
        version, ref = store.resolve(revision)
        meta = store.read_meta(version, ref)
        where = f"{store.url}@{version}"

        def copy_from_store(rel: str, dest: Path) -> None:
            fetch_file(store, version, rel, dest, None)

        present = _store_listing(store.fs, store.version_path(version, DATA_DIR))
        remote = RemoteVersion(where, f"{version}-{str(ref['id'])[:16]}", meta, recorded_shards(meta, where),
                               copy_from_store)
    else:
        api = HfApi(endpoint=endpoint, token=token)
        with hub_errors(endpoint, source):
            commit = str(api.dataset_info(source, revision=revision).sha)
            meta_path = api.hf_hub_download(source, META_FILE, repo_type=REPO_TYPE, revision=commit)
            prefix = DATA_DIR + "/"
            present = {p[len(prefix):]: int(f.size) for p, f in remote_files(api, source, commit).items()
                       if p.startswith(prefix)}
        meta = json.loads(Path(meta_path).read_text(encoding="utf-8"))
        where = f"{source}@{revision or 'main'} ({commit})"

        def copy_from_hub(rel: str, dest: Path) -> None:
            staging = dest.parent / ".staging"
            with hub_errors(endpoint, source):
                got = api.hf_hub_download(source, rel, repo_type=REPO_TYPE, revision=commit, local_dir=staging)
            shutil.move(got, dest)

        remote = RemoteVersion(where, commit, meta, recorded_shards(meta, where), copy_from_hub)
    problems, rows = check_listing(remote.meta, present, remote.where)
    VerifyReport(remote.where, True, len(remote.shards), rows, problems,
                 repair=f"Nothing of it was fetched. The published files differ from their {META_FILE}: the publisher "
                        "pushes the version again.").raise_if_bad()
    return remote


def _store_listing(fs: Any, base: str) -> dict[str, int]:
    fs.invalidate_cache()
    try:
        found = fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    return {p[len(base) + 1:]: int(info["size"]) for p, info in found.items()}

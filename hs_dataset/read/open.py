"""Opening a build for reading, checked first: a local build mapped in place, or a published version, on disk once.

:func:`open_dataset` is the one way in. A local build directory is memory-mapped where it is. A published
version (``org/name`` + ``revision``) is downloaded once into a folder of its own
(:mod:`hs_dataset.hub.download`: resumable, never twice) and mapped there, so the data exists once on disk;
``streaming=True`` on a repo reads it over HTTP with nothing written, each block checked as it arrives
(:mod:`hs_dataset.read.remote`). What the other ways cost: ``load_dataset(dir)`` converts every shard into the
``datasets`` cache (a second copy of the build), and ``load_dataset("org/name")`` downloads into the hub cache
and then converts (two more copies); neither checks a hash (docs/verified-reads.md).

Every way refuses a build whose shards do not add up to what its ``hs_dataset.json`` records (a missing or
extra shard, a shard of another size or other rows: :class:`IntegrityError`); a downloaded file's hashes
are checked as soon as it arrives, and every tensor reader checks each block of a shard as it reads it
(:mod:`hs_dataset.read.shard_checks`). Rows are decoded by :mod:`hs_dataset.read.decode` and iterated by
:mod:`hs_dataset.read.iterate`; batches are made by :mod:`hs_dataset.read.collate`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, overload

import datasets

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from hs_dataset.errors import ConfigError, HubAccessError, IntegrityError, NotABuildError
from hs_dataset.hub.download import download_version, remote_version
from hs_dataset.hub.objects import download_object_version, is_object_url
from hs_dataset.integrity.checksums import BLOCKS_KEY
from hs_dataset.integrity.verify import Problem, VerifyReport, check_listing, data_files, read_meta, recorded_shards
from hs_dataset.layout import DATA_DIR
from hs_dataset.read.remote import stream_version
from hs_dataset.read.shard_checks import check_whole

__all__ = ["open_dataset"]

# org/name: a repo id as the Hub spells it (huggingface_hub checks the rest); anything else is a path
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _is_repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return bool(_REPO_ID.match(name))


@overload
def open_dataset(path_or_repo: str | os.PathLike, *, revision: str | None = None, streaming: Literal[False] = False,
                 token: str | None = None, local_dir: str | os.PathLike | None = None,
                 num_shards: int | None = None) -> datasets.Dataset: ...


@overload
def open_dataset(path_or_repo: str | os.PathLike, *, revision: str | None = None, streaming: Literal[True],
                 token: str | None = None, local_dir: str | os.PathLike | None = None,
                 num_shards: int | None = None) -> datasets.IterableDataset: ...


def open_dataset(path_or_repo: str | os.PathLike, *, revision: str | None = None, streaming: bool = False,
                 token: str | None = None, local_dir: str | os.PathLike | None = None,
                 num_shards: int | None = None) -> datasets.Dataset | datasets.IterableDataset:
    """A finished build, local or published, as a ``datasets`` dataset, its shards checked against ``hs_dataset.json``.

    * a build directory (``OUT`` of ``hs-dataset build``, or a downloaded version's folder): its Arrow
      shards memory-mapped in place (``Dataset.from_file``): nothing is copied or converted, opening a
      1 TB build takes milliseconds and pages are read on first access;
    * a published version (``"org/name"``, ``revision="v1.0"``): its files downloaded once into
      ``local_dir`` (default ``$HF_HOME/hs_dataset/versions/<org>--<name>/<commit>``) and mapped there;
      opened again, nothing is downloaded; a file damaged on the way is deleted and refused;
    * ``streaming=True``: an ``IterableDataset``; of a build directory (or a version downloaded with
      ``local_dir``), over the same mapped shards, ``num_shards`` shards (default: one per file) for
      DataLoader workers and nodes; of a repo, read over HTTP, each 1 MiB block of a shard checked against
      its recorded hash before a row of it is handed out, nothing written to disk.

    Coded shards (Parquet, zstd Arrow: ``hs_dataset.codec.coding``) have no zero-copy form and go through
    ``load_dataset`` (which converts them into the ``datasets`` cache; ``streaming=True`` decodes them on the fly).

    Args:
        path_or_repo: a build directory, or a dataset repo id (``org/name``).
        revision: the version (tag), branch or commit of a repo (default: ``main``, the newest version).
        streaming: an ``IterableDataset`` instead of a map-style ``Dataset``.
        token: for the Hub (default: ``huggingface_hub``'s own: ``HF_TOKEN``, a stored login).
        local_dir: where a repo's version is downloaded to (and streamed from, with ``streaming=True``).
        num_shards: shards of a local ``streaming=True`` dataset (at least one per DataLoader worker and node).

    Raises:
        NotABuildError: ``path_or_repo`` is not a finished build (no ``hs_dataset.json``), nor a repo id.
        IntegrityError: a recorded shard is missing or of another size or row count, ``data/`` holds a file
            that is not recorded, or a downloaded shard's content hash differs from its record (it is
            deleted: open the version again to download it again); a shard of a format 1 build (no block
            hashes) whose whole hash differs. A block that differs is raised by the reader that reads it.
        HubAccessError: the Hub cannot be reached, refuses the token, or has no such repo or revision.
        OutputWriteError: not enough free disk under ``local_dir`` for the version's files.
        ConfigError: ``revision`` given with a build directory.
    """
    root = Path(path_or_repo)
    if root.is_dir():
        if revision is not None:
            raise ConfigError(f"{root} is a build directory: revision={revision!r} is for a Hub repo (org/name); "
                              "leave it out", field="revision", value=revision)
        return _open_local(root, streaming, num_shards)
    if is_object_url(path_or_repo):  # object storage (s3://, gs://, any fsspec URL): each shard checked as it arrives
        stored = download_object_version(str(path_or_repo), revision=revision, local_dir=local_dir)
        return _open_local(stored.path, streaming, num_shards)
    repo_id = str(path_or_repo)
    if not _is_repo_id(repo_id):
        raise NotABuildError(f"{repo_id}: no such build directory, nor a Hub repo id (org/name): give the OUT of "
                             "`hs-dataset build`, or a published version's repo")
    try:
        if streaming and local_dir is None:
            remote = remote_version(repo_id, revision=revision, token=token)
            remote.listing.raise_if_bad()
            return stream_version(remote.repo_id, remote.commit, remote.meta, token=token)
        version = download_version(repo_id, revision=revision, token=token, local_dir=local_dir)
    except HubAccessError as e:
        if getattr(getattr(e.__cause__, "response", None), "status_code", None) == 404 and revision is None:
            raise HubAccessError(f"{e} (nor is there a build directory {repo_id} here)") from e.__cause__
        raise
    return _open_local(version.path, streaming, num_shards)


def _open_local(root: Path, streaming: bool, num_shards: int | None) -> datasets.Dataset | datasets.IterableDataset:
    meta, shards = _checked_listing(root)
    if not shards:
        raise IntegrityError(f"{root} records no shards (no data/train-*.arrow or data/train-*.parquet): rebuild it")
    coded = (meta.get("config") or {}).get("compression", "none") != "none"
    coded = coded or not shards[0]["name"].endswith(".arrow")
    for s in shards:  # coded (datasets decodes them, not our readers) or format 1: each shard hashed whole, here
        if coded or BLOCKS_KEY not in s:
            check_whole(root / DATA_DIR / s["name"])
    if coded:  # no zero-copy form: decoded by datasets
        return datasets.load_dataset(str(root), split="train", streaming=streaming)
    parts = [datasets.Dataset.from_file(str(root / DATA_DIR / s["name"])) for s in shards]
    wrong = [Problem(f"{DATA_DIR}/{s['name']}", f"holds {len(d)} rows, {s['rows']} recorded")
             for s, d in zip(shards, parts) if len(d) != int(s["rows"])]
    if wrong:
        raise IntegrityError(f"{root}: {'; '.join(map(str, wrong))}. Run `hs-dataset verify {root}`", wrong)
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if not streaming:
        return ds
    return ds.to_iterable_dataset(num_shards=max(1, min(num_shards or len(parts), len(ds))))


def _checked_listing(root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A local build's metadata and shards, once ``data/`` is checked to hold exactly them."""
    meta = read_meta(root)
    problems, rows = check_listing(meta, data_files(root), str(root))
    shards = recorded_shards(meta, str(root))
    VerifyReport(str(root), True, len(shards), rows, problems,
                 repair=f"Refusing to read it: run `hs-dataset verify {root}`, then the build again to repair it."
                 ).raise_if_bad()
    return meta, shards

"""A published version on local disk once: its files downloaded into a folder of their own, where readers map them.

:func:`download_version` resolves a version (tag, branch or commit) to its commit, checks the Hub's listing
against the version's ``hs_dataset.json`` (every recorded shard there at its size, nothing else in ``data/``)
before downloading any shard, then downloads the version's files with ``huggingface_hub``'s own
``snapshot_download`` into ``local_dir`` (real files, laid out as a build is: ``hs_dataset.json``,
``README.md``, ``rejects.jsonl``, ``data/``), so the data exists once on disk: nothing goes into the hub
cache and nothing is converted into the ``datasets`` cache. The default folder is
``$HF_HOME/hs_dataset/versions/<org>--<name>/<commit>``.

Opened again, a file already downloaded for that commit is not fetched again (``huggingface_hub``'s record of
it under ``<folder>/.cache/huggingface/`` names the commit: no request is made for it); a download killed
midway resumes at the files it had not finished (the file it was writing starts over; the partial copy
it left is removed by the next download). Every shard fetched is hashed as soon as it is on disk (whole and
per block, :func:`~hs_dataset.integrity.checksums.check_shard`); a damaged one is deleted and refused, so that
the next call downloads it again. ``verify_repo`` (:mod:`hs_dataset.hub.verify_remote`) and
:func:`~hs_dataset.read.open_dataset` share this folder: a version verified and then opened is on disk once.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants as hconst
from huggingface_hub import HfApi
from huggingface_hub.errors import EntryNotFoundError

from hs_dataset.errors import IntegrityError, NotABuildError, OutputWriteError
from hs_dataset.hub.access import hub_call
from hs_dataset.hub.versions import REPO_TYPE, remote_files
from hs_dataset.integrity.checksums import check_shard
from hs_dataset.integrity.metadata import REJECTS_HASH_KEY
from hs_dataset.integrity.verify import Problem, VerifyReport, check_listing, read_meta, recorded_shards
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, REJECTS_FILE

__all__ = ["LocalVersion", "RemoteVersion", "default_version_dir", "download_version", "remote_version"]

# what a version's reader needs; anything else a repo holds (a .gitattributes, files added by hand) stays on the Hub
VERSION_FILES = [META_FILE, README_FILE, REJECTS_FILE, f"{DATA_DIR}/*"]
# a partial download untouched this long belongs to no running download (one being written changes every second)
STALE_PARTIAL_S = 600


@dataclass(frozen=True)
class LocalVersion:
    """A version downloaded: ``path`` holds its files; ``fetched`` the files this call downloaded (relative paths).

    Attributes:
        repo_id: the dataset repository.
        revision: the revision asked for (``main`` when none was).
        commit: the commit it resolved to.
        path: the folder holding the version's files.
        fetched: the files downloaded by this call, relative to ``path``.
    """

    repo_id: str
    revision: str
    commit: str
    path: Path
    fetched: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.repo_id}@{self.revision} ({self.commit})"


def default_version_dir(repo_id: str, commit: str) -> Path:
    """``$HF_HOME/hs_dataset/versions/<org>--<name>/<commit>``: one folder per commit (a version's files never change)."""
    return Path(hconst.HF_HOME) / "hs_dataset" / "versions" / repo_id.replace("/", "--") / commit


@dataclass(frozen=True)
class RemoteVersion:
    """A version resolved on the Hub, its ``hs_dataset.json`` fetched into ``folder`` and its listing compared.

    Attributes:
        repo_id, revision, commit: the repository, the revision asked for (``main`` when none was), its commit.
        folder: where the version's files are (or go): ``hs_dataset.json`` is there already.
        meta: that ``hs_dataset.json``.
        listing: the Hub's ``data/`` files against it (``ok``: every recorded shard there at its size, no other).
    """

    repo_id: str
    revision: str
    commit: str
    folder: Path
    meta: dict
    listing: VerifyReport

    @property
    def where(self) -> str:
        return f"{self.repo_id}@{self.revision} ({self.commit})"


@hub_call
def remote_version(repo_id: str, *, revision: str | None = None, token: str | None = None,
                   endpoint: str | None = None, local_dir: str | os.PathLike | None = None) -> RemoteVersion:
    """Resolve a version, fetch its ``hs_dataset.json`` (into ``local_dir``, default :func:`default_version_dir`)
    and compare the Hub's listing with it; no shard is fetched.

    Raises:
        HubAccessError: not a repo id, or the Hub cannot be reached or refuses (one line each, with the fix).
        NotABuildError: the revision holds no ``hs_dataset.json``.
    """
    api = HfApi(endpoint=endpoint, token=token)
    commit = api.dataset_info(repo_id, revision=revision).sha
    assert commit is not None, "the Hub answered a dataset's info without its commit"
    folder = Path(local_dir) if local_dir is not None else default_version_dir(repo_id, commit)
    where = f"{repo_id}@{revision or 'main'} ({commit})"
    if not _complete_here(folder, commit):  # else its hs_dataset.json is there: no write (a read-only cache)
        try:
            api.hf_hub_download(repo_id, META_FILE, repo_type=REPO_TYPE, revision=commit, local_dir=folder)
        except EntryNotFoundError:
            raise NotABuildError(f"{where} holds no {META_FILE}: not an hs_dataset version") from None
        except OSError as e:
            raise _write_error(e, where, folder) from None
    meta = read_meta(folder)
    prefix = DATA_DIR + "/"
    present = {p[len(prefix):]: int(f.size) for p, f in remote_files(api, repo_id, commit).items()
               if p.startswith(prefix)}
    problems, rows = check_listing(meta, present, where)
    listing = VerifyReport(where, True, len(recorded_shards(meta, where)), rows, problems, commit=commit,
                           repair=f"Nothing of it was downloaded. The published files differ from their {META_FILE}: "
                                  "the publisher rebuilds the named parts and pushes the version again with --force.")
    return RemoteVersion(repo_id, revision or "main", commit, folder, meta, listing)


@hub_call
def download_version(repo_id: str, *, revision: str | None = None, token: str | None = None,
                     endpoint: str | None = None, local_dir: str | os.PathLike | None = None) -> LocalVersion:
    """Download a published version's files once into a folder (see the module), checked against its listing first.

    Args:
        repo_id: the dataset repository (``org/name``).
        revision: the version (tag), branch or commit (default: ``main``).
        token, endpoint: for the Hub (default: ``huggingface_hub``'s own, ``HF_ENDPOINT``).
        local_dir: the folder to hold the files (default: :func:`default_version_dir`).

    Returns:
        The folder, the commit, and the files this call downloaded.

    Raises:
        HubAccessError: not a repo id, or the Hub cannot be reached or refuses (one line each, with the fix).
        NotABuildError: the revision holds no ``hs_dataset.json``.
        IntegrityError: the Hub's files differ from what the version's ``hs_dataset.json`` records
            (nothing of the shards is downloaded then), or a shard downloaded differs from its hashes (it is
            deleted: call again to download it again).
        OutputWriteError: the disk under the folder has too little space left for the files still to fetch.
    """
    remote = remote_version(repo_id, revision=revision, token=token, endpoint=endpoint, local_dir=local_dir)
    folder = remote.folder
    if _complete_here(folder, remote.commit):  # nothing to fetch: no write either (a read-only cache opens)
        return LocalVersion(repo_id, revision or "main", remote.commit, folder, ())
    remote.listing.raise_if_bad()
    try:
        _remove_stale_partials(folder)
        _check_space(folder, remote.meta)
        before = _file_states(folder)
        HfApi(endpoint=endpoint, token=token).snapshot_download(repo_id, repo_type=REPO_TYPE, revision=remote.commit,
                                                                local_dir=folder, allow_patterns=VERSION_FILES)
    except OSError as e:
        raise _write_error(e, remote.where, folder) from None
    after = _file_states(folder)
    fetched = tuple(sorted(p for p, state in after.items() if before.get(p) != state))
    version = LocalVersion(repo_id, revision or "main", remote.commit, folder, fetched)
    _check_fetched(version, remote.meta)
    return version


def _check_fetched(version: LocalVersion, meta: dict) -> None:
    """Hash every shard this download fetched; a damaged one is deleted, so that the next call fetches it again."""
    entries = {f"{DATA_DIR}/{s['name']}": s for s in recorded_shards(meta, str(version.path))}
    for rel in version.fetched:
        if rel not in entries:
            continue
        why = check_shard(version.path / rel, entries[rel], quick=False)
        if why is not None:
            (version.path / rel).unlink(missing_ok=True)
            raise IntegrityError(f"{version.where}: {rel} as downloaded differs from the hashes its {META_FILE} "
                                 f"records ({why}; damaged on the Hub or on the way): deleted it, open the version "
                                 "again to download it again; if it is refused again, the published file is damaged "
                                 f"(`hs-dataset verify {version.repo_id} --revision {version.revision}` names it) "
                                 "and the version must be pushed again", [Problem(rel, "content hash differs")])


# what a download into a read-only, full or foreign folder raises: one line naming the folder, not a traceback
_WRITE_ERRORS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _write_error(e: OSError, where: str, folder: Path) -> OSError:
    """A download's failure to write as one line naming the folder (``OutputWriteError``); other errors as they are."""
    if isinstance(e, OutputWriteError) or e.errno not in _WRITE_ERRORS:
        return e
    return OutputWriteError(e.errno, f"cannot download {where} into {folder}: {e.strerror or e} "
                                     f"({e.filename or folder}); set HF_HOME to a writable folder with room, or pass "
                                     "local_dir= one", path=str(folder))


def _complete_here(folder: Path, commit: str) -> bool:
    """Whether ``folder`` holds every file of the version at ``commit`` already (huggingface_hub's record of each
    names that commit; every recorded shard at its size): then opening it needs neither a request nor a write."""
    try:
        meta = read_meta(folder)
    except (OSError, NotABuildError, ValueError):
        return False
    names = [META_FILE, README_FILE] + [f"{DATA_DIR}/{s['name']}" for s in recorded_shards(meta, "")]
    if REJECTS_HASH_KEY in meta:  # a version written before rejects were hashed may have no rejects.jsonl
        names.append(REJECTS_FILE)
    record = folder / ".cache" / "huggingface" / "download"
    for name in names:
        try:
            noted = (record / f"{name}.metadata").read_text(encoding="utf-8").splitlines()
        except OSError:
            return False
        if not noted or noted[0].strip() != commit or not (folder / name).is_file():
            return False
    return all((folder / DATA_DIR / s["name"]).stat().st_size == int(s["bytes"]) for s in recorded_shards(meta, ""))


def _file_states(folder: Path) -> dict[str, tuple[int, int, int]]:
    """``{path: (inode, size, mtime_ns)}`` of the version's files in ``folder`` (a file downloaded anew changes it)."""
    out = {}
    for name in (META_FILE, README_FILE, REJECTS_FILE):
        if (folder / name).is_file():
            st = (folder / name).stat()
            out[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    data = folder / DATA_DIR
    if data.is_dir():
        for p in data.rglob("*"):
            if p.is_file():
                st = p.stat()
                out[p.relative_to(folder).as_posix()] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _remove_stale_partials(folder: Path) -> None:
    """Remove the partial files a killed download left (``huggingface_hub`` names them ``*.incomplete``)."""
    cache = folder / ".cache" / "huggingface"
    if not cache.is_dir():
        return
    now = time.time()
    for p in cache.rglob("*.incomplete"):
        try:
            if now - p.stat().st_mtime > STALE_PARTIAL_S:
                p.unlink()
        except OSError:
            pass


def _check_space(folder: Path, meta: dict) -> None:
    """Refuse to start a download the disk cannot hold (``huggingface_hub`` only warns, then fails midway)."""
    missing = 0
    for s in recorded_shards(meta, str(folder)):
        p = folder / DATA_DIR / s["name"]
        if not (p.is_file() and p.stat().st_size == int(s["bytes"])):
            missing += int(s["bytes"])
    free = shutil.disk_usage(folder).free
    if missing > free:
        raise OutputWriteError(28, f"cannot download into {folder}: the version's shards still to fetch take "
                                   f"{missing / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free there; pass local_dir= "
                                   "a folder on a larger disk", path=str(folder))


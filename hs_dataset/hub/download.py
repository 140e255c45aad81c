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
it left is removed by the next download). What was fetched is returned, so that the reader checks those
files' content hashes at once (:mod:`hs_dataset.read.open`).
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
from huggingface_hub.errors import EntryNotFoundError, HFValidationError

from hs_dataset.errors import HubAccessError, NotABuildError, OutputWriteError
from hs_dataset.hub.access import hub_errors
from hs_dataset.hub.versions import REPO_TYPE, remote_files
from hs_dataset.integrity.metadata import REJECTS_HASH_KEY
from hs_dataset.integrity.verify import VerifyReport, check_listing, read_meta, recorded_shards
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, REJECTS_FILE

__all__ = ["LocalVersion", "default_version_dir", "download_version"]

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
            (nothing of the shards is downloaded then).
        OutputWriteError: the disk under the folder has too little space left for the files still to fetch.
    """
    api = HfApi(endpoint=endpoint, token=token)
    with hub_errors(endpoint, repo_id):
        try:
            commit = api.dataset_info(repo_id, revision=revision).sha
        except HFValidationError as e:
            raise HubAccessError(f"{repo_id!r} is not a Hub repo id ({str(e).splitlines()[0]}): give `org/name`, or "
                                 "the path of a build directory") from None
        assert commit is not None, "the Hub answered a dataset's info without its commit"
        folder = Path(local_dir) if local_dir is not None else default_version_dir(repo_id, commit)
        where = f"{repo_id}@{revision or 'main'} ({commit})"
        if _complete_here(folder, commit):  # nothing to fetch: no write either (a read-only cache opens)
            return LocalVersion(repo_id, revision or "main", commit, folder, ())
        try:
            try:
                api.hf_hub_download(repo_id, META_FILE, repo_type=REPO_TYPE, revision=commit, local_dir=folder)
            except EntryNotFoundError:
                raise NotABuildError(f"{where} holds no {META_FILE}: not an hs_dataset version") from None
            meta = read_meta(folder)
            _check_remote_listing(api, repo_id, commit, meta, where)
            _remove_stale_partials(folder)
            _check_space(folder, meta)
            before = _file_states(folder)
            api.snapshot_download(repo_id, repo_type=REPO_TYPE, revision=commit, local_dir=folder,
                                  allow_patterns=VERSION_FILES)
        except OSError as e:
            if isinstance(e, OutputWriteError) or e.errno not in _WRITE_ERRORS:
                raise
            raise OutputWriteError(e.errno, f"cannot download {where} into {folder}: {e.strerror or e} "
                                            f"({e.filename or folder}); set HF_HOME to a writable folder with room, or "
                                            "pass local_dir= one", path=str(folder)) from None
    after = _file_states(folder)
    fetched = tuple(sorted(p for p, state in after.items() if before.get(p) != state))
    return LocalVersion(repo_id, revision or "main", commit, folder, fetched)


# what a download into a read-only, full or foreign folder raises: one line naming the folder, not a traceback
_WRITE_ERRORS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


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


def _check_remote_listing(api: HfApi, repo_id: str, commit: str, meta: dict, where: str) -> None:
    """The Hub's ``data/`` files (names, sizes) against the recorded shards, before a byte of them is fetched."""
    prefix = DATA_DIR + "/"
    present = {p[len(prefix):]: int(f.size) for p, f in remote_files(api, repo_id, commit).items()
               if p.startswith(prefix)}
    problems, rows = check_listing(meta, present, where)
    VerifyReport(where, True, len(recorded_shards(meta, where)), rows, problems,
                 repair=f"Nothing of it was downloaded. The published files differ from their {META_FILE}: the "
                        "publisher rebuilds the named parts and pushes the version again with --force."
                 ).raise_if_bad()


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


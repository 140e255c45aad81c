"""What a push uploads: a finished build's files, their hashes, and the checks made before anything is sent.

:func:`read_build` checks the folder is a finished build; :func:`local_files` reads every file once
for its sha256 (LFS), git blob id (regular files) and xxh3-128 (the build's own record);
:func:`refuse_unverified` compares them with ``hs_dataset.json`` (:mod:`hs_dataset.integrity.verify`);
:func:`check_folder_sizes` applies the Hub's per-folder limit.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import xxhash
from huggingface_hub.hf_api import RepoFile

from hs_dataset.errors import IntegrityError, NotABuildError, PublishError
from hs_dataset.integrity.metadata import HUB_ATTRIBUTES, UNPUBLISHED_DIRS
from hs_dataset.integrity.verify import read_meta, verify_build
from hs_dataset.layout import DATA_DIR, README_FILE

__all__ = ["MAX_FILES_PER_FOLDER", "REGULAR_MAX_SIZE", "LocalFile", "check_folder_sizes",
           "local_files", "read_build", "refuse_unverified"]

REGULAR_MAX_SIZE = 10 * 1024 * 1024  # the Hub stores anything >= 10 MiB with LFS
MAX_FILES_PER_FOLDER = 10_000  # Hub limit


def hash_file(path: Path, size: int) -> tuple[str, str | None, str]:
    """(sha256, git blob sha1 or None for files that can only be LFS, xxh3-128) in one read."""
    sha256 = hashlib.sha256()
    xxh = xxhash.xxh3_128()
    git = None
    if size < REGULAR_MAX_SIZE:
        git = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            xxh.update(chunk)
            if git is not None:
                git.update(chunk)
    return sha256.hexdigest(), git.hexdigest() if git is not None else None, xxh.hexdigest()


@dataclass
class LocalFile:
    rel: str
    path: Path
    size: int
    sha256: str
    git_oid: str | None
    xxh3_128: str = ""

    def same_as(self, remote: RepoFile | None) -> bool:
        if remote is None or remote.size != self.size:
            return False
        if remote.lfs is not None:
            return remote.lfs.sha256 == self.sha256
        return self.git_oid is not None and remote.blob_id == self.git_oid


def read_build(local_dir: str | os.PathLike) -> tuple[Path, dict, str]:
    """Check ``local_dir`` is a finished build -> (path, hs_dataset.json content, README text)."""
    root = Path(local_dir)
    if not root.is_dir():
        what = "is a file, not a build directory" if root.exists() else "no such build directory"
        raise NotABuildError(f"{root}: {what}: check the path (push the output directory of a finished build)")
    metadata = read_meta(root)
    if not (root / README_FILE).is_file():
        raise NotABuildError(f"{root} is not a finished hs_dataset build: no {README_FILE} (run or resume the build "
                             "until it completes before publishing)")
    data_dir = root / DATA_DIR
    if not data_dir.is_dir() or not any(p.is_file() for p in data_dir.rglob("*")):
        raise NotABuildError(f"{root} is not a finished hs_dataset build: no data files under data/")
    return root, metadata, (root / README_FILE).read_text(encoding="utf-8")


def local_files(root: Path) -> dict[str, LocalFile]:
    files: dict[str, LocalFile] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in UNPUBLISHED_DIRS]
        dirnames[:] = [d for d in dirnames if d not in (".git", ".cache")]
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() and not path.exists():
                continue
            rel = (rel_dir / name).as_posix()
            if rel in (README_FILE, HUB_ATTRIBUTES):
                continue  # the card is re-rendered in the final commit; .gitattributes is the Hub's
            size = path.stat().st_size
            sha256, git_oid, xxh = hash_file(path, size)
            files[rel] = LocalFile(rel, path, size, sha256, git_oid, xxh)
    return files


def check_folder_sizes(files: Iterable[str]) -> None:
    per_folder: dict[str, int] = {}
    for rel in files:
        folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
        per_folder[folder] = per_folder.get(folder, 0) + 1
    crowded = {f or "/": n for f, n in per_folder.items() if n > MAX_FILES_PER_FOLDER}
    if crowded:
        raise PublishError(f"the Hub allows at most {MAX_FILES_PER_FOLDER} files per folder; this build has {crowded}: "
                           "rebuild with larger shards")


def refuse_unverified(root: Path, local: dict[str, LocalFile] | None) -> None:
    """Refuse a build whose files differ from its ``hs_dataset.json``. ``local=None``: the quick check
    (before hashing anything); else the full check, reusing the hashes of push's own read."""
    digests = None if local is None else {rel: f.xxh3_128 for rel, f in local.items()}
    report = verify_build(root, quick=local is None, digests=digests)
    if not report.ok:
        raise IntegrityError(f"refusing to push: {report.message()} Then push again.", report.problems)

"""Versions in object storage (``s3://``, ``gs://``, any fsspec URL): where they are, and reading them checked.

A store at ``URL`` holds each version as the Hub does (the same files, checksums and card), under a
folder of its own, and a small pointer per version, written last by a push
(:mod:`hs_dataset.hub.object_push`)::

    URL/versions/<version>/hs_dataset.json, README.md, rejects.jsonl, data/train-*.arrow
    URL/refs/<version>.json     {"version", "id", "pushed_at", "files": {path: bytes}}

A version exists only once its pointer does: a push killed midway leaves files under ``versions/`` that
no reader sees. ``id`` is the xxh3-128 of the version's ``hs_dataset.json`` (which records every shard's
hash): the role a commit plays on the Hub. Credentials come from fsspec's usual places (the AWS / Google
environment and config files, or ``storage_options``); none is ever written into the store or a card.

:func:`fetch_file` copies one file here and, for a shard, checks its size and content hash against the
version's ``hs_dataset.json`` as it arrives (a damaged copy is deleted and refused, naming the shard);
:func:`download_object_version` does that for a whole version (what ``open_dataset(URL, revision=...)``
reads); :func:`verify_object_version` is ``hs-dataset verify URL``; :func:`list_object_versions` is
``hs-dataset versions URL``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import huggingface_hub.constants as hconst
import xxhash

from hs_dataset.errors import HubAccessError, IntegrityError, NotABuildError
from hs_dataset.hub.download import LocalVersion
from hs_dataset.hub.versions import VersionInfo, version_key
from hs_dataset.integrity.checksums import HASH_KEY, check_shard
from hs_dataset.integrity.verify import Problem, VerifyReport, check_listing, recorded_shards
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, REJECTS_FILE

__all__ = ["REFS_DIR", "VERSIONS_DIR", "ObjectStore", "download_object_version", "fetch_file", "is_object_url",
           "list_object_versions", "meta_id", "open_store", "verify_object_version"]

VERSIONS_DIR = "versions"
REFS_DIR = "refs"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_object_url(name: str | os.PathLike) -> bool:
    """Whether ``name`` is an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``file:///...``), not a path or a repo id."""
    return bool(_URL.match(os.fspath(name)))


def meta_id(meta_bytes: bytes) -> str:
    """A version's id: the xxh3-128 of its ``hs_dataset.json`` (which holds every shard's hash)."""
    return xxhash.xxh3_128(meta_bytes).hexdigest()


@dataclass
class ObjectStore:
    """A store of versions at ``url`` (see the module).

    Attributes:
        url: the store, as given (``s3://bucket/prefix``).
        fs: its fsspec filesystem.
        root: the store's path on ``fs`` (no protocol).
    """

    url: str
    fs: Any
    root: str
    refs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def version_path(self, version: str, rel: str = "") -> str:
        return self.path(VERSIONS_DIR, version, rel) if rel else self.path(VERSIONS_DIR, version)

    def ref(self, version: str) -> dict[str, Any] | None:
        """The pointer of ``version`` (None: there is no such version)."""
        try:
            with self.fs.open(self.path(REFS_DIR, f"{version}.json"), "rb") as f:
                return dict(json.loads(f.read()))
        except FileNotFoundError:
            return None

    def versions(self) -> list[str]:
        """The versions with a pointer, oldest first (:func:`~hs_dataset.hub.versions.version_key`)."""
        self.fs.invalidate_cache()  # another process may have pushed since this filesystem listed
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.path(REFS_DIR), detail=False)]
        except FileNotFoundError:
            return []
        return sorted((n[:-5] for n in names if n.endswith(".json")), key=version_key)

    def resolve(self, revision: str | None) -> tuple[str, dict[str, Any]]:
        """``(version, pointer)`` of ``revision`` (None: the newest version).

        Raises:
            HubAccessError: the store has no such version (or none at all).
        """
        if revision is None:
            names = self.versions()
            if not names:
                raise HubAccessError(f"{self.url}: no versions (push one: hs-dataset push DIR {self.url} --version v1.0)")
            revision = names[-1]
        ref = self.ref(revision)
        if ref is None:
            raise HubAccessError(f"{self.url}: no such version {revision!r}: `hs-dataset versions {self.url}` lists them")
        return revision, ref

    def read_meta(self, version: str, ref: dict[str, Any]) -> dict[str, Any]:
        """The version's ``hs_dataset.json``, checked against its pointer's id."""
        where = f"{self.url}@{version}"
        try:
            with self.fs.open(self.version_path(version, META_FILE), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise NotABuildError(f"{where} holds no {META_FILE}: not an hs_dataset version") from None
        if meta_id(raw) != ref.get("id"):
            raise IntegrityError(f"{where}: its {META_FILE} differs from the one its pointer records (changed after the "
                                 "push): push the version again under a new name",
                                 [Problem(META_FILE, "content hash differs from the version's id")])
        return dict(json.loads(raw))


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    """The store at ``url`` (credentials: fsspec's usual places, or ``storage_options``).

    Raises:
        HubAccessError: fsspec has no filesystem for the URL's protocol (the message names the package).
    """
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise HubAccessError(f"cannot open {url}: {e} (s3:// needs `pip install s3fs`, gs:// `pip install gcsfs`)") from e
    return ObjectStore(url.rstrip("/"), fs, str(root))


def fetch_file(store: ObjectStore, version: str, rel: str, dest: Path, entry: dict[str, Any] | None) -> int:
    """Copy ``rel`` of ``version`` to ``dest``; a shard (``entry``: its record) is checked as it arrives.

    The copy goes to a temporary name beside ``dest`` and takes its name only once checked, so ``dest``
    never holds a partial or unverified file. Returns the bytes fetched.

    Raises:
        IntegrityError: the copy's size or content hash differs from ``entry`` (deleted; names the shard).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".part-{os.getpid()}-{dest.name}")  # the suffix kept: it says the format
    try:
        store.fs.get_file(store.version_path(version, rel), str(part))
        size = part.stat().st_size
        if entry is not None:
            why = check_shard(part, entry, quick=False)
            if why is not None:
                raise IntegrityError(f"{store.url}@{version}: {rel} as fetched {why} (damaged in the store or on the "
                                     f"way): refused, nothing of it kept. `hs-dataset verify {store.url} --revision "
                                     f"{version}` names every damaged shard; push the version again under a new name",
                                     [Problem(rel, why)])
        os.replace(part, dest)
        return size
    finally:
        part.unlink(missing_ok=True)


def default_object_dir(store: ObjectStore, version: str, vid: str) -> Path:
    """``$HF_HOME/hs_dataset/versions/<url as a name>/<version>-<id>``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "--", store.url)
    return Path(hconst.HF_HOME) / "hs_dataset" / "versions" / name / f"{version}-{vid[:12]}"


def download_object_version(url: str, *, revision: str | None = None, local_dir: str | os.PathLike | None = None,
                            storage_options: dict[str, Any] | None = None) -> LocalVersion:
    """Download a version from object storage once into a folder, every shard checked as it arrives.

    Args:
        url: the store (``s3://bucket/prefix``).
        revision: the version (default: the newest).
        local_dir: the folder (default: under ``$HF_HOME/hs_dataset/versions``); files already there at their
            recorded size are not fetched again.
        storage_options: passed to fsspec (default: its usual credentials).

    Returns:
        The folder, laid out as a build (``fetched`` is empty: every fetched shard was checked already).

    Raises:
        HubAccessError: no such version. IntegrityError: a shard arrived damaged, or the listing differs
            from ``hs_dataset.json``.
    """
    store = open_store(url, storage_options)
    version, ref = store.resolve(revision)
    meta = store.read_meta(version, ref)
    _check_store_listing(store, version, meta)
    folder = Path(local_dir) if local_dir is not None else default_object_dir(store, version, str(ref["id"]))
    entries = {f"{DATA_DIR}/{s['name']}": s for s in recorded_shards(meta, url)}
    for stale in (folder / DATA_DIR).glob(".part-*") if (folder / DATA_DIR).is_dir() else ():
        stale.unlink(missing_ok=True)  # a copy a killed download left (it would read as a file not recorded)
    for rel in [*entries, REJECTS_FILE, README_FILE, META_FILE]:  # the metadata last: it marks a finished copy
        dest = folder / rel
        if rel in entries and dest.is_file() and dest.stat().st_size == int(entries[rel]["bytes"]):
            continue
        if rel in entries or store.fs.exists(store.version_path(version, rel)):
            fetch_file(store, version, rel, dest, entries.get(rel))
    return LocalVersion(store.url, version, str(ref["id"]), folder, ())


def _check_store_listing(store: ObjectStore, version: str, meta: dict[str, Any]) -> tuple[list[Problem], int]:
    where = f"{store.url}@{version}"
    base = store.version_path(version, DATA_DIR)
    store.fs.invalidate_cache()
    try:
        listing = store.fs.find(base, detail=True)
    except FileNotFoundError:
        listing = {}
    present = {p[len(base) + 1:]: int(info["size"]) for p, info in listing.items()}
    problems, rows = check_listing(meta, present, where)
    VerifyReport(where, True, len(recorded_shards(meta, where)), rows, problems,
                 repair="Nothing of it was fetched. The stored files differ from their hs_dataset.json: push the "
                        "build again under a new version name.").raise_if_bad()
    return problems, rows


def verify_object_version(url: str, *, revision: str | None = None, quick: bool = False,
                          storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """``hs-dataset verify URL``: the listing against ``hs_dataset.json`` (``quick``), else every shard's content hash.

    Args:
        url: the store. revision: the version (default: the newest). quick: names and sizes only.
        storage_options: passed to fsspec.

    Raises:
        HubAccessError: no such version. NotABuildError: the version holds no ``hs_dataset.json``.
    """
    store = open_store(url, storage_options)
    version, ref = store.resolve(revision)
    meta = store.read_meta(version, ref)
    where = f"{store.url}@{version}"
    shards = recorded_shards(meta, where)
    try:
        problems, rows = _check_store_listing(store, version, meta)
    except IntegrityError as e:
        return VerifyReport(where, True, len(shards), 0, list(e.problems or []), commit=str(ref["id"]),
                            repair="push the build again under a new version name")
    if not quick:
        for s in shards:
            rel = f"{DATA_DIR}/{s['name']}"
            with store.fs.open(store.version_path(version, rel), "rb") as f:
                h = xxhash.xxh3_128()
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            if h.hexdigest() != s[HASH_KEY]:
                problems.append(Problem(rel, f"its content hash differs from the recorded {HASH_KEY}"))
    return VerifyReport(where, quick, len(shards), rows, problems, commit=str(ref["id"]),
                        repair="The stored files differ from their hs_dataset.json: push the build again under a new "
                               "version name (a version is never changed in place).")


def list_object_versions(url: str, *, storage_options: dict[str, Any] | None = None) -> list[VersionInfo]:
    """The versions in the store at ``url``, oldest first, with counts from their ``hs_dataset.json``.

    Args:
        url: the store. storage_options: passed to fsspec.

    Raises:
        HubAccessError: fsspec cannot open the URL.
    """
    store = open_store(url, storage_options)
    out = []
    for version in store.versions():
        ref = store.ref(version) or {}
        try:
            meta: dict[str, Any] | None = store.read_meta(version, ref)
        except (NotABuildError, IntegrityError, ValueError):
            meta = None
        counts = (meta or {}).get("counts") or {}
        out.append(VersionInfo(version=version, commit_sha=str(ref.get("id", "")), samples=counts.get("written"),
                               tokens=counts.get("tokens_written"), rejected=counts.get("rejected"), metadata=meta,
                               bytes=(meta or {}).get("bytes"), pushed_at=ref.get("pushed_at")))
    return out


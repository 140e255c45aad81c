"""Push a finished build as an immutable version into object storage (``hs-dataset push DIR s3://bucket/prefix``).

The store's layout is :mod:`hs_dataset.hub.objects`'. How a push proceeds (:func:`push_objects`):

0. the build is verified in full (every shard's size, rows and content hash; nothing unlisted) and its
   files are checked to hold no credential, as a push to the Hub does (:mod:`hs_dataset.hub.uploads`);
1. an existing pointer ``refs/<version>.json``: on this build's ``hs_dataset.json`` the push is done
   already (``already_there``); on another, refused: a version in a store never changes (push a new name);
2. ``hs_dataset.json`` is written first under ``versions/<version>/`` (it says which build the folder
   holds), then the shards, ``rejects.jsonl`` and the card (:func:`hs_dataset.write.card.render_card`, as on
   the Hub). A push run again after a kill skips the files already there at their size when the folder
   holds this build's ``hs_dataset.json`` (an object store shows an object only once it is whole; a local
   ``file://`` store is written through a temporary name); otherwise every file is written again;
3. the folder's listing is checked against ``hs_dataset.json`` (names and sizes);
4. only then the pointer is written. A push killed before it leaves no version that reads.

Credentials come from fsspec's usual places (the AWS / Google environment and config files) or
``storage_options``; they are never written into the store, the card or the pointer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from hs_dataset.errors import VersionExistsError
from hs_dataset.hub.names import check_version_name
from hs_dataset.hub.objects import REFS_DIR, ObjectStore, meta_id, open_store
from hs_dataset.hub.uploads import REGULAR_MAX_SIZE, local_files, read_build, refuse_unverified
from hs_dataset.hub.versions import utc_now
from hs_dataset.integrity.verify import VerifyReport, check_listing, recorded_shards
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, STATE_DIR
from hs_dataset.redact import check_uploads
from hs_dataset.write.card import render_card

__all__ = ["CREDENTIAL_ENV", "ObjectPushResult", "push_objects"]

# the stores' secrets in the environment: no file pushed may hold their values (nor the card)
CREDENTIAL_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN")


@dataclass
class ObjectPushResult:
    """What :func:`push_objects` did.

    Attributes:
        url: the store. version: the version pushed. id: its id (the xxh3-128 of its ``hs_dataset.json``).
        uploaded: files written by this run. skipped: files already there (a resumed push).
        already_there: the version existed on exactly this build: nothing was written.
    """

    url: str
    version: str
    id: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    already_there: bool = False


def push_objects(local_dir: str | os.PathLike, url: str, version: str, *, build_command: str | None = None,
                 secrets: Iterable[str] = (), storage_options: dict[str, Any] | None = None) -> ObjectPushResult:
    """Publish the build in ``local_dir`` as ``version`` of the store at ``url`` (see the module).

    Args:
        local_dir: a finished build directory.
        url: the store (``s3://bucket/prefix``, ``gs://...``, any fsspec URL).
        version: the version name, e.g. ``v1.0``.
        build_command: recorded in the card (default: the build's own, redacted).
        secrets: credential values that no uploaded file may contain (besides what the build redacted).
        storage_options: passed to fsspec (default: its usual credentials).

    Returns:
        What the push did.

    Raises:
        VersionNameError: ``version`` cannot be a version name.
        NotABuildError: ``local_dir`` is not a finished build.
        IntegrityError: its files differ from its ``hs_dataset.json``, or the store's copy does after the upload.
        SecretLeakError: a file holds a credential.
        VersionExistsError: the version exists on another build (versions in a store never change).
    """
    check_version_name(version)
    root, metadata, build_readme = read_build(local_dir)
    refuse_unverified(root, None)
    local = local_files(root)
    refuse_unverified(root, local)
    known = [os.environ.get(k) or "" for k in CREDENTIAL_ENV]
    known += [str(v) for k, v in (storage_options or {}).items() if any(w in k.lower() for w in ("secret", "token"))]
    check_uploads([(f.rel, f.path, f.size) for f in local.values()], None, root / STATE_DIR, [*secrets, *known],
                  max_bytes=REGULAR_MAX_SIZE)
    raw_meta = (root / META_FILE).read_bytes()
    vid = meta_id(raw_meta)
    store = open_store(url, storage_options)
    result = ObjectPushResult(store.url, version, vid)
    ref = store.ref(version)
    if ref is not None:
        if ref.get("id") == vid:
            result.already_there = True
            return result
        raise VersionExistsError(f"{store.url} has a version {version} of another build (id {str(ref.get('id'))[:12]}, "
                                 f"this build's is {vid[:12]}): versions in a store never change; push this build "
                                 "under a new version name")
    same_build = _remote_bytes(store, version, META_FILE) == raw_meta
    _put(store, version, META_FILE, root / META_FILE, result)
    data = sorted(rel for rel in local if rel.startswith(DATA_DIR + "/"))
    rest = sorted(rel for rel in local if rel not in data and rel != META_FILE)
    sizes = _remote_sizes(store, version) if same_build else {}
    for rel in data + rest:
        if sizes.get(rel) == local[rel].size:
            result.skipped.append(rel)
            continue
        _put(store, version, rel, local[rel].path, result)
    card = render_card(metadata, {"readme": build_readme, "repo_id": store.url, "version": version,
                                  "pushed_at": utc_now(), "build_command": str(build_command or
                                                                                metadata.get("build_command") or "n/a"),
                                  "history": _history(store, version), "tags": {}})
    _put_bytes(store, version, README_FILE, card.encode("utf-8"))
    result.uploaded.append(README_FILE)
    _check_uploaded(store, version, metadata)
    files = {rel: f.size for rel, f in local.items()}
    pointer = {"version": version, "id": vid, "pushed_at": utc_now(), "files": files}
    _write(store, store.path(REFS_DIR, f"{version}.json"), json.dumps(pointer, indent=1).encode("utf-8"))
    return result


def _remote_bytes(store: ObjectStore, version: str, rel: str) -> bytes | None:
    try:
        with store.fs.open(store.version_path(version, rel), "rb") as f:
            return bytes(f.read())
    except FileNotFoundError:
        return None


def _remote_sizes(store: ObjectStore, version: str) -> dict[str, int]:
    base = store.version_path(version)
    store.fs.invalidate_cache()  # listed before this push wrote
    try:
        found = store.fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    return {p[len(base) + 1:]: int(info["size"]) for p, info in found.items()}


def _write(store: ObjectStore, path: str, data: bytes) -> None:
    """One object, whole or not at all (an object store's put is; a local store goes through a temporary name)."""
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    if _is_local(store):
        tmp = f"{path}.{os.getpid()}.part"
        store.fs.pipe_file(tmp, data)
        store.fs.mv(tmp, path)
    else:
        store.fs.pipe_file(path, data)


def _put_bytes(store: ObjectStore, version: str, rel: str, data: bytes) -> None:
    _write(store, store.version_path(version, rel), data)


def _put(store: ObjectStore, version: str, rel: str, path: Path, result: ObjectPushResult) -> None:
    target = store.version_path(version, rel)
    store.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    if _is_local(store):
        tmp = f"{target}.{os.getpid()}.part"
        store.fs.put_file(str(path), tmp)
        store.fs.mv(tmp, target)
    else:
        store.fs.put_file(str(path), target)
    result.uploaded.append(rel)


def _is_local(store: ObjectStore) -> bool:
    protocol = store.fs.protocol
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def _check_uploaded(store: ObjectStore, version: str, meta: dict[str, Any]) -> None:
    """Step 3: the store's ``data/`` against the recorded shards, before the pointer is written."""
    prefix = DATA_DIR + "/"
    present = {rel[len(prefix):]: size for rel, size in _remote_sizes(store, version).items() if rel.startswith(prefix)}
    where = f"{store.url}@{version}"
    problems, rows = check_listing(meta, present, where)
    VerifyReport(where, True, len(recorded_shards(meta, where)), rows, problems,
                 repair="The version was not published (no pointer written): push it again.").raise_if_bad()


def _history(store: ObjectStore, version: str) -> list[dict[str, Any]]:
    """The earlier versions' pushes (from their pointers), then this one, for the card."""
    out = [{"version": v, "pushed_at": (store.ref(v) or {}).get("pushed_at")} for v in store.versions()]
    return [*out, {"version": version, "pushed_at": utc_now(), "force": False}]

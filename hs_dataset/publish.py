"""Publish a finished hidden-state build as a versioned Hugging Face dataset.

Layout on the Hub: every version is a git tag (``v1.0``, ``v1.1``...) on a commit that holds exactly
that version's files (data shards, ``hs_dataset.json``, ``rejects.jsonl``, the dataset card);
``main`` carries the newest version so that ``load_dataset(repo)`` works without a revision, and
``load_dataset(repo, revision="v1.0")`` gives a pinned one.

How a push proceeds (``push_dataset``), through the real :class:`huggingface_hub.HfApi`:

0. the build is verified (:func:`hs_dataset.verify.verify_build`, the full check: every shard present
   with its size, rows and content hash, nothing unlisted) and scanned for credentials; a build that
   fails either is refused before anything is sent, naming the shard and the repair;
1. the dataset repo is created if needed; an existing tag ``version`` is refused unless ``force``
   (the name itself is checked first: :mod:`hs_dataset.version_names`);
2. the work branch ``hs-dataset/<version>`` is created from ``main`` (or resumed when it exists);
3. files not already on the work branch with the same content (size + sha256 for LFS files, git
   blob id for regular ones) are uploaded in commits of at most ``commit_files`` files, each with
   ``parent_commit`` set so that a concurrent writer makes the push fail instead of interleaving;
4. a final commit writes README.md (see :mod:`hs_dataset.card`) and deletes what a previous
   version left that is not part of this one; the resulting tree is checked file by file;
5. only then the tag is created (a forced re-push deletes and re-creates it, and the card records
   when and which commit it replaced; a forced push killed between the two is resumed by the next
   run, which reads the force from the card already on the work branch);
6. ``main`` is brought to the same content with one commit (server-side copies + deletions) when
   this version is the newest one, and the work branch is deleted.

An interrupted push run again resumes at step 3 and uploads only what is missing; a push stopped
between steps 5 and 6 is finished by running it again. No tag ever points at a partial upload.

The token comes from huggingface_hub's usual sources (``token=``, ``HF_TOKEN``, stored login); it is
never printed, logged or written, and files about to be uploaded are checked not to contain it, nor
any credential the build redacted (:mod:`hs_dataset.redact`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationCopy,
    CommitOperationDelete,
    HfApi,
    get_token,
)
from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError
from huggingface_hub.hf_api import RepoFile

import xxhash

from .card import parse_history, render_card
from .errors import IntegrityError, NotABuildError, PublishError, SecretLeakError, VersionExistsError
from .layout import DATA_DIR, META_FILE, README_FILE, STATE_DIR
from .redact import check_uploads, find_secret, load_redacted, redact_command
from .verify import verify_build
from .version_names import WORK_BRANCH_PREFIX, check_version_name


logger = logging.getLogger(__name__)

REPO_TYPE = "dataset"
EXCLUDED_DIRS = (STATE_DIR, ".git", ".cache")
KEEP_REMOTE = (".gitattributes",)  # repository files a version never deletes
REGULAR_MAX_SIZE = 10 * 1024 * 1024  # the Hub stores anything >= 10 MiB with LFS
MAX_FILES_PER_FOLDER = 10_000  # Hub limit


@dataclass
class PushResult:
    repo_id: str
    version: str
    commit_sha: str  # the commit the version tag points at
    tag: str
    work_branch: str
    main_commit: str | None  # main's head after the push (None when main was left alone)
    main_updated: bool
    uploaded: list[str] = field(default_factory=list)  # paths uploaded by this run
    skipped: list[str] = field(default_factory=list)  # paths already on the work branch
    deleted: list[str] = field(default_factory=list)  # paths of a previous version removed
    commits: list[str] = field(default_factory=list)  # commits created on the work branch
    forced: bool = False
    previous_commit: str | None = None  # what the tag pointed at before a forced push
    resumed: bool = False  # the work branch existed already


@dataclass
class VersionInfo:
    version: str
    commit_sha: str
    samples: int | None
    tokens: int | None
    rejected: int | None
    metadata: dict | None = None
    bytes: int | None = None  # the shards' bytes
    pushed_at: str | None = None  # from the version's card (ISO UTC)


# --------------------------------------------------------------------------------------- helpers


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def version_key(version: str) -> tuple:
    """Sort key: ``v1.10`` > ``v1.9`` > ``v1.9rc1``; non-numeric names sort before numeric ones."""
    try:
        from packaging.version import InvalidVersion, Version

        try:
            return (1, Version(version.lstrip("vV")), version)
        except InvalidVersion:
            pass
    except ImportError:  # pragma: no cover
        pass
    parts = tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[^0-9A-Za-z]+", version.lstrip("vV")) if p)
    return (0, parts, version)


def _scrub(text: str, token: str | None) -> str:
    """Remove credentials from text that ends up in the card (:func:`hs_dataset.redact.redact_command`)."""
    if token:
        text = text.replace(token, "***")
    return redact_command(text)[0]


def _hash_file(path: Path, size: int) -> tuple[str, str | None, str]:
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
class _LocalFile:
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
        raise NotABuildError(f"{root} is not a directory")
    missing = [name for name in (META_FILE, README_FILE) if not (root / name).is_file()]
    if missing:
        raise NotABuildError(
            f"{root} is not a finished hs_dataset build: missing {', '.join(missing)} "
            "(run or resume the build until it completes before publishing)"
        )
    try:
        metadata = json.loads((root / META_FILE).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise NotABuildError(f"{root / META_FILE} is not valid JSON: {exc}") from None
    if not isinstance(metadata, dict):
        raise NotABuildError(f"{root / META_FILE} must hold a JSON object")
    data_dir = root / DATA_DIR
    if not data_dir.is_dir() or not any(p.is_file() for p in data_dir.rglob("*")):
        raise NotABuildError(f"{root} is not a finished hs_dataset build: no data files under data/")
    return root, metadata, (root / README_FILE).read_text(encoding="utf-8")


def _local_files(root: Path) -> dict[str, _LocalFile]:
    files: dict[str, _LocalFile] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        dirnames[:] = [d for d in dirnames if d not in (".git", ".cache")]
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() and not path.exists():
                continue
            rel = (rel_dir / name).as_posix()
            if rel == README_FILE:
                continue  # re-rendered as the dataset card in the final commit
            size = path.stat().st_size
            sha256, git_oid, xxh = _hash_file(path, size)
            files[rel] = _LocalFile(rel, path, size, sha256, git_oid, xxh)
    return files


def _check_folder_sizes(files: Iterable[str]) -> None:
    per_folder: dict[str, int] = {}
    for rel in files:
        folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
        per_folder[folder] = per_folder.get(folder, 0) + 1
    crowded = {f or "/": n for f, n in per_folder.items() if n > MAX_FILES_PER_FOLDER}
    if crowded:
        raise PublishError(f"the Hub allows at most {MAX_FILES_PER_FOLDER} files per folder; this build has {crowded}: "
                           "rebuild with larger shards")


def _refuse_unverified(root: Path, local: dict[str, _LocalFile] | None) -> None:
    """Refuse a build whose files differ from its ``hs_dataset.json``. ``local=None``: the quick check
    (before hashing anything); else the full check, reusing the hashes of push's own read."""
    digests = None if local is None else {rel: f.xxh3_128 for rel, f in local.items()}
    report = verify_build(root, quick=local is None, digests=digests)
    if not report.ok:
        raise IntegrityError(f"refusing to push: {report.message()} Then push again.", report.problems)


def _remote_files(api: HfApi, repo_id: str, revision: str) -> dict[str, RepoFile]:
    return {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, repo_type=REPO_TYPE, revision=revision, recursive=True)
        if isinstance(entry, RepoFile)
    }


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _read_remote_text(api: HfApi, repo_id: str, path: str, revision: str) -> str | None:
    try:
        local = api.hf_hub_download(repo_id, path, repo_type=REPO_TYPE, revision=revision)
    except (EntryNotFoundError, RevisionNotFoundError):
        return None
    return Path(local).read_text(encoding="utf-8")


def _collect_history(api: HfApi, repo_id: str, revisions: Iterable[str]) -> list[dict]:
    """Union of the histories embedded in the cards at ``revisions`` (deduplicated, in push order)."""
    seen: dict[tuple, dict] = {}
    for rev in dict.fromkeys(revisions):
        text = _read_remote_text(api, repo_id, README_FILE, rev)
        for entry in parse_history(text or ""):
            key = (entry.get("version"), entry.get("pushed_at"), entry.get("previous_commit"))
            seen.setdefault(key, entry)
    return sorted(seen.values(), key=lambda e: str(e.get("pushed_at") or ""))


def _fill_history_commits(history: list[dict], tags: dict[str, str]) -> None:
    """Record which commit each earlier push of a version was tagged at, when known.

    A push superseded by a later forced push of the same version was at that push's
    ``previous_commit``; the latest earlier push of a version is where its tag points now.
    """
    for i, entry in enumerate(history[:-1]):
        if entry.get("commit"):
            continue
        later = [e for e in history[i + 1:] if e.get("version") == entry.get("version")]
        if later and later[0].get("force") and later[0].get("previous_commit"):
            entry["commit"] = later[0]["previous_commit"]
        elif not later and entry.get("version") in tags:
            entry["commit"] = tags[entry["version"]]


# ------------------------------------------------------------------------------------ publishing


def push_dataset(
    local_dir: str | os.PathLike,
    repo_id: str,
    version: str,
    *,
    force: bool = False,
    token: str | None = None,
    commit_files: int = 50,
    private: bool = False,
    build_command: str | None = None,
    endpoint: str | None = None,
    secrets: Iterable[str] = (),
) -> PushResult:
    """Publish the build in ``local_dir`` as tag ``version`` of dataset repo ``repo_id`` (see module doc).

    ``secrets``: more credential values that no uploaded file may contain (besides the HF token and
    what the build redacted).

    Raises:
        VersionNameError: ``version`` is or shadows a git ref (the message names the rule).
        NotABuildError: ``local_dir`` is not a finished build.
        IntegrityError: its files differ from its ``hs_dataset.json`` (names the shard and the repair).
        SecretLeakError: a file holds a credential.
        VersionExistsError: the version exists and ``force`` was not given.
    """
    if commit_files < 1:
        raise ValueError("commit_files must be >= 1")
    check_version_name(version)
    root, metadata, build_readme = read_build(local_dir)
    _refuse_unverified(root, None)  # quick: a missing, extra or cut shard is refused before hashing
    secret = token or get_token()
    api = HfApi(endpoint=endpoint, token=token)
    work = f"{WORK_BRANCH_PREFIX}{version}"

    local = _local_files(root)
    _refuse_unverified(root, local)  # full, on the hashes of the upload's own read
    _check_folder_sizes(local)
    check_uploads([(f.rel, f.path, f.size) for f in local.values()], secret, root / STATE_DIR, secrets,
                  max_bytes=REGULAR_MAX_SIZE)

    api.create_repo(repo_id, repo_type=REPO_TYPE, private=private, exist_ok=True)
    refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    tags = {t.name: t.target_commit for t in refs.tags}
    branches = {b.name: b.target_commit for b in refs.branches}
    check_version_name(version, set(branches) - {work})
    previous = tags.get(version)
    result = PushResult(repo_id=repo_id, version=version, commit_sha="", tag=version, work_branch=work,
                        main_commit=None, main_updated=False, forced=False, previous_commit=None,
                        resumed=work in branches)
    if previous is None and work in branches:
        replaced = _interrupted_force(api, repo_id, branches[work], version)
        if replaced is not None:  # killed between deleting the old tag and creating the new one
            logger.info("resuming the forced push of %s that replaced %s", version, replaced)
            result.forced, result.previous_commit = True, replaced

    if previous is not None and branches.get(work) == previous and not force:
        # An earlier run tagged this version but stopped before updating main: finish it, provided the
        # tagged content is this build.
        tagged = _remote_files(api, repo_id, previous)
        if all(f.same_as(tagged.get(rel)) for rel, f in local.items()) and set(tagged) - {README_FILE, *KEEP_REMOTE} == set(local):
            logger.info("version %s is tagged already; finishing the interrupted push", version)
            result.commit_sha = previous
            _finish(api, repo_id, version, previous, work, tags, result)
            return result
    if previous is not None and not force:
        raise VersionExistsError(
            f"version tag '{version}' already exists on {repo_id} (commit {previous}); versions are immutable. "
            f"Publish a new version, or re-push this one with --force (force=True) to move the tag."
        )
    if previous is not None:
        result.forced, result.previous_commit = True, previous

    # 2. work branch
    if work not in branches:
        api.create_branch(repo_id, branch=work, revision=branches.get("main", "main"), repo_type=REPO_TYPE)
        head = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
        head = {b.name: b.target_commit for b in head.branches}[work]
    else:
        head = branches[work]
        logger.info("resuming work branch %s at %s", work, head)

    # 3. uploads
    remote = _remote_files(api, repo_id, head)
    to_upload = [f for rel, f in local.items() if not f.same_as(remote.get(rel))]
    result.skipped = [rel for rel, f in local.items() if f.same_as(remote.get(rel))]
    # data shards first, small metadata files last
    to_upload.sort(key=lambda f: (not f.rel.startswith("data/"), f.rel))
    batches = _chunks(to_upload, commit_files)
    for i, batch in enumerate(batches, 1):
        operations = []
        for f in batch:
            op = CommitOperationAdd(path_in_repo=f.rel, path_or_fileobj=str(f.path))
            op.upload_info.sha256 = bytes.fromhex(f.sha256)  # already computed: no second read
            operations.append(op)
        info = api.create_commit(
            repo_id, operations, repo_type=REPO_TYPE, revision=work, parent_commit=head,
            commit_message=f"hs-dataset {version}: upload part {i}/{len(batches)} ({len(batch)} files)",
        )
        head = info.oid
        result.commits.append(head)
        result.uploaded.extend(f.rel for f in batch)
        logger.info("uploaded part %d/%d (%d files) -> %s", i, len(batches), len(batch), head)

    # 4. deletions + dataset card
    stale = sorted(p for p in remote if p not in local and p != README_FILE and p not in KEEP_REMOTE)
    result.deleted = stale
    early, final_deletes = stale[:max(0, len(stale) - (commit_files - 1))], stale[max(0, len(stale) - (commit_files - 1)):]
    for i, batch in enumerate(_chunks(early, commit_files), 1):
        info = api.create_commit(
            repo_id, [CommitOperationDelete(p) for p in batch], repo_type=REPO_TYPE, revision=work,
            parent_commit=head, commit_message=f"hs-dataset {version}: remove files of the previous version ({i})",
        )
        head = info.oid
        result.commits.append(head)

    pushed_at = _now()
    history = _collect_history(api, repo_id, ["main", *tags.values()])
    entry: dict[str, Any] = {"version": version, "pushed_at": pushed_at, "force": result.forced}
    if result.forced:
        entry["previous_commit"] = result.previous_commit
    history.append(entry)
    _fill_history_commits(history, tags)
    card = render_card(
        metadata,
        {
            "readme": build_readme,
            "repo_id": repo_id,
            "version": version,
            "pushed_at": pushed_at,
            "build_command": _scrub(str(build_command or metadata.get("build_command") or "n/a"), secret),
            "history": history,
            "tags": {k: v for k, v in tags.items() if k != version},
        },
    )
    leak = find_secret(card.encode("utf-8"), [("the Hugging Face token", secret)] if secret else [],
                       load_redacted(root / STATE_DIR))
    if leak is not None:  # belt and braces: render_card only sees scrubbed input
        raise SecretLeakError(f"refusing to publish a dataset card that contains {leak}")
    operations: list = [CommitOperationAdd(path_in_repo=README_FILE, path_or_fileobj=card.encode("utf-8"))]
    operations += [CommitOperationDelete(p) for p in final_deletes]
    message = f"hs-dataset {version}: dataset card" + (" (force-push)" if result.forced else "")
    info = api.create_commit(repo_id, operations, repo_type=REPO_TYPE, revision=work, parent_commit=head,
                             commit_message=message)
    head = info.oid
    result.commits.append(head)

    # verify the exact tree before tagging it
    final = _remote_files(api, repo_id, head)
    expected = set(local) | {README_FILE} | (set(final) & set(KEEP_REMOTE))
    wrong = sorted(rel for rel, f in local.items() if not f.same_as(final.get(rel)))
    if set(final) != expected or wrong:
        raise PublishError(
            f"the work branch {work} at {head} does not hold exactly this build (unexpected: "
            f"{sorted(set(final) - expected)}, missing or different: {sorted(set(expected - set(final)) | set(wrong))}); "
            "not tagging it"
        )

    # 5. tag
    if previous is not None:
        api.delete_tag(repo_id, tag=version, repo_type=REPO_TYPE)
    api.create_tag(repo_id, tag=version, revision=head, repo_type=REPO_TYPE,
                   tag_message=f"hs-dataset {version}" + (" (force-pushed)" if result.forced else ""))
    result.commit_sha = head
    logger.info("tagged %s at %s", version, head)

    # 6. main + cleanup
    _finish(api, repo_id, version, head, work, tags, result)
    return result


def _interrupted_force(api: HfApi, repo_id: str, head: str, version: str) -> str | None:
    """The commit a forced push of ``version`` was replacing, when the card on its work branch says
    so (a push killed after deleting the old tag); None otherwise."""
    history = parse_history(_read_remote_text(api, repo_id, README_FILE, head) or "")
    last = history[-1] if history else {}
    if not (last.get("version") == version and last.get("force") and last.get("previous_commit")):
        return None
    if last in parse_history(_read_remote_text(api, repo_id, README_FILE, "main") or ""):
        return None  # an earlier, finished forced push (the work branch was made from main)
    return str(last["previous_commit"])


def _finish(api: HfApi, repo_id: str, version: str, commit: str, work: str, tags: dict[str, str],
            result: PushResult) -> None:
    """Bring main to ``commit``'s content when ``version`` is the newest, then drop the work branch."""
    others = [t for t in tags if t != version]
    if not others or version_key(version) >= max(version_key(t) for t in others):
        refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
        main_head = {b.name: b.target_commit for b in refs.branches}["main"]
        target = _remote_files(api, repo_id, commit)
        current = _remote_files(api, repo_id, main_head)
        operations: list = [
            CommitOperationCopy(src_path_in_repo=p, path_in_repo=p, src_revision=commit)
            for p, f in sorted(target.items())
            if current.get(p) is None or current[p].blob_id != f.blob_id
        ]
        operations += [CommitOperationDelete(p) for p in sorted(set(current) - set(target))]
        if operations:
            info = api.create_commit(repo_id, operations, repo_type=REPO_TYPE, revision="main",
                                     parent_commit=main_head, commit_message=f"hs-dataset: main is now {version}")
            main_head = info.oid
        result.main_commit, result.main_updated = main_head, True
    else:
        logger.info("main left alone: %s is older than the newest published version", version)
    try:
        api.delete_branch(repo_id, branch=work, repo_type=REPO_TYPE)
    except RevisionNotFoundError:
        pass


def list_versions(repo_id: str, token: str | None = None, *, endpoint: str | None = None) -> list[VersionInfo]:
    """Published versions (tags) of ``repo_id``, oldest first, with counts from their hs_dataset.json."""
    api = HfApi(endpoint=endpoint, token=token)
    refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    out = []
    for tag in sorted(refs.tags, key=lambda t: version_key(t.name)):
        text = _read_remote_text(api, repo_id, META_FILE, tag.target_commit)
        metadata = None
        if text is not None:
            try:
                metadata = json.loads(text)
            except ValueError:
                metadata = None
        counts = (metadata or {}).get("counts") or {}
        history = parse_history(_read_remote_text(api, repo_id, README_FILE, tag.target_commit) or "")
        pushed = [e.get("pushed_at") for e in history if e.get("version") == tag.name]
        out.append(VersionInfo(version=tag.name, commit_sha=tag.target_commit, samples=counts.get("written"),
                               tokens=counts.get("tokens_written"), rejected=counts.get("rejected"),
                               metadata=metadata, bytes=(metadata or {}).get("bytes"),
                               pushed_at=pushed[-1] if pushed else None))
    return out

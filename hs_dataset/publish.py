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
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationCopy,
    CommitOperationDelete,
    HfApi,
    get_token,
)
from huggingface_hub.errors import RevisionNotFoundError

from .card import parse_history, render_card
from .errors import PublishError, SecretLeakError, VersionExistsError
from .hub_versions import (REPO_TYPE, collect_history, fill_history_commits, read_remote_text, remote_files,
                           version_key)
from .layout import README_FILE, STATE_DIR
from .push_files import REGULAR_MAX_SIZE, check_folder_sizes, local_files, read_build, refuse_unverified
from .redact import check_uploads, find_secret, load_redacted, redact_command
from .version_names import WORK_BRANCH_PREFIX, check_version_name

__all__ = ["KEEP_REMOTE", "PushResult", "push_dataset"]


logger = logging.getLogger(__name__)

KEEP_REMOTE = (".gitattributes",)  # repository files a version never deletes


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


# --------------------------------------------------------------------------------------- helpers


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _scrub(text: str, token: str | None) -> str:
    """Remove credentials from text that ends up in the card (:func:`hs_dataset.redact.redact_command`)."""
    if token:
        text = text.replace(token, "***")
    return redact_command(text)[0]


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


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
    refuse_unverified(root, None)  # quick: a missing, extra or cut shard is refused before hashing
    secret = token or get_token()
    api = HfApi(endpoint=endpoint, token=token)
    work = f"{WORK_BRANCH_PREFIX}{version}"

    local = local_files(root)
    refuse_unverified(root, local)  # full, on the hashes of the upload's own read
    check_folder_sizes(local)
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
        tagged = remote_files(api, repo_id, previous)
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
    remote = remote_files(api, repo_id, head)
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
    history = collect_history(api, repo_id, ["main", *tags.values()])
    entry: dict[str, Any] = {"version": version, "pushed_at": pushed_at, "force": result.forced}
    if result.forced:
        entry["previous_commit"] = result.previous_commit
    history.append(entry)
    fill_history_commits(history, tags)
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
    final = remote_files(api, repo_id, head)
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
    history = parse_history(read_remote_text(api, repo_id, README_FILE, head) or "")
    last = history[-1] if history else {}
    if not (last.get("version") == version and last.get("force") and last.get("previous_commit")):
        return None
    if last in parse_history(read_remote_text(api, repo_id, README_FILE, "main") or ""):
        return None  # an earlier, finished forced push (the work branch was made from main)
    return str(last["previous_commit"])


def _finish(api: HfApi, repo_id: str, version: str, commit: str, work: str, tags: dict[str, str],
            result: PushResult) -> None:
    """Bring main to ``commit``'s content when ``version`` is the newest, then drop the work branch."""
    others = [t for t in tags if t != version]
    if not others or version_key(version) >= max(version_key(t) for t in others):
        refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
        main_head = {b.name: b.target_commit for b in refs.branches}["main"]
        target = remote_files(api, repo_id, commit)
        current = remote_files(api, repo_id, main_head)
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

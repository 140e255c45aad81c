"""Publish a finished hidden-state build as a versioned Hugging Face dataset.

Layout on the Hub: every version is a git tag (``v1.0``, ``v1.1``...) on a commit that holds exactly
that version's files (data shards, ``hs_dataset.json``, ``rejects.jsonl``, the dataset card);
``main`` carries the newest version so that ``load_dataset(repo)`` works without a revision, and
``load_dataset(repo, revision="v1.0")`` gives a pinned one.

How a push proceeds (``push_dataset``), through the real :class:`huggingface_hub.HfApi`:

0. the build is verified (:func:`hs_dataset.integrity.verify.verify_build`, the full check: every shard present
   with its size, rows and content hash, nothing unlisted) and scanned for credentials; a build that
   fails either is refused before anything is sent, naming the shard and the repair;
1. the dataset repo is created if needed; an existing tag ``version`` on exactly this build's files is
   the push done already (``already_there``: nothing is uploaded; a push stopped after tagging is
   finished, step 6), on other files it is refused unless ``force`` (the name itself is checked
   first: :mod:`hs_dataset.hub.names`);
2. the work branch ``hs-dataset/<version>`` is created from ``main`` (or resumed when it exists);
3. files not already on the work branch with the same content (size + sha256 for LFS files, git
   blob id for regular ones) are uploaded in commits of at most ``commit_files`` files, each with
   ``parent_commit`` set so that a concurrent writer makes the push fail instead of interleaving;
4. a final commit writes README.md (see :mod:`hs_dataset.write.card`) and deletes what a previous
   version left that is not part of this one; the resulting tree is checked file by file;
5. only then the tag is created (a forced re-push deletes and re-creates it, and the card records
   when and which commit it replaced; a forced push killed between the two is resumed by the next
   run, which reads the force from the card already on the work branch);
6. ``main`` is brought to the same content with one commit (server-side copies + deletions) when
   this version is the newest one, and the work branch is deleted.

An interrupted push run again resumes at step 3 and uploads only what is missing; a push stopped
between steps 5 and 6 is finished by running it again, and a finished push run again changes
nothing. No tag ever points at a partial upload.

The token comes from huggingface_hub's usual sources (``token=``, ``HF_TOKEN``, stored login); it is
never printed, logged or written, and files about to be uploaded are checked not to contain it, nor
any credential the build redacted (:mod:`hs_dataset.redact`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete, HfApi, get_token
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import chunk_iterable

from hs_dataset.write.card import render_card
from hs_dataset.errors import ConfigError, PublishError, SecretLeakError, VersionExistsError
from hs_dataset.hub.access import hub_call
from hs_dataset.hub.names import WORK_BRANCH_PREFIX, check_version_name
from hs_dataset.hub.uploads import REGULAR_MAX_SIZE, LocalFile, check_folder_sizes, local_files, read_build, refuse_unverified
from hs_dataset.hub.versions import (REPO_TYPE, collect_history, fill_history_commits, interrupted_force, remote_files,
                                     utc_now, version_key)
from hs_dataset.redact import check_uploads, find_secret, load_redacted, redact_command
from hs_dataset.layout import README_FILE, STATE_DIR

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
    already_there: bool = False  # the tag held exactly this build: nothing uploaded (resumed: main etc. finished)


# --------------------------------------------------------------------------------------- helpers


def _scrub(text: str, token: str | None) -> str:
    """Remove credentials from text that ends up in the card (:func:`hs_dataset.redact.redact_command`)."""
    if token:
        text = text.replace(token, "***")
    return redact_command(text)[0]


# ------------------------------------------------------------------------------------ publishing


@hub_call  # Hub failures raised as HubAccessError (hs_dataset.hub.access)
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
    """Publish the build in ``local_dir`` as tag ``version`` of dataset repo ``repo_id`` (see the module docstring).

    Args:
        local_dir: a finished build directory.
        repo_id: the dataset repository (``org/name``); made if needed.
        version: the tag, e.g. ``v1.0``.
        force: replace an existing version (the card records the commit it replaced).
        token: the Hub token (default: huggingface_hub's ``HF_TOKEN`` / stored login).
        commit_files: files per upload commit.
        private: make a new repository private.
        build_command: recorded in the card (default: the build's own, redacted).
        endpoint: the Hub (default ``HF_ENDPOINT``).
        secrets: more credential values that no uploaded file may contain (besides the HF token and
            what the build redacted).

    Returns:
        What the push did (:class:`PushResult`).

    Raises:
        VersionNameError: ``version`` is or shadows a git ref (the message names the rule).
        NotABuildError: ``local_dir`` is not a finished build.
        IntegrityError: its files differ from its ``hs_dataset.json`` (names the shard and the repair).
        SecretLeakError: a file holds a credential.
        VersionExistsError: the version exists on other files than this build's and ``force`` was not given
            (on this build's files the push is done: ``already_there``).
        PublishError: the work branch does not hold exactly this build after the uploads (not tagged).
        HubAccessError: the Hub cannot be reached, refuses the token or the request (one line, with the fix).
    """
    if commit_files < 1:
        raise ConfigError(f"commit_files={commit_files}: must be >= 1", field="commit_files", value=commit_files)
    check_version_name(version)
    root, metadata, build_readme = read_build(local_dir)
    refuse_unverified(root, None)  # quick: a missing, extra or cut shard is refused before hashing
    secret = token or get_token()
    api = HfApi(endpoint=endpoint, token=token)
    local = local_files(root)
    refuse_unverified(root, local)  # full, on the hashes of the upload's own read
    check_folder_sizes(local)
    check_uploads([(f.rel, f.path, f.size) for f in local.values()], secret, root / STATE_DIR, secrets,
                  max_bytes=REGULAR_MAX_SIZE)

    api.create_repo(repo_id, repo_type=REPO_TYPE, private=private, exist_ok=True)
    refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    tags = {t.name: t.target_commit for t in refs.tags}
    branches = {b.name: b.target_commit for b in refs.branches}
    result = _begin(api, repo_id, version, local, tags, branches, force)
    if result.commit_sha:  # tagged already: an interrupted push finished
        return result
    head = _work_branch(api, repo_id, result.work_branch, branches)
    remote = remote_files(api, repo_id, head)
    head = _upload(api, repo_id, version, local, remote, head, commit_files, result)
    card = _card(api, repo_id, version, metadata, build_readme, tags, result,
                 _scrub(str(build_command or metadata.get("build_command") or "n/a"), secret))
    leak = find_secret(card.encode("utf-8"), [("the Hugging Face token", secret)] if secret else [],
                       load_redacted(root / STATE_DIR))
    if leak is not None:  # belt and braces: render_card only sees scrubbed input
        raise SecretLeakError(f"refusing to publish a dataset card that contains {leak}")
    head = _card_commit(api, repo_id, version, card, local, remote, head, commit_files, result)
    _check_tree(api, repo_id, result.work_branch, head, local)

    # 5. tag
    if version in tags:  # a forced push: the old tag goes (the card records the commit it pointed at)
        api.delete_tag(repo_id, tag=version, repo_type=REPO_TYPE)
    api.create_tag(repo_id, tag=version, revision=head, repo_type=REPO_TYPE,
                   tag_message=f"hs-dataset {version}" + (" (force-pushed)" if result.forced else ""))
    result.commit_sha = head
    logger.info("tagged %s at %s", version, head)

    # 6. main + cleanup
    _finish(api, repo_id, version, head, result.work_branch, tags, result)
    return result


def _begin(api: HfApi, repo_id: str, version: str, local: dict[str, LocalFile], tags: dict[str, str],
           branches: dict[str, str], force: bool) -> PushResult:
    """Step 1: the version's state on the Hub -> the push's result so far (``commit_sha`` set: finished).

    Raises:
        VersionNameError: the name shadows a branch.
        VersionExistsError: tagged on other files than this build's, and not ``force``.
    """
    work = f"{WORK_BRANCH_PREFIX}{version}"
    check_version_name(version, set(branches) - {work})
    previous = tags.get(version)
    result = PushResult(repo_id=repo_id, version=version, commit_sha="", tag=version, work_branch=work,
                        main_commit=None, main_updated=False, forced=False, previous_commit=None,
                        resumed=work in branches)
    if previous is None and work in branches:
        replaced = interrupted_force(api, repo_id, branches[work], version)
        if replaced is not None:  # killed between deleting the old tag and creating the new one
            logger.info("resuming the forced push of %s that replaced %s", version, replaced)
            result.forced, result.previous_commit = True, replaced
    if previous is not None and not force:
        if not _holds_build(remote_files(api, repo_id, previous), local):
            raise VersionExistsError(
                f"version tag '{version}' already exists on {repo_id} (commit {previous}) and holds other files than "
                "this build; versions are immutable. Publish a new version, or re-push this one with --force "
                "(force=True) to move the tag."
            )
        # This build is the version already: a rerun of a finished push, or of one stopped after tagging.
        result.commit_sha, result.already_there = previous, True
        result.resumed = branches.get(work) == previous  # this push's work branch, left at the tag
        if result.resumed:  # stopped before main and the work branch were done: finish them
            logger.info("version %s is tagged already; finishing the interrupted push", version)
            _finish(api, repo_id, version, previous, work, tags, result)
        else:
            logger.info("version %s already holds this build: nothing to push", version)
            result.main_commit = branches.get("main")
        return result
    if previous is not None:
        result.forced, result.previous_commit = True, previous
    return result


def _holds_build(tree: dict[str, RepoFile], local: dict[str, LocalFile]) -> bool:
    """``tree`` (a commit's files) holds exactly this build: every file with the same content, no other
    (besides the card and :data:`KEEP_REMOTE`)."""
    return all(f.same_as(tree.get(rel)) for rel, f in local.items()) and \
        set(tree) - {README_FILE, *KEEP_REMOTE} == set(local)


def _work_branch(api: HfApi, repo_id: str, work: str, branches: dict[str, str]) -> str:
    """Step 2: the work branch, made from main or resumed -> its head commit."""
    if work in branches:
        logger.info("resuming work branch %s at %s", work, branches[work])
        return branches[work]
    api.create_branch(repo_id, branch=work, revision=branches.get("main", "main"), repo_type=REPO_TYPE)
    return {b.name: b.target_commit for b in api.list_repo_refs(repo_id, repo_type=REPO_TYPE).branches}[work]


def _upload(api: HfApi, repo_id: str, version: str, local: dict[str, LocalFile], remote: dict[str, RepoFile],
            head: str, commit_files: int, result: PushResult) -> str:
    """Step 3: upload what the work branch lacks, in commits of ``commit_files`` files -> the new head."""
    to_upload = [f for rel, f in local.items() if not f.same_as(remote.get(rel))]
    result.skipped = [rel for rel, f in local.items() if f.same_as(remote.get(rel))]
    to_upload.sort(key=lambda f: (not f.rel.startswith("data/"), f.rel))  # data shards first, metadata last
    batches = [list(b) for b in chunk_iterable(to_upload, commit_files)]
    for i, batch in enumerate(batches, 1):
        operations: list[CommitOperationAdd | CommitOperationDelete] = []
        for f in batch:
            op = CommitOperationAdd(path_in_repo=f.rel, path_or_fileobj=str(f.path))
            op.upload_info.sha256 = bytes.fromhex(f.sha256)  # already computed: no second read
            operations.append(op)
        info = api.create_commit(
            repo_id, operations, repo_type=REPO_TYPE, revision=result.work_branch, parent_commit=head,
            commit_message=f"hs-dataset {version}: upload part {i}/{len(batches)} ({len(batch)} files)",
        )
        head = info.oid
        result.commits.append(head)
        result.uploaded.extend(f.rel for f in batch)
        logger.info("uploaded part %d/%d (%d files) -> %s", i, len(batches), len(batch), head)
    return head


def _card(api: HfApi, repo_id: str, version: str, metadata: dict[str, Any], build_readme: str | None,
          tags: dict[str, str], result: PushResult, build_command: str) -> str:
    """The version's card, with the publication history of every version before it."""
    pushed_at = utc_now()
    history = collect_history(api, repo_id, ["main", *tags.values()])
    entry: dict[str, Any] = {"version": version, "pushed_at": pushed_at, "force": result.forced}
    if result.forced:
        entry["previous_commit"] = result.previous_commit
    history.append(entry)
    fill_history_commits(history, tags)
    return render_card(metadata, {"readme": build_readme, "repo_id": repo_id, "version": version,
                                  "pushed_at": pushed_at, "build_command": build_command, "history": history,
                                  "tags": {k: v for k, v in tags.items() if k != version}})


def _card_commit(api: HfApi, repo_id: str, version: str, card: str, local: dict[str, LocalFile],
                 remote: dict[str, RepoFile], head: str, commit_files: int, result: PushResult) -> str:
    """Step 4: delete what a previous version left, then commit the card (with the last deletions) -> the head."""
    stale = sorted(p for p in remote if p not in local and p != README_FILE and p not in KEEP_REMOTE)
    result.deleted = stale
    cut = max(0, len(stale) - (commit_files - 1))
    for i, batch in enumerate(chunk_iterable(stale[:cut], commit_files), 1):
        deletions: list[CommitOperationAdd | CommitOperationDelete] = [CommitOperationDelete(p) for p in batch]
        info = api.create_commit(
            repo_id, deletions, repo_type=REPO_TYPE, revision=result.work_branch, parent_commit=head,
            commit_message=f"hs-dataset {version}: remove files of the previous version ({i})",
        )
        head = info.oid
        result.commits.append(head)
    operations: list[CommitOperationAdd | CommitOperationDelete] = [
        CommitOperationAdd(path_in_repo=README_FILE, path_or_fileobj=card.encode("utf-8"))]
    operations += [CommitOperationDelete(p) for p in stale[cut:]]
    message = f"hs-dataset {version}: dataset card" + (" (force-push)" if result.forced else "")
    info = api.create_commit(repo_id, operations, repo_type=REPO_TYPE, revision=result.work_branch,
                             parent_commit=head, commit_message=message)
    result.commits.append(info.oid)
    return info.oid


def _check_tree(api: HfApi, repo_id: str, work: str, head: str, local: dict[str, LocalFile]) -> None:
    """The work branch at ``head`` holds exactly this build (and the card), checked file by file before the tag."""
    final = remote_files(api, repo_id, head)
    expected = set(local) | {README_FILE} | (set(final) & set(KEEP_REMOTE))
    wrong = sorted(rel for rel, f in local.items() if not f.same_as(final.get(rel)))
    if set(final) != expected or wrong:
        raise PublishError(
            f"the work branch {work} at {head} does not hold exactly this build (unexpected: "
            f"{sorted(set(final) - expected)}, missing or different: {sorted(set(expected - set(final)) | set(wrong))}); "
            "not tagging it"
        )


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

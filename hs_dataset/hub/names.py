"""Which names a published version may have (a git tag that shadows no other ref on the Hub), which
revisions can exist at all, and which repo ids the Hub takes: checked before any request.

A version is a tag of the dataset repository, and the Hub resolves a revision by name (a branch, a
tag, or a commit id). A tag named ``main`` makes ``load_dataset(repo)`` ambiguous and every later
push fail, ``HEAD`` and ``refs/...`` shadow git's own names, ``hs-dataset/...`` is the prefix of the
push's work branches, 7 or more hex digits read as a commit id (an abbreviated one from 7: ``50d617e``
would shadow the commit it abbreviates), and ``@`` is the revision separator of ``org/name@revision``
paths (and git's ``@{...}`` syntax). The name must pass ``git check-ref-format`` as
``refs/tags/<name>``, and, to be one path segment of a Hub URL that no client reads differently: at
most :data:`MAX_LENGTH` characters, no ``/`` (the Hub's pull-request refs are ``refs/pr/N``; a slash is
a path in URLs), only ASCII letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit.
"""

from __future__ import annotations

import re

from hs_dataset.errors import RepoIdError, VersionNameError

__all__ = ["MAX_LENGTH", "WORK_BRANCH_PREFIX", "check_repo_id", "check_revision", "check_version_name",
           "version_name_problem"]

WORK_BRANCH_PREFIX = "hs-dataset/"
MAX_LENGTH = 128  # a safe limit chosen here: far within what git, URLs and file systems take, readable in a card
_COMMIT_ID = re.compile(r"[0-9a-fA-F]{7,}")  # a full commit id (40 or 64) or an abbreviated one (7+)
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._-]")
_GIT_BAD_CHAR = re.compile(r"[\x00-\x20~^:?*\[\\\x7f]")


def _git_problem(name: str) -> str | None:
    """Why ``git check-ref-format refs/tags/<name>`` refuses ``name`` (None: it accepts it)."""
    bad = _GIT_BAD_CHAR.search(name)
    if bad:
        return f"contains {bad.group(0)!r}: git refuses control characters, spaces and any of ~ ^ : ? * [ \\"
    if name.startswith("/") or name.endswith("/") or "//" in name:
        return "starts or ends with '/' or holds '//': git refuses empty path components"
    if ".." in name:
        return "contains '..': git refuses it in ref names"
    if "@{" in name:
        return "contains '@{': git refuses it in ref names"
    for part in name.split("/"):
        if part.startswith("."):
            return f"has a component starting with '.' ({part!r}): git refuses it"
        if part.endswith(".lock"):
            return f"has a component ending in '.lock' ({part!r}): git refuses it"
    if name.endswith("."):
        return "ends with '.': git refuses it"
    return None


def version_name_problem(version: str, branches: set[str] | frozenset[str] = frozenset()) -> str | None:
    """The rule ``version`` breaks, in words (None: it is a valid version name).

    ``branches``: the repository's branch names, when known (a tag must not shadow one).
    """
    if not version:
        return "is empty"
    if len(version) > MAX_LENGTH:
        return f"is {len(version)} characters long: at most {MAX_LENGTH} are allowed"
    if version.casefold() == "main":
        return "is the name of the branch main (load_dataset(repo) would become ambiguous)"
    if version.upper() == "HEAD" or version.endswith("_HEAD"):
        return "shadows git's HEAD"
    if version.startswith("refs/"):
        return "starts with refs/: it would read as a full git ref, not a tag name"
    if version.startswith(WORK_BRANCH_PREFIX):
        return f"starts with {WORK_BRANCH_PREFIX}, the prefix of the work branches push creates"
    if _COMMIT_ID.fullmatch(version):
        return "is 7 or more hex digits: it would read as a commit id or an abbreviated one"
    if "@" in version:
        return "contains '@', the revision separator of org/name@revision paths (and of git's @{...})"
    if version.startswith("-"):
        return "starts with '-': command lines would read it as an option"
    if version in branches:
        return f"is the name of an existing branch of the repository ({version})"
    return _git_problem(version) or _url_problem(version)


def _url_problem(name: str) -> str | None:
    """Why ``name`` is no safe single segment of a Hub URL (None: it is)."""
    if "/" in name:
        return "contains '/': the Hub's pull-request refs are refs/pr/N and a '/' is a path in URLs"
    bad = _NOT_ALLOWED.search(name)
    if bad:
        return f"contains {bad.group(0)!r}: only ASCII letters, digits, '.', '_' and '-' are allowed"
    if not name[0].isalnum():
        return f"starts with {name[0]!r}: a version name starts with an ASCII letter or digit"
    return None


def check_version_name(version: str, branches: set[str] | frozenset[str] = frozenset()) -> None:
    """Raise :class:`VersionNameError` naming the rule when ``version`` cannot be a version name."""
    why = version_name_problem(version, branches)
    if why is not None:
        shown = repr(version) if len(version) <= MAX_LENGTH else f"{version[:40]!r}..."
        raise VersionNameError(f"invalid version name {shown}: it {why}. Use a plain tag name such as 'v1.0'",
                               version=version)


def check_revision(revision: str) -> None:
    """Raise :class:`VersionNameError` when no ref can be named ``revision`` (git's rules: a branch, a tag or a
    commit id to read; its name is not checked against the version-name rules)."""
    why = "is empty" if not revision else _git_problem(revision.removeprefix("refs/"))
    if why is not None:
        raise VersionNameError(f"invalid revision {revision!r}: it {why}; give a version (e.g. v1.0), a branch or a "
                               "commit id (`hs-dataset versions REPO` lists the versions)", version=revision)


def check_repo_id(repo_id: str) -> None:
    """Raise :class:`RepoIdError` in one line when the Hub cannot have a repo named ``repo_id`` (its own rule,
    ``huggingface_hub.utils.validate_repo_id``: ``org/name`` or ``name``, letters, digits, ``-``, ``_``, ``.``)."""
    from huggingface_hub.errors import HFValidationError  # deferred: huggingface_hub
    from huggingface_hub.utils import validate_repo_id  # deferred: huggingface_hub

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        why = " ".join(str(e).split()).split(" Use `repo_type`")[0]
        raise RepoIdError(f"invalid repo id {repo_id!r}: {why.rstrip('.')}. A dataset repo id is org/name, e.g. "
                          "org/kimi-eagle3-hs", repo_id=repo_id) from None

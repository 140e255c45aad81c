"""Which names a published version may have: a git tag that shadows no other ref on the Hub.

A version is a tag of the dataset repository, and the Hub resolves a revision by name (a branch, a
tag, or a commit id). A tag named ``main`` makes ``load_dataset(repo)`` ambiguous and every later
push fail, ``HEAD`` and ``refs/...`` shadow git's own names, ``hs-dataset/...`` is the prefix of the
push's work branches, 40 (or 64) hex digits read as a commit id, and ``@`` is the revision separator
of ``org/name@revision`` paths (and git's ``@{...}`` syntax). Everything else must be a name that
``git check-ref-format`` accepts as ``refs/tags/<name>``.
"""

from __future__ import annotations

import re

from hs_dataset.errors import VersionNameError

__all__ = ["WORK_BRANCH_PREFIX", "check_version_name", "version_name_problem"]

WORK_BRANCH_PREFIX = "hs-dataset/"
_COMMIT_ID = re.compile(r"[0-9a-fA-F]{40}|[0-9a-fA-F]{64}")
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
    if version.casefold() == "main":
        return "is the name of the branch main (load_dataset(repo) would become ambiguous)"
    if version.upper() == "HEAD" or version.endswith("_HEAD"):
        return "shadows git's HEAD"
    if version.startswith("refs/"):
        return "starts with refs/: it would read as a full git ref, not a tag name"
    if version.startswith(WORK_BRANCH_PREFIX):
        return f"starts with {WORK_BRANCH_PREFIX}, the prefix of the work branches push creates"
    if _COMMIT_ID.fullmatch(version):
        return "is 40 (or 64) hex digits: it would read as a commit id"
    if "@" in version:
        return "contains '@', the revision separator of org/name@revision paths (and of git's @{...})"
    if version.startswith("-"):
        return "starts with '-': command lines would read it as an option"
    if version in branches:
        return f"is the name of an existing branch of the repository ({version})"
    return _git_problem(version)


def check_version_name(version: str, branches: set[str] | frozenset[str] = frozenset()) -> None:
    """Raise :class:`VersionNameError` naming the rule when ``version`` cannot be a version name."""
    why = version_name_problem(version, branches)
    if why is not None:
        raise VersionNameError(f"invalid version name {version!r}: it {why}. Use a plain tag name such as 'v1.0'",
                               version=version)

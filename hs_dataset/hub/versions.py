"""Versions on the Hub: their order, their listing with counts, and the history their cards carry.

A version is a tag; :func:`version_key` orders them (``main`` follows the newest); :func:`list_versions`
reads each tag's ``hs_dataset.json`` and card; :func:`collect_history` and :func:`fill_history_commits`
merge the push histories embedded in the cards for the next card.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from huggingface_hub import HfApi
from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError
from huggingface_hub.hf_api import RepoFile
from packaging.version import InvalidVersion, Version

from hs_dataset.hub.access import hub_call
from hs_dataset.write.card import parse_history
from hs_dataset.layout import META_FILE, README_FILE

__all__ = ["REPO_TYPE", "VersionInfo", "collect_history", "fill_history_commits", "interrupted_force", "list_versions",
           "read_remote_text", "remote_files", "utc_now", "version_key"]

REPO_TYPE = "dataset"


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


def version_key(version: str) -> tuple:
    """Sort key: ``v1.10`` > ``v1.9`` > ``v1.9rc1``; non-numeric names sort before numeric ones."""
    try:
        return (1, Version(version.lstrip("vV")), version)
    except InvalidVersion:
        pass
    parts = tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[^0-9A-Za-z]+", version.lstrip("vV")) if p)
    return (0, parts, version)


def remote_files(api: HfApi, repo_id: str, revision: str) -> dict[str, RepoFile]:
    return {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, repo_type=REPO_TYPE, revision=revision, recursive=True)
        if isinstance(entry, RepoFile)
    }


def read_remote_text(api: HfApi, repo_id: str, path: str, revision: str) -> str | None:
    try:
        local = api.hf_hub_download(repo_id, path, repo_type=REPO_TYPE, revision=revision)
    except (EntryNotFoundError, RevisionNotFoundError):
        return None
    return Path(local).read_text(encoding="utf-8")


def collect_history(api: HfApi, repo_id: str, revisions: Iterable[str]) -> list[dict]:
    """Union of the histories embedded in the cards at ``revisions`` (deduplicated, in push order)."""
    seen: dict[tuple, dict] = {}
    for rev in dict.fromkeys(revisions):
        text = read_remote_text(api, repo_id, README_FILE, rev)
        for entry in parse_history(text or ""):
            key = (entry.get("version"), entry.get("pushed_at"), entry.get("previous_commit"))
            seen.setdefault(key, entry)
    return sorted(seen.values(), key=lambda e: str(e.get("pushed_at") or ""))


def fill_history_commits(history: list[dict], tags: dict[str, str]) -> None:
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


@hub_call
def list_versions(repo_id: str, token: str | None = None, *, endpoint: str | None = None) -> list[VersionInfo]:
    """Published versions (tags) of ``repo_id``, oldest first, with counts from their hs_dataset.json.

    Args:
        repo_id: the dataset repository (``org/name``).
        token: the Hub token (default: huggingface_hub's own).
        endpoint: the Hub (default ``HF_ENDPOINT``).

    Raises:
        HubAccessError: no such repository, or the Hub cannot be reached or refuses (:mod:`hs_dataset.hub.access`).
    """
    api = HfApi(endpoint=endpoint, token=token)
    refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    out = []
    for tag in sorted(refs.tags, key=lambda t: version_key(t.name)):
        text = read_remote_text(api, repo_id, META_FILE, tag.target_commit)
        metadata = None
        if text is not None:
            try:
                metadata = json.loads(text)
            except ValueError:
                metadata = None
        counts = (metadata or {}).get("counts") or {}
        history = parse_history(read_remote_text(api, repo_id, README_FILE, tag.target_commit) or "")
        pushed = [e.get("pushed_at") for e in history if e.get("version") == tag.name]
        out.append(VersionInfo(version=tag.name, commit_sha=tag.target_commit, samples=counts.get("written"),
                               tokens=counts.get("tokens_written"), rejected=counts.get("rejected"),
                               metadata=metadata, bytes=(metadata or {}).get("bytes"),
                               pushed_at=pushed[-1] if pushed else None))
    return out


def utc_now() -> str:
    """Now, in UTC, as the cards write it (``2026-12-01T21:38:24Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def interrupted_force(api: HfApi, repo_id: str, head: str, version: str) -> str | None:
    """The commit a forced push of ``version`` was replacing, when the card on its work branch says
    so (a push killed after deleting the old tag); None otherwise."""
    history = parse_history(read_remote_text(api, repo_id, README_FILE, head) or "")
    last = history[-1] if history else {}
    if not (last.get("version") == version and last.get("force") and last.get("previous_commit")):
        return None
    if last in parse_history(read_remote_text(api, repo_id, README_FILE, "main") or ""):
        return None  # an earlier, finished forced push (the work branch was made from main)
    return str(last["previous_commit"])

"""``hs-dataset verify org/name --revision v1.0``: a published version checked, from the one copy readers use.

:func:`verify_repo` is :func:`~hs_dataset.hub.download.download_version` (the version's files once, into the
folder :func:`~hs_dataset.read.open_dataset` maps them from) followed by
:func:`~hs_dataset.integrity.verify.verify_build` on that folder: verifying a version and then opening it
keeps one copy on disk. ``quick`` compares the Hub's listing (names, sizes) with the version's
``hs_dataset.json`` and downloads no shard; a probe downloads only the shards holding the probed rows, into
the same folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi

from hs_dataset.errors import IntegrityError
from hs_dataset.hub.access import hub_call
from hs_dataset.hub.download import download_version, remote_version
from hs_dataset.hub.versions import REPO_TYPE
from hs_dataset.integrity.checksums import HASH_KEY, check_shard
from hs_dataset.integrity.quality import ProbeOptions, recorded_probe_problems, run_checks
from hs_dataset.integrity.verify import Problem, VerifyReport, verify_build
from hs_dataset.layout import DATA_DIR

__all__ = ["verify_repo"]


@hub_call
def verify_repo(repo_id: str, *, revision: str | None = None, quick: bool = False, token: str | None = None,
                endpoint: str | None = None, local_dir: str | os.PathLike | None = None,
                probe: ProbeOptions | None = None, stats: bool = False) -> VerifyReport:
    """Verify a published version (see the module).

    Args:
        repo_id: the dataset repository (``org/name``, or ``org/name@revision``).
        revision: the version (tag), branch or commit (default: main).
        quick: names and sizes only, nothing downloaded.
        token, endpoint: for the Hub.
        local_dir: the version's folder (default: the one ``open_dataset`` uses,
            :func:`~hs_dataset.hub.download.default_version_dir`).
        probe: re-run ``probe.rows`` random rows through the reference backend: after the listing check,
            only the shards holding them are downloaded (each checked against its hashes); nothing is recorded.
        stats: recount the statistics from every row (downloads the whole version).

    Raises:
        HubAccessError: the Hub cannot be reached, refuses the token, or has no such repo or revision.
        NotABuildError: the revision holds no ``hs_dataset.json``.
        IntegrityError: it records no shard checksums, or a downloaded shard differs from them (deleted).
        MissingPathError: a probe without the model's weights here.
    """
    if revision is None and "@" in repo_id:
        repo_id, _, revision = repo_id.partition("@")
    probe = probe or ProbeOptions()
    remote = remote_version(repo_id, revision=revision, token=token, endpoint=endpoint, local_dir=local_dir)
    report = remote.listing
    if report.ok and (stats or (not quick and not probe.rows)):
        try:
            version = download_version(repo_id, revision=remote.commit, token=token, endpoint=endpoint,
                                       local_dir=remote.folder)
        except IntegrityError as e:  # a shard damaged on the Hub or on the way (deleted): named in the report
            report.problems.extend(e.problems or [Problem(DATA_DIR, str(e))])
        else:
            report = verify_build(version.path, mark=False, probe=probe, stats=stats)
        report.where, report.commit = remote.where, remote.commit
        return report
    if report.ok and probe.rows:
        api = HfApi(endpoint=endpoint, token=token)
        probed, _, found = run_checks(None, remote.meta, remote.where,
                                      _fetch_shard(api, remote.repo_id, remote.commit, remote.folder), probe=probe,
                                      stats=False)
        report.problems += [Problem(*f) for f in found]
        report.probe = probed
    elif report.ok:
        report.problems += [Problem(*f) for f in recorded_probe_problems(remote.meta)]
    if not report.ok:
        report.repair = (f"The published files differ from their hs_dataset.json or hold wrong states (names and sizes, "
                         f"and the probed rows; a full check compares {HASH_KEY} hashes): rebuild the named parts where "
                         "the version was built and push again with --force.")
    return report


def _fetch_shard(api: HfApi, repo_id: str, commit: str, folder: Path) -> Any:
    """``shard_path`` for the probe: one shard downloaded into the version's folder, checked against its hashes."""
    def fetch(entry: dict[str, Any]) -> Path:
        path = Path(api.hf_hub_download(repo_id, f"{DATA_DIR}/{entry['name']}", repo_type=REPO_TYPE, revision=commit,
                                        local_dir=folder))
        why = check_shard(path, entry, quick=False)
        if why is not None:
            path.unlink(missing_ok=True)
            raise IntegrityError(f"{repo_id}@{commit}: {DATA_DIR}/{entry['name']} {why}: the probe reads nothing "
                                 f"from it; run `hs-dataset verify {repo_id} --revision {commit}`")
        return path
    return fetch

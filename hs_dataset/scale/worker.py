"""Scale-out: one version built by many workers, each with its own engine, then merged into one build.

    hs-dataset build SCRIPT -o OUT --workers 4 --worker-index 1   # one worker: share 1 of 4
    hs-dataset build SCRIPT -o OUT --workers auto                 # index and count from Slurm / torchrun
    hs-dataset merge OUT                                          # (automatic when the last share ends)
    hs-dataset build SCRIPT -o OUT --ray [ADDRESS]                # every share as a Ray task (scale.ray)

The source is split **by part** (``part_size`` rows): part ``p`` belongs to share ``p % N``
(:func:`hs_dataset.write.shares.share_parts`). Parts keep their global index, so a part's record, its
shares (``train-PPPPP-SSS``) and their content hashes are exactly those of a single-worker build. Each
share is its own resumable build (lock, part records, recovery) in
``OUT/.hs_build/shares/share-IIIII-of-NNNNN/`` (never published; :mod:`hs_dataset.write.shares`). A
share build holds no ``hs_dataset.json``: it cannot be pushed or loaded by mistake.

A worker that finishes its share and finds every share of ``OUT`` done merges them
(:func:`hs_dataset.scale.merge.merge_shares`: checks, hard links, the normal final step); a worker that
finds another one merging leaves it to that one. ``hs-dataset merge`` does the same by hand. The
launchers (Slurm, torchrun) are in :mod:`hs_dataset.scale.launchers`.
"""

from __future__ import annotations

import os

from hs_dataset.write.driver import BuildSummary, build
from hs_dataset.write.shares import WorkerShare, read_share, share_dir
from hs_dataset.capture.base import CaptureBackend
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import BuildLockedError
from hs_dataset.scale.launchers import pin_local_gpus
from hs_dataset.scale.merge import MergeSummary, merge_shares

__all__ = ["build_share", "merge_if_complete"]


def build_share(config: HiddenStatesConfig, out: str | os.PathLike, spec: WorkerShare, *,
                backend: CaptureBackend | None = None, progress: bool = True, build_command: str | None = None,
                merge: bool = True) -> tuple[BuildSummary, MergeSummary | None]:
    """Build (or resume) worker share ``spec`` of ``config`` under ``out``; with ``merge``, merge every share
    when this one was the last to finish.

    Args:
        config: the build's configuration (the same for every worker).
        out: the build's output directory (on a file system every worker sees).
        spec: this worker's share (:func:`hs_dataset.scale.launchers.resolve_share`).
        backend, progress, build_command: as for :func:`hs_dataset.write.driver.build`.
        merge: merge the shares when this was the last one to finish.

    Returns:
        (the share's summary, the merge's or None).

    Raises:
        What :func:`hs_dataset.write.driver.build` raises, and :class:`~hs_dataset.errors.ShareError`
        when the finished shares cannot be merged.
    """
    pin_local_gpus(config)
    d = share_dir(out, spec)
    d.mkdir(parents=True, exist_ok=True)
    summary = build(config, d, backend=backend, progress=progress, build_command=build_command, share=spec)
    return summary, merge_if_complete(out, spec.count) if merge else None


def merge_if_complete(out: str | os.PathLike, count: int) -> MergeSummary | None:
    """Merge the ``count`` shares of ``out`` when every one is done (None: one is not, or another worker
    is merging them). The merged build records the shares' command (redacted) without the worker flags."""
    dirs = [share_dir(out, WorkerShare(i, count)) for i in range(count)]
    if not all((read_share(d) or {}).get("done") for d in dirs):
        return None
    try:
        return merge_shares(out, dirs)
    except BuildLockedError:
        return None  # another worker finished at the same time and merges



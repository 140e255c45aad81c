"""``hs-dataset build SCRIPT -o OUT --ray [ADDRESS]``: every share of a build as a Ray task on an
existing Ray cluster (or a new local one), one engine per task, then one merged build.

Each task builds one share (:func:`hs_dataset.scale.worker.build_share`) and asks Ray for what its
engine needs (:func:`hs_dataset.scale.launchers.worker_resources`: ``num_gpus = tp_size`` for an SGLang
engine, 1 GPU for transformers on CUDA, none on the CPU; 1 CPU), so Ray runs as many engines side
by side as the cluster holds: eight TP=1 engines on one 8-GPU node, two TP=4, one TP=8 per node of
many. Ray gives each task its own ``CUDA_VISIBLE_DEVICES``. By default there are as many shares as
engines fit at once (at most one per part). A task whose worker process dies (killed, out of memory,
node lost) or whose engine fails (:class:`~hs_dataset.errors.BackendError`) runs again, up to
``max_retries`` times, and its share build resumes from its recorded parts. When every share is done
the driver merges them (:func:`hs_dataset.scale.merge.merge_shares`).

Every node needs hs_dataset (with its backend), the model directory, the source and ``OUT`` at the
same paths (a shared file system). Ray is optional: ``pip install 'hs-dataset[ray]'``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from hs_dataset.write.shares import WorkerShare, count_parts, share_dir
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import BackendError, ConfigError, ShareError
from hs_dataset.layout import STATE_DIR
from hs_dataset.prepare.source_spec import resolve_source
from hs_dataset.scale.launchers import worker_resources
from hs_dataset.scale.merge import MergeSummary, merge_shares
from hs_dataset.scale.worker import build_share

__all__ = ["RayBuild", "build_with_ray"]

MAX_RETRIES = 3


@dataclass
class RayBuild:
    """The merged build, and what each share's (last) task reported."""

    merged: MergeSummary
    shares: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> str:
        return self.merged.message()


def _run_share(config: dict[str, Any], out: str, index: int, count: int, build_command: str | None) -> dict[str, Any]:
    """One Ray task: build (or resume) share ``index`` of ``count``; the driver merges."""
    s, _ = build_share(HiddenStatesConfig(**config), out, WorkerShare(index, count), progress=False,
                       build_command=build_command, merge=False)
    return {"index": index, "host": socket.gethostname(), "pid": os.getpid(), "parts_built": s.parts_built,
            "parts_skipped": s.parts_skipped, "counts": dataclasses.asdict(s.counts), "seconds": s.seconds}


def build_with_ray(config: HiddenStatesConfig, out: str | os.PathLike, *, address: str | None = None,
                   workers: int | None = None, build_command: str | None = None, max_retries: int = MAX_RETRIES,
                   progress: bool = True, log: Callable[[str], None] = print) -> RayBuild:
    """Build ``config`` into ``out`` as Ray tasks, one share each, and merge them.

    Args:
        address: the Ray cluster (``auto``, ``host:port``, ``ray://host:port``); None: the one this
            process is connected to, else ``RAY_ADDRESS``, else a new local Ray (stopped at the end).
        workers: default: as many as engines fit on the cluster at once (at most one per part).
        max_retries: runs of a share's task after its worker died or its engine failed.
        log: where the per-share lines go.

    Raises:
        ConfigError: Ray is not installed, or the cluster cannot hold one engine.
        ShareError: a share failed for good (the others' parts are kept: run the command again).
    """
    try:
        import ray  # optional: pip install 'hs-dataset[ray]'
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'hs-dataset[ray]' (on every node of the cluster)") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address)
    try:
        total = ray.cluster_resources()
        cpus, gpus = worker_resources(config, gpus_available=total.get("GPU", 0) > 0)
        if gpus > total.get("GPU", 0) or cpus > total.get("CPU", 0):
            raise ConfigError(f"one engine needs {gpus:g} GPUs and {cpus:g} CPUs; the Ray cluster has "
                              f"{total.get('GPU', 0):g} GPUs and {total.get('CPU', 0):g} CPUs")
        fits = int(total["GPU"] // gpus) if gpus else int(total["CPU"] // cpus)
        n_parts = count_parts(resolve_source(config.source), config)  # the launcher's one resolve; each share
        # build resolves the source again in its own process
        count = workers or max(1, min(fits, n_parts))
        log(f"hs-dataset: {count} shares as Ray tasks ({cpus:g} CPU, {gpus:g} GPU each; {fits} at once)")
        task = ray.remote(num_cpus=cpus, num_gpus=gpus, max_retries=max_retries,  # type: ignore[call-overload]
                          retry_exceptions=[BackendError])(_run_share)  # Ray's stubs omit a list of exceptions
        cfg = config.to_dict()
        pending = {task.options(name=f"hs-dataset-share-{i}-of-{count}").remote(cfg, str(out), i, count, build_command): i
                   for i in range(count)}
        results, failed = _wait(ray, pending, count, n_parts, Path(out), progress, log)
        if failed:
            i, e = failed[0]
            raise ShareError(f"share {i} of {count} failed ({type(e).__name__}: {e}); "
                             f"{len(failed)} of {count} shares failed, the finished parts of every share are kept: run "
                             "the same command again to resume") from e
    finally:
        if started:
            ray.shutdown()
    merged = merge_shares(out, [share_dir(out, WorkerShare(i, count)) for i in range(count)])
    return RayBuild(merged, sorted(results, key=lambda r: r["index"]))


def _wait(ray: Any, pending: dict, count: int, n_parts: int, out: Path, progress: bool,
          log: Callable[[str], None]) -> tuple[list[dict], list[tuple[int, BaseException]]]:
    """Wait for every task, showing the parts recorded so far. -> (results, [(share, error)])."""

    dirs = [share_dir(out, WorkerShare(i, count)) for i in range(count)]
    bar = tqdm(total=n_parts, unit="part", desc="hs-dataset build (ray)", disable=not progress,
               dynamic_ncols=True)
    results: list[dict] = []
    failed: list[tuple[int, BaseException]] = []
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=2.0)
            bar.n = sum(len(list((d / STATE_DIR / "parts").glob("part-*.json"))) for d in dirs if d.is_dir())
            bar.refresh()
            for ref in ready:
                i = pending.pop(ref)
                try:
                    r = ray.get(ref)
                except Exception as e:  # RayTaskError (wrapping the task's own error), WorkerCrashedError...
                    failed.append((i, getattr(e, "cause", None) or e))
                    log(f"share {i} of {count} failed: {failed[-1][1]}")
                    continue
                results.append(r)
                c = r["counts"]
                log(f"share {i} of {count} done on {r['host']} (pid {r['pid']}): {c['written']} written, "
                    f"{c['rejected']} rejected; {r['parts_built']} parts built, {r['parts_skipped']} already done, "
                    f"{r['seconds']:.1f}s")
    finally:
        bar.close()
    return results, failed


"""``hs-dataset build --workers/--worker-index/--ray`` (one worker of many) and ``hs-dataset merge``.

The work is :mod:`hs_dataset.scale` (worker shares by part, launchers, merge, Ray) and
:mod:`hs_dataset.scale.ray`; this module reads their options and prints their results.
"""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigError

if TYPE_CHECKING:
    from hs_dataset.scale.merge import MergeSummary

__all__ = ["add_build_args", "cmd_merge", "register", "scaleout_build", "wants_scaleout"]


def add_build_args(parser: argparse.ArgumentParser) -> None:
    """``--workers``, ``--worker-index`` and ``--ray`` for ``hs-dataset build``."""
    g = parser.add_argument_group("many workers (docs/scale.md)")
    g.add_argument("--workers", metavar="N|auto",
                   help="split the build into N worker shares by part (part p -> share p %% N), one per worker, merged into "
                        "one build at the end; auto: N from the launcher (SLURM_ARRAY_TASK_COUNT, torchrun's WORLD_SIZE)")
    g.add_argument("--worker-index", type=int, metavar="I",
                   help="build share I (0-based) of --workers (default: SLURM_ARRAY_TASK_ID, torchrun's RANK)")
    g.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run every share as a Ray task, one engine each, and merge (no ADDRESS: RAY_ADDRESS or a "
                        "new local Ray; 'auto', host:port or ray://host:port: an existing cluster); needs "
                        "pip install 'hs-dataset[ray]'")


def wants_scaleout(a: argparse.Namespace) -> bool:
    """Whether ``hs-dataset build`` was asked for shares or Ray."""
    return any(getattr(a, k, None) is not None for k in ("workers", "worker_index", "ray"))


def scaleout_build(a: argparse.Namespace, config: HiddenStatesConfig, command: str) -> MergeSummary | None:
    """``hs-dataset build`` with ``--workers``/``--worker-index``/``--ray``: build, print, merge.
    -> the merge, when ``a.output`` now holds the finished build (to print, check and push); None otherwise."""
    from hs_dataset.scale.launchers import parse_count, resolve_share  # deferred: imports pyarrow
    from hs_dataset.scale.worker import build_share  # deferred: imports torch, datasets

    merged: MergeSummary | None
    if a.ray is not None:
        from hs_dataset.scale.ray import build_with_ray  # deferred: imports torch, datasets

        if a.worker_index is not None:
            raise ConfigError("--ray builds every share: leave out --worker-index")
        n = None if a.workers in (None, "auto") else parse_count(a.workers)
        merged = build_with_ray(config, a.output, address=None if a.ray == "local" else a.ray, workers=n,
                                build_command=command, progress=not a.no_progress).merged
    else:
        spec = resolve_share(a.workers, a.worker_index)
        s, merged = build_share(config, a.output, spec, progress=not a.no_progress, build_command=command)
        c = s.counts
        print(f"built share {spec.index} of {spec.count} ({s.output_dir}): {c.written} samples written, "
              f"{c.rejected} rejected (of {c.samples_in}) in {s.seconds:.1f}s ({s.parts_built} parts built, "
              f"{s.parts_skipped} already done)")
        if merged is None:
            print(f"{a.output}: not every share is done yet (or another worker is merging them); the worker of the "
                  f"last one merges them (or run: hs-dataset merge {shlex.quote(str(a.output))})")
            return None
    return merged


def cmd_merge(a: argparse.Namespace) -> int:
    from hs_dataset.scale.merge import merge_shares  # deferred: imports torch, datasets

    print(merge_shares(a.out, a.shares or None, full=a.full).message())
    return 0


def register(sub, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser("merge", parents=[common], help="merge the shares of a build made by many workers into one "
                                                       "finished build")
    g.add_argument("out", help="the output directory of the split build (--output of its workers)")
    g.add_argument("shares", nargs="*", metavar="SHARE_DIR",
                   help="share builds to merge (default: every one in OUT/.hs_build/shares/)")
    g.add_argument("--full", action="store_true", help="check every share file's whole content hash (default: "
                                                       "size, first/last MiB and rows; push checks the hashes)")
    g.set_defaults(fn=cmd_merge)

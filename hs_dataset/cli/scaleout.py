"""``hs-dataset build --num-shards/--shard-index/--ray`` (one worker of many) and ``hs-dataset merge``.

The work is :mod:`hs_dataset.scaleout` (shards by part, launchers), :mod:`hs_dataset.merge` and
:mod:`hs_dataset.ray_build`; this module reads their options and prints their results.
"""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING

from ..config import HiddenStatesConfig
from ..errors import ConfigError
from ..scaleout import build_shard, parse_count, resolve_shard

if TYPE_CHECKING:
    from ..merge import MergeSummary

__all__ = ["add_build_args", "cmd_merge", "register", "scaleout_build", "wants_scaleout"]


def add_build_args(parser: argparse.ArgumentParser) -> None:
    """``--num-shards``, ``--shard-index`` and ``--ray`` for ``hs-dataset build``."""
    g = parser.add_argument_group("many workers (README: More GPUs, more nodes)")
    g.add_argument("--num-shards", metavar="N|auto",
                   help="split the build into N shards by part (part p -> shard p %% N), one per worker, merged into "
                        "one build at the end; auto: N from the launcher (SLURM_ARRAY_TASK_COUNT, torchrun's WORLD_SIZE)")
    g.add_argument("--shard-index", type=int, metavar="I",
                   help="build shard I (0-based) of --num-shards (default: SLURM_ARRAY_TASK_ID, torchrun's RANK)")
    g.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run every shard as a Ray task, one engine each, and merge (no ADDRESS: RAY_ADDRESS or a "
                        "new local Ray; 'auto', host:port or ray://host:port: an existing cluster); needs "
                        "pip install 'hs-dataset[ray]'")


def wants_scaleout(a: argparse.Namespace) -> bool:
    """Whether ``hs-dataset build`` was asked for shards or Ray."""
    return any(getattr(a, k, None) is not None for k in ("num_shards", "shard_index", "ray"))


def scaleout_build(a: argparse.Namespace, config: HiddenStatesConfig, command: str) -> MergeSummary | None:
    """``hs-dataset build`` with ``--num-shards``/``--shard-index``/``--ray``: build, print, merge.
    -> the merge, when ``a.output`` now holds the finished build (to check and push); None otherwise."""
    if a.ray is not None:
        from ..ray_build import build_with_ray

        if a.shard_index is not None:
            raise ConfigError("--ray builds every shard: leave out --shard-index")
        n = None if a.num_shards in (None, "auto") else parse_count(a.num_shards)
        merged = build_with_ray(config, a.output, address=None if a.ray == "local" else a.ray, num_shards=n,
                                build_command=command, progress=not a.no_progress).merged
    else:
        spec = resolve_shard(a.num_shards, a.shard_index)
        s, merged = build_shard(config, a.output, spec, progress=not a.no_progress, build_command=command)
        c = s.counts
        print(f"built shard {spec.index} of {spec.count} ({s.output_dir}): {c.written} samples written, "
              f"{c.rejected} rejected (of {c.samples_in}) in {s.seconds:.1f}s ({s.parts_built} parts built, "
              f"{s.parts_skipped} already done)")
        if merged is None:
            print(f"{a.output}: not every shard is done yet (or another worker is merging them); the worker of the "
                  f"last one merges them (or run: hs-dataset merge {shlex.quote(str(a.output))})")
            return None
    print(merged.message())
    return merged


def cmd_merge(a: argparse.Namespace) -> int:
    from ..merge import merge_shards

    print(merge_shards(a.out, a.shards or None, full=a.full).message())
    return 0


def register(sub, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser("merge", parents=[common], help="merge the shards of a build made by many workers into one "
                                                       "finished build")
    g.add_argument("out", help="the output directory of the sharded build (--output of its workers)")
    g.add_argument("shards", nargs="*", metavar="SHARD_DIR",
                   help="shard builds to merge (default: every one in OUT/.hs_build/shards/)")
    g.add_argument("--full", action="store_true", help="check every shard file's whole content hash (default: "
                                                       "size, first/last MiB and rows; push checks the hashes)")
    g.set_defaults(fn=cmd_merge)

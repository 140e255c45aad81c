"""A worker's share of a build: which parts are its own, and the record its share build keeps.

A build split over N workers gives part ``p`` to share ``p % N`` (:func:`share_parts`). Each share
is its own resumable build in ``OUT/.hs_build/shares/share-IIIII-of-NNNNN/``, whose
``.hs_build/share.json`` records which share it is, the whole plan, the model, layers, configuration
(redacted) and command (:func:`share_record`, written when the build begins:
:func:`hs_dataset.write.build_key.begin_build`), and ``done`` once every part is recorded
(:func:`finish_share`). :mod:`hs_dataset.scale` runs the workers and
merges the shares.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hs_dataset.atomic import atomic_write
from hs_dataset.write.resume import part_record
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigError, ConfigMismatchError
from hs_dataset.layout import SHARE_FILE, SHARES_DIR, STATE_DIR, part_ranges, share_dir_name
from hs_dataset.prepare.source_spec import Source
from hs_dataset.records import Counts
from hs_dataset.write.resolve import ResolvedBuild

__all__ = ["WorkerShare", "count_parts", "finish_share", "read_share", "share_dir", "share_parts", "share_record"]


@dataclass(frozen=True)
class WorkerShare:
    """Worker share ``index`` (0-based) of ``count``: the parts ``p`` with ``p % count == index``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(f"worker index {self.index} of {self.count} workers: the index must be in 0..count-1 "
                              "and the count at least 1 (--workers N --worker-index I)")

    @property
    def name(self) -> str:
        """The share's folder name, ``share-IIIII-of-NNNNN``."""
        return share_dir_name(self.index, self.count)


def share_parts(n_parts: int, workers: int) -> list[list[int]]:
    """The parts of each worker's share of a build of ``n_parts`` parts: part ``p`` goes to share ``p % workers``.

    Args:
        n_parts: the build's parts.
        workers: how many workers share them.

    Raises:
        ConfigError: ``workers`` < 1.
    """
    if workers < 1:
        raise ConfigError(f"--workers {workers}: use at least 1")
    return [list(range(i, n_parts, workers)) for i in range(workers)]


def count_parts(source: Source, config: HiddenStatesConfig) -> int:
    """How many parts a build of ``config`` from its resolved ``source`` has (the source's rows, at most
    ``max_samples``, per ``part_size``)."""
    return len(part_ranges(source.rows_to_build(config.max_samples), config.part_size))


def share_dir(out: str | os.PathLike, spec: WorkerShare) -> Path:
    """``OUT/.hs_build/shares/share-IIIII-of-NNNNN``: where the worker of ``spec`` builds."""
    return Path(out) / STATE_DIR / SHARES_DIR / spec.name


# -- the share's own record (written by the build driver) ---------------------------------------------
def read_share(path: str | os.PathLike) -> dict[str, Any] | None:
    """A share build's ``.hs_build/share.json`` (None: ``path`` is not a share build, or it is unreadable)."""
    try:
        r = json.loads((Path(path) / STATE_DIR / SHARE_FILE).read_text(encoding="utf-8"))
        ok = isinstance(r, dict) and all(k in r for k in ("share", "plan", "parts", "model", "layers", "config"))
        return r if ok and isinstance(r["share"], dict) and isinstance(r["plan"], dict) else None
    except (OSError, ValueError):
        return None


def share_record(state: Path, spec: WorkerShare, resolved: ResolvedBuild) -> tuple[list[tuple[int, int, int]], dict]:
    """-> this share's parts of the build, and the record of the share that ``state/share.json`` keeps (not done):
    which share, the whole plan, the build's model, layers, configuration and command (redacted). Nothing is written.

    Raises:
        ConfigMismatchError: the folder holds another share (another index or count).
    """
    parts = resolved.parts
    mine = set(share_parts(len(parts), spec.count)[spec.index])
    old = read_share(state.parent)
    if old is not None and old["share"] != {"index": spec.index, "count": spec.count}:
        raise ConfigMismatchError(f"{state.parent} holds worker share {old['share'].get('index')} of "
                                  f"{old['share'].get('count')}, not {spec.index} of {spec.count}: use the output of "
                                  "that split, or a new --output")
    record = {"share": {"index": spec.index, "count": spec.count},
              "plan": {"parts": len(parts), "rows": resolved.rows, "part_size": resolved.config.part_size},
              "parts": sorted(mine), "done": False, "model": resolved.info.to_dict(), "layers": list(resolved.layers),
              "config": resolved.config_record, "build_command": resolved.build_command}
    return [p for p in parts if p[0] in mine], record


def finish_share(state: Path, parts: list[tuple[int, int, int]]) -> Counts:
    """Sum the share's part records and mark it done (``share.json``) -> its counts."""
    counts = Counts()
    for i, _, _ in parts:
        counts.add(Counts(**json.loads(part_record(state, i).read_text(encoding="utf-8"))["counts"]))
    counts.check()
    record = json.loads((state / SHARE_FILE).read_text(encoding="utf-8"))
    record.update(done=True, counts=dataclasses.asdict(counts))
    atomic_write(state / SHARE_FILE, json.dumps(record, indent=1))
    return counts

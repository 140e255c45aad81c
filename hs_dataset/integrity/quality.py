"""The checks of ``verify`` beyond the bytes: the probe (``--probe N``, :mod:`hs_dataset.integrity.probe`), the
recount of the statistics (``--stats``, :mod:`hs_dataset.integrity.scan`), and a probe recorded as failed.

A local build keeps its last probe in ``hs_dataset.json`` and its card (:func:`record_probe`); a rebuild
that leaves every shard as it was keeps it, one that changes a shard drops it. While the recorded probe
names rows that do not match, every ``verify`` (and so ``push``) reports them, with the part to rebuild.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hs_dataset.atomic import atomic_write
from hs_dataset.integrity.probe import ProbeReport, run_probe
from hs_dataset.redact import redact
from hs_dataset.integrity.scan import Found, ScanReport, scan_build
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, STATE_DIR
from hs_dataset.write.card import render_readme

__all__ = ["ProbeOptions", "recorded_probe_problems", "record_probe", "run_checks"]


@dataclass(frozen=True)
class ProbeOptions:
    """How ``verify`` probes (:func:`hs_dataset.integrity.probe.run_probe`).

    Attributes:
        rows: rows to re-run through the reference backend (0: no probe; all rows when the build has fewer).
        seed: which rows (the same seed draws the same rows).
        model: the model directory (default: the path the build recorded).
        source: the source to retokenize for the token and mask check (default: the recorded one).
        device: the reference backend's device (default: cuda when there is one).
    """

    rows: int = 0
    seed: int = 0
    model: str | None = None
    source: str | None = None
    device: str | None = None


def recorded_probe_problems(meta: dict[str, Any]) -> list[Found]:
    """The rows a recorded probe found wrong, as problems naming their shard and part."""
    probe = meta.get("probe") or {}
    return [(f"{DATA_DIR}/{f.get('shard')}", f"the recorded probe: row {f.get('row')} ({f.get('id')}): {p}", f.get("part"))
            for f in probe.get("failed") or [] for p in f.get("problems") or []]


def run_checks(root: Path | None, meta: dict[str, Any], where: str, shard_path: Callable[[dict[str, Any]], Path], *,
               probe: ProbeOptions, stats: bool) -> tuple[ProbeReport | None, ScanReport | None, list[Found]]:
    """The probe and the recount asked for (``root``: a local copy of every shard, needed for ``stats``).
    -> (the probe's report, the recount's, their problems)."""
    found: list[Found] = []
    report = scan = None
    if stats and root is not None:
        scan = scan_build(root, meta)
        found += scan.problems
    if probe.rows:
        report = run_probe(meta, where, probe.rows, shard_path, seed=probe.seed, model=probe.model, source=probe.source,
                           device=probe.device)
        found += report.found()
    return report, scan, found


def record_probe(root: Path, report: ProbeReport) -> None:
    """Keep ``report`` in a local build's ``hs_dataset.json`` (``probe``) and its card (the card first:
    ``hs_dataset.json`` is the record the card is checked against)."""
    meta = json.loads((root / META_FILE).read_text(encoding="utf-8"))
    meta["probe"], _ = redact(report.to_record())
    text = json.dumps(meta, indent=1)
    if (root / STATE_DIR / META_FILE).is_file():  # the copy a rerun of the build starts from
        atomic_write(root / STATE_DIR / META_FILE, text)
    atomic_write(root / README_FILE, render_readme(meta, str(root)))
    atomic_write(root / META_FILE, text)

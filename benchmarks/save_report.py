"""Where a CPU benchmark's report goes: ``benchmarks/results/<date>-cpu-vm-<kind>.json``, and ``$OUT`` when set."""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def save_report(report: dict, kind: str) -> None:
    """Write ``report`` (with its ``date``) as ``<date>-cpu-vm-<kind>.json`` under benchmarks/results (and $OUT)."""
    name = f"{report['date']}-cpu-vm-{kind}.json"
    for folder in [ROOT / "benchmarks" / "results"] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")

"""A build's rejects (``rejects.jsonl``: one line per sample not written, with its field, reason and
stage), read back and grouped by kind (:func:`group_rejects`: sample-specific numbers and indices
folded, so that 300 "prompt is 4,123 tokens" lines are one group).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from hs_dataset.layout import REJECTS_FILE

__all__ = ['RejectGroup', 'group_rejects', 'read_rejects']


@dataclass
class RejectGroup:
    """Rejects of one kind: ``stage``, ``field`` and ``reason`` with numbers folded to ``N``."""

    stage: str
    field: str
    reason: str
    count: int
    example: str  # one sample id
    example_reason: str = ""  # that sample's own reason, its numbers kept ("length 5 does not match ... 7")


_NUMBER = re.compile(r"\d[\d,._]*")


_INDEX = re.compile(r"\[\d+\]")


def group_rejects(rejects: Iterable[dict[str, Any]]) -> list[RejectGroup]:
    """Rejects (``rejects.jsonl`` rows: sample_id, field, reason, stage) grouped by kind, most first."""
    groups: dict[tuple[str, str, str], RejectGroup] = {}
    for r in rejects:
        key = (str(r.get("stage", "")), _INDEX.sub("[]", str(r.get("field", ""))),
               _NUMBER.sub("N", str(r.get("reason", ""))))
        g = groups.get(key)
        if g is None:
            groups[key] = RejectGroup(*key, count=1, example=str(r.get("sample_id", "")),
                                      example_reason=str(r.get("reason", "")))
        else:
            g.count += 1
    return sorted(groups.values(), key=lambda g: (-g.count, g.stage, g.field, g.reason))


def read_rejects(out: str | Path) -> list[dict[str, Any]]:
    """The rows of a build's ``rejects.jsonl`` (none when it has no such file)."""
    path = Path(out) / REJECTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

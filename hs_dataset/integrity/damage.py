"""Damage marks: the parts a full verification found damaged, kept in ``.hs_build/damaged.json`` until the
next build redoes them (a flipped bit in the middle of a large shard is beyond the quick check a
resumed build runs itself)."""

from __future__ import annotations

import json
from pathlib import Path

from hs_dataset.atomic import atomic_write
from hs_dataset.layout import DAMAGED_FILE, STATE_DIR

__all__ = ["damaged_parts", "mark_damaged"]


def damaged_parts(state: Path) -> dict[int, str]:
    """Parts a full verification (``hs-dataset verify``, ``push``) found damaged: {part: what}.

    Written by :func:`mark_damaged`; the next build redoes them, then drops the file.
    """
    try:
        d = json.loads((state / DAMAGED_FILE).read_text(encoding="utf-8"))
        return {int(k): str(v) for k, v in d.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def mark_damaged(root: Path, parts: dict[int, str]) -> None:
    """Add ``parts`` ({part: what is wrong}) to ``root``'s ``.hs_build/damaged.json``: the next build redoes them."""
    state = root / STATE_DIR
    damaged = damaged_parts(state)
    damaged.update(parts)
    if damaged:
        try:
            atomic_write(state / DAMAGED_FILE, json.dumps({str(k): v for k, v in sorted(damaged.items())}, indent=1))
        except OSError:
            pass  # a read-only copy: the report still names the parts

"""After ``read``: choosing rows of finished versions, without capturing anything again.

The rows as stored come from :mod:`hs_dataset.integrity.build_rows`, the target's distribution per row
(``sample_stats.parquet``) from :mod:`hs_dataset.integrity.teacher_stats`.

* :mod:`.query` filters rows by tags and statistics and draws a mix; :mod:`.version` writes the derived version
  (``from hs_dataset.derive import derive``, ``hs-dataset derive``);
* :mod:`.layer_pilot`: per-layer statistics of a pilot build, to pick aux layers (``inspect --layers``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["DeriveSummary", "derive"]

if TYPE_CHECKING:
    from hs_dataset.derive.version import DeriveSummary, derive


def __getattr__(name: str) -> Any:  # lazy: importing the package pulls in neither pyarrow nor torch
    if name in __all__:
        return getattr(importlib.import_module("hs_dataset.derive.version"), name)
    raise AttributeError(f"module 'hs_dataset.derive' has no attribute {name!r}")

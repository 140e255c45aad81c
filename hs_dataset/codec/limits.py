"""Arrow's limits on one row, in one place: the 32-bit offsets of ``Array2D``'s inner lists.

A state column of one row holds ``positions x hidden`` values behind 32-bit offsets, and a record
batch holds its rows' values behind the same offsets. So a row has at most
:func:`max_row_tokens` positions (longer samples are stored as several rows: the build's
``row_tokens``), and the writer sizes record batches to stay under the limit
(:func:`hs_dataset.write.builder.writer_batch_rows`).

``HS_DATASET_ARROW_MAX_ELEMENTS`` lowers the limit, for tests only: the same code then splits rows
of a tiny model as it splits a 256k-token Kimi-K2.5 sample under the real limit.
"""

from __future__ import annotations

import os

__all__ = ["ARROW_MAX_ELEMENTS", "arrow_max_elements", "max_row_tokens"]

ARROW_MAX_ELEMENTS = 2**31 - 1  # Array2D's inner list offsets are 32-bit


def arrow_max_elements() -> int:
    """Values one state column of a record batch may hold (``HS_DATASET_ARROW_MAX_ELEMENTS``: lower, for tests)."""
    raw = os.environ.get("HS_DATASET_ARROW_MAX_ELEMENTS")
    return min(ARROW_MAX_ELEMENTS, int(raw)) if raw else ARROW_MAX_ELEMENTS


def max_row_tokens(hidden_size: int) -> int:
    """Most positions one row can hold at ``hidden_size`` (299,593 at Kimi-K2.5's 7168)."""
    return max(1, arrow_max_elements() // max(1, int(hidden_size)))

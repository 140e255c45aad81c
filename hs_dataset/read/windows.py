"""Token windows of long samples, read without touching the rest of the sample.

A build whose ``max_length`` exceeds ``row_tokens`` stores a long sample as several rows in order
(``token_start``, ``sample_tokens``: :mod:`hs_dataset.layout`). For training on long context a trainer
rarely wants a whole 128k-token sample at once: it wants a window of ``max_tokens`` positions, or the
k-th of n context-parallel slices. :func:`read_window` reads exactly the positions asked for: only the
Arrow values of those positions are mapped (:mod:`hs_dataset.read.safe_views`), so the pages of the
rest of the sample are never read from disk. A window inside one row is a view; one that spans rows is
put together (one copy of the window, never of the sample).

* :func:`sample_rows`: where each sample's rows are (read from the small columns only);
* :func:`read_window`: positions ``[start, stop)`` of one sample;
* :func:`cp_slice`: the k-th of n equal context-parallel slices of a sample;
* :func:`iter_windows`: every sample as consecutive windows of ``max_tokens`` (or its CP slice).

Each window is a dict: ``id``, ``token_start`` (the window's first position in its sample),
``sample_tokens``, ``input_ids`` / ``loss_mask`` of the window, ``next_id`` (the token after the window,
-1 at the sample's end: the target of its last position), and every hidden-state column as
``torch.bfloat16 [n, H]``. Builds without long rows work the same (one row per sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import datasets
import pyarrow as pa
import torch

from hs_dataset.codec.rows import list_slice, state_from_bits, state_slice
from hs_dataset.layout import SAMPLE_TOKENS_COLUMN, TOKEN_START_COLUMN, scale_column
from hs_dataset.read.decode import state_columns_of
from hs_dataset.read.safe_views import SafeViews

__all__ = ["SampleRows", "cp_slice", "iter_windows", "read_window", "sample_rows"]


@dataclass(frozen=True)
class SampleRows:
    """Where one sample lives: its id, its rows ``[first, first + len(starts))``, each row's first position."""

    sample_id: str
    first: int
    starts: tuple[int, ...]
    num_tokens: int


def sample_rows(ds: datasets.Dataset) -> list[SampleRows]:
    """Every sample of a map-style build (e.g. :func:`~hs_dataset.read.open_dataset`) and its rows, in order."""
    cols = ["id", "num_tokens"] + [c for c in (TOKEN_START_COLUMN, SAMPLE_TOKENS_COLUMN) if c in ds.column_names]
    t = ds.select_columns(cols).with_format("arrow")[:]
    ids = t.column("id").to_pylist()
    lengths = t.column("num_tokens").to_pylist()
    starts = t.column(TOKEN_START_COLUMN).to_pylist() if TOKEN_START_COLUMN in cols else [0] * len(ids)
    totals = t.column(SAMPLE_TOKENS_COLUMN).to_pylist() if SAMPLE_TOKENS_COLUMN in cols else lengths
    out: list[SampleRows] = []
    r = 0
    while r < len(ids):
        first, row_starts = r, [starts[r]]
        if starts[r] != 0:
            raise ValueError(f"row {r} (sample {ids[r]!r}) starts at position {starts[r]}: not a sample's first row "
                             "(rows of a sample must stay together, in order: do not shuffle or filter a long-rows build "
                             "before sample_rows)")
        end = starts[r] + lengths[r]
        r += 1
        while end < totals[first] and r < len(ids) and ids[r] == ids[first] and starts[r] == end:
            row_starts.append(starts[r])
            end += lengths[r]
            r += 1
        if end != totals[first]:
            raise ValueError(f"sample {ids[first]!r}: its rows cover {end} of {totals[first]} positions")
        out.append(SampleRows(ids[first], first, tuple(row_starts), totals[first]))
    return out


def cp_slice(num_tokens: int, rank: int, world: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of context-parallel rank ``rank`` of ``world``: equal slices, the first
    ``num_tokens % world`` one position longer."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}")
    base, extra = divmod(num_tokens, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _values(col: pa.ChunkedArray, row: int, lo: int, hi: int, views: SafeViews) -> torch.Tensor:
    """Positions ``[lo, hi)`` of row ``row`` of a list or Array2D column, mapping only those values."""
    if isinstance(col.type, pa.ExtensionType) or pa.types.is_list(col.type.value_type):  # Array2D((None, H))
        flat, width = state_slice(col, row, lo, hi)
        return views.tensor(flat.to_numpy(zero_copy_only=True)).view(hi - lo, width)
    return views.tensor(list_slice(col, row, lo, hi).to_numpy(zero_copy_only=True))


def read_window(ds: datasets.Dataset, sample: SampleRows, start: int, stop: int, *,
                columns: Iterable[str] | None = None, views: SafeViews | None = None) -> dict[str, Any]:
    """Positions ``[start, stop)`` of ``sample`` (see the module docstring), reading only those positions."""
    if not 0 <= start < stop <= sample.num_tokens:
        raise ValueError(f"window {start}..{stop} of sample {sample.sample_id!r} ({sample.num_tokens} tokens)")
    views = views or SafeViews()
    if getattr(ds, "_indices", None) is not None:
        raise ValueError("read_window needs the build's own row order (open_dataset), not a shuffled or filtered view")
    table: pa.Table = ds.data.table  # the memory-mapped Arrow table: row r of the build is row r here
    states = list(columns) if columns is not None else state_columns_of(table)
    bounds = list(sample.starts) + [sample.num_tokens]
    parts: dict[str, list[torch.Tensor]] = {c: [] for c in ["input_ids", "loss_mask", *states]}
    next_id = -1
    for k, row_start in enumerate(sample.starts):
        row_stop = bounds[k + 1]
        if row_stop <= start or row_start >= stop:
            if row_start == stop:  # the token after the window opens the next row
                next_id = int(_values(table.column("input_ids"), sample.first + k, 0, 1, views)[0])
            continue
        lo, hi = max(start, row_start) - row_start, min(stop, row_stop) - row_start
        r = sample.first + k
        for c in ("input_ids", "loss_mask"):
            parts[c].append(_values(table.column(c), r, lo, hi, views))
        if stop < row_stop:
            next_id = int(_values(table.column("input_ids"), r, hi, hi + 1, views)[0])
        for c in states:
            parts[c].append(state_from_bits(_values(table.column(c), r, lo, hi, views),
                                            lambda: _values(table.column(scale_column(c)), r, lo, hi, views), column=c))
    out: dict[str, Any] = {"id": sample.sample_id, "token_start": start, "sample_tokens": sample.num_tokens,
                           "next_id": next_id}
    for c, ts in parts.items():
        out[c] = ts[0] if len(ts) == 1 else torch.cat(ts)
    return out


def iter_windows(ds: datasets.Dataset, max_tokens: int, *, columns: Iterable[str] | None = None,
                 cp_rank: int | None = None, cp_size: int | None = None) -> Iterator[dict[str, Any]]:
    """Every sample as consecutive windows of at most ``max_tokens`` positions, in order; with ``cp_rank`` of
    ``cp_size``, only that context-parallel slice of each sample (cut into windows the same way)."""
    views = SafeViews()
    cols = list(columns) if columns is not None else None
    try:
        for s in sample_rows(ds):
            lo, hi = (0, s.num_tokens) if cp_size is None else cp_slice(s.num_tokens, cp_rank or 0, cp_size)
            for a in range(lo, hi, max_tokens):
                yield read_window(ds, s, a, min(a + max_tokens, hi), columns=cols, views=views)
    finally:
        views.close()

"""A part's statistics, computed while the build writes its rows: one row at a time, no second pass.

For each state column (every captured layer and ``hidden_final``) a part records the number of
values, their sum and sum of squares (float64 over float32 chunk sums), the largest magnitude, the
NaN and Inf counts and the values at the float8 e4m3 limit (448): for fp8 storage the stored codes
at +-448 (each token's largest value is one, so a healthy column holds about 1 / hidden of them; many
more means values were clamped: a scale too small), for bf16 storage the values whose magnitude
reaches 448 (what an unscaled cast to fp8 would saturate); the kernels are in
:mod:`hs_dataset.integrity.value_stats`. Besides: rows, tokens, loss-mask tokens, a length histogram
over ``max_length`` in :data:`LENGTH_BINS` bins, each row's token digests
(:func:`hs_dataset.prepare.duplicates.token_digests`), and *flags*: a row with NaN/Inf values, or
(fp8) with more than :func:`~hs_dataset.integrity.value_stats.saturation_limit` of a column's values
at the limit, named by its id.

The values are those stored: bf16 bits as bf16, fp8 as ``code * scale`` (float32), so statistics
recounted from the shards (:mod:`hs_dataset.integrity.scan`) equal these (up to float32 rounding on
another machine: :data:`hs_dataset.integrity.summary.REL_TOLERANCE`). The SGLang plugin counts them
on the GPU where it makes the states (:mod:`hs_dataset.codec.state_stats`) and hands them over with each
sample; rows of other backends are counted here, on :func:`stats_workers` worker threads (the kernels
release the GIL) while the next rows are written. Either way rows are added up in row order, so the sums
do not depend on the number of workers; at most ``workers + 2`` rows wait (what keeps the capture's memory
referenced).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hs_dataset.integrity.value_stats import ColumnStats, column_stats, saturation_limit
from hs_dataset.prepare.duplicates import token_digests

if TYPE_CHECKING:
    import torch

__all__ = ["LENGTH_BINS", "PartStatistics", "RowStats", "StatsCollector", "row_stats", "stats_workers"]

LENGTH_BINS = 32


def stats_workers() -> int:
    """Threads counting rows: 2 (1 on a single CPU). Each kernel call runs on torch's own threads
    (:mod:`hs_dataset.integrity.value_stats`); a second counting thread fills the time the first waits
    for the GIL between calls, and more would multiply torch's thread teams beyond the CPUs."""
    return max(1, min(2, os.cpu_count() or 1))


@dataclass
class PartStatistics:
    """One part's (or a whole build's) statistics, as recorded under ``quality`` in its part record."""

    columns: dict[str, ColumnStats] = field(default_factory=dict)
    rows: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    length_bin: int = 1  # the length histogram: bins of length_bin tokens, rows per bin
    length_counts: list[int] = field(default_factory=list)
    min_tokens: int = 0
    max_tokens: int = 0
    ids_digests: list[str] = field(default_factory=list)
    row_digests: list[str] = field(default_factory=list)
    flags: list[dict[str, Any]] = field(default_factory=list)  # {"row": index in the part, "id", "column", "what"}

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("columns", "ids_digests", "row_digests")}
        d["columns"] = {c: asdict(s) for c, s in self.columns.items()}
        d["ids_xxh3_64"] = "".join(self.ids_digests)  # 16 hex digits a row, in row order
        d["rows_xxh3_64"] = "".join(self.row_digests)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PartStatistics":
        def split(text: str) -> list[str]:
            return [text[i:i + 16] for i in range(0, len(text), 16)]

        counts = {k: int(d[k]) for k in ("rows", "tokens", "masked_tokens", "length_bin", "min_tokens", "max_tokens")}
        return cls({c: ColumnStats.from_dict(s) for c, s in d["columns"].items()}, **counts,
                   length_counts=[int(x) for x in d["length_counts"]], ids_digests=split(d["ids_xxh3_64"]),
                   row_digests=split(d["rows_xxh3_64"]), flags=list(d["flags"]))


@dataclass
class RowStats:
    """One row's statistics, before they are added to its part's."""

    sample_id: str
    tokens: int
    masked: int
    digests: tuple[str, str]
    columns: dict[str, ColumnStats]
    fp8: bool  # the states are fp8 codes


def row_stats(row: dict[str, Any], columns: list[str], counted: "torch.Tensor | None" = None) -> RowStats:
    """The statistics of one encoded row (or one read back from a shard): its values counted here, or taken
    from ``counted``, what the backend counted (float64 ``[states, 5]``, :mod:`hs_dataset.codec.state_stats`,
    the stored columns first)."""
    ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
    if counted is None:
        cols = {c: column_stats(row, c) for c in columns}
    else:
        cols = {c: ColumnStats(values=int(v[0]), sum=v[1], sumsq=v[2], absmax=v[3], fp8_limit=int(v[4]))
                for c, v in zip(columns, counted.tolist())}
    return RowStats(str(row["id"]), int(ids.shape[0]), int(mask.sum(dtype=np.int64)), token_digests(ids, mask), cols,
                    bool(np.asarray(row[columns[0]]).dtype == np.uint8))


class StatsCollector:
    """A part's statistics, row by row, counted on worker threads and added in row order.

    Args:
        columns: the state columns, in storage order.
        hidden: the states' width (for :func:`~hs_dataset.integrity.value_stats.saturation_limit`).
        max_length: the build's; the length histogram spans 1..max_length in :data:`LENGTH_BINS` bins.
        workers: counting threads (default :func:`stats_workers`; 0: on the caller's thread).
    """

    def __init__(self, columns: list[str], hidden: int, max_length: int, *, workers: int | None = None):
        self.columns = list(columns)
        self.limit = saturation_limit(hidden)
        self.stats = PartStatistics({c: ColumnStats() for c in self.columns},
                                    length_bin=-(-max(max_length, 1) // LENGTH_BINS),
                                    length_counts=[0] * LENGTH_BINS)
        n = stats_workers() if workers is None else workers
        self._pool = cf.ThreadPoolExecutor(n, thread_name_prefix="hs_dataset-stats") if n else None
        self._pending: deque[cf.Future] = deque()
        self._most = n + 2  # rows waiting: what they reference (the capture's memory) stays held

    def add(self, row: dict[str, Any], counted: "torch.Tensor | None" = None) -> None:
        """Add one encoded row (read, never changed; it stays referenced until counted).

        Args:
            counted: the statistics of its stored values, when the backend counted them (float64
                ``[states, 5]``, :mod:`hs_dataset.codec.state_stats`, the states in storage order; see
                :attr:`hs_dataset.records.CaptureResult.value_stats`). None: counted here.
        """
        if counted is not None:
            done: cf.Future = cf.Future()
            done.set_result(row_stats(row, self.columns, counted))
            self._pending.append(done)
        elif self._pool is None:
            self._merge(row_stats(row, self.columns))
            return
        else:
            self._pending.append(self._pool.submit(row_stats, row, self.columns))
        while len(self._pending) > self._most or (self._pending and self._pending[0].done()):
            self._merge(self._pending.popleft().result())  # in row order; a worker's error is raised here

    def _merge(self, r: RowStats) -> None:
        st = self.stats
        for c, s in r.columns.items():
            st.columns[c].merge(s)
            if s.nan or s.inf:
                st.flags.append({"row": st.rows, "id": r.sample_id, "column": c,
                                 "what": f"{s.nan:,} NaN and {s.inf:,} Inf values"})
            if r.fp8 and s.values and s.fp8_limit / s.values > self.limit:
                st.flags.append({"row": st.rows, "id": r.sample_id, "column": c,
                                 "what": f"{s.fp8_limit / s.values:.1%} of its fp8 values at the e4m3 limit (448; "
                                         f"flagged above {self.limit:.1%}): clamped, its scales too small"})
        n = r.tokens
        st.rows += 1
        st.tokens += n
        st.masked_tokens += r.masked
        st.min_tokens = n if st.rows == 1 else min(st.min_tokens, n)
        st.max_tokens = max(st.max_tokens, n)
        st.length_counts[min(max(n - 1, 0) // st.length_bin, LENGTH_BINS - 1)] += 1
        st.ids_digests.append(r.digests[0])
        st.row_digests.append(r.digests[1])

    def result(self) -> PartStatistics:
        """The part's statistics, once every row added is counted (a worker's error is raised here)."""
        while self._pending:
            self._merge(self._pending.popleft().result())
        self.close()
        return self.stats

    def close(self) -> None:
        """Stop the workers (rows not yet counted are dropped)."""
        for f in self._pending:
            f.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

"""The build's hook for a reader that trains while it builds: each row as it is generated, each part's fate.

:func:`hs_dataset.write.driver.build` takes an optional :class:`RowSink` and calls it from the part
loop; :class:`hs_dataset.stream.publish.StreamPublisher` is the one the package offers (``hs-dataset
build --stream``). The write stage only calls the hook; it imports nothing of the stream stage.

The calls, in this order for each part (parts in ascending order):

* ``start(out, parts, done)`` once, after recovery: the build's parts ``(index, start, stop)`` and the
  ones already committed (their rows are in ``data/`` already);
* ``row(part, index, sample_id, table)`` for every row written into the part's staging shards, in
  order (``index`` counts the part's written rows from 0); ``table`` is the one-row Arrow table the
  shard writer gets, whose buffers may be the capture's memory: a sink copies what it keeps before
  it returns, and may block (backpressure slows the build down);
* ``generated(part, rows)`` when the part's shards are closed (``rows`` written rows, final);
* ``committed(part)`` after the part's record is written (the commit point), from the build's thread;
* ``end(finished)`` once: ``True`` after the final step wrote ``hs_dataset.json``, ``False`` when the
  build stopped before (an error, Ctrl-C; a killed build calls nothing, and its uncommitted parts are
  generated again by the next run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import pyarrow as pa

__all__ = ["RowSink"]


class RowSink(Protocol):
    """Receives a build's rows as they are generated and each part's commit (see the module)."""

    def start(self, out: Path, parts: list[tuple[int, int, int]], done: set[int]) -> None: ...

    def row(self, part: int, index: int, sample_id: str, table: pa.Table) -> None: ...

    def generated(self, part: int, rows: int) -> None: ...

    def committed(self, part: int) -> None: ...

    def end(self, finished: bool) -> None: ...

"""One capture over many parts, consumed part by part, for engines that batch continuously (SGLang)."""

from __future__ import annotations

from collections import deque
from typing import Iterator

from hs_dataset.write.resolve import ResolvedBuild
from hs_dataset.capture.base import BackendItem, CaptureBackend, start_capture
from hs_dataset.prepare.duplicates import skip_duplicates
from hs_dataset.prepare.samples import tokenized_samples
from hs_dataset.prepare.workers import TokenizeWorkers
from hs_dataset.records import CaptureResult, Reject

__all__ = ["CaptureStream"]


class CaptureStream:
    """One ``backend.capture`` call over the source rows of several parts, consumed part by part.

    With an engine that batches continuously (SGLang), building each part with its own
    ``capture`` call drains the engine at every part boundary: the last rows of a part are written
    while the GPU waits for the next part's first requests. A stream keeps the next part's rows in
    flight instead. ``take(start, stop)`` yields the items of the source rows of ``[start, stop)``, in
    row order: the backend's result (a long sample's pieces, in order), or a :class:`Reject` (from the
    source, tokenization or the backend). ``workers``: the build's tokenize workers (None: tokenize in
    this process).
    """

    def __init__(self, resolved: ResolvedBuild, backend: CaptureBackend, ranges: list[tuple[int, int]], *,
                 workers: TokenizeWorkers | None = None):
        self._order: deque[int] = deque()  # source row index of every submitted sample, in order
        self._early_rejects: dict[int, Reject] = {}

        r = resolved
        assert r.source is not None, "resolved with its source (resolve_build)"
        early = self._early_rejects.__setitem__
        self._it = start_capture(backend, skip_duplicates(tokenized_samples(r.source, r.config, r.tokenizer, r.vocab_size,
                                                                            list(ranges), early, generator=backend,
                                                                            workers=workers),
                                                          r.duplicate_rows, early, self._order.append),
                                 r.storage_dtype, row_tokens=r.row_tokens, max_tokens=r.config.max_length,
                                 teacher_k=r.teacher_k, final=r.config.store_final)
        self._next: tuple[int, BackendItem] | None = None

    def take(self, start: int, stop: int) -> Iterator[BackendItem]:
        while True:
            if self._next is None:
                item = next(self._it, None)  # tokenizes (and records rejects of) every row before it
                if item is not None:  # a long sample's pieces but the last share its row index
                    more = isinstance(item, CaptureResult) and not item.last
                    self._next = (self._order[0] if more else self._order.popleft(), item)
            bound = stop if self._next is None else min(self._next[0], stop)
            for idx in sorted(k for k in self._early_rejects if start <= k < bound):
                yield self._early_rejects.pop(idx)
            if self._next is None or self._next[0] >= stop:
                return
            item = self._next[1]
            self._next = None
            yield item
            del item  # before the next one is awaited: a windowed region's piece is freed once unreferenced

    def close(self) -> None:
        close = getattr(self._it, "close", None)  # a generator's: ends the backend's capture call
        if close is not None:
            close()

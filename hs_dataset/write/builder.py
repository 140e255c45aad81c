"""The ``datasets`` builder: one part's source rows -> prepare -> capture -> encode -> Arrow rows.

``HiddenStatesBuilder`` is a real :class:`datasets.ArrowBasedBuilder`: its ``_generate_tables`` drives the
capture. Since datasets 4.0 removed loading scripts, it is not loaded by name: ``hs-dataset build``
(:mod:`hs_dataset.write.driver`) writes its tables once per *part* (a fixed range of source rows, the unit of
resume) with ``datasets``' own ``ArrowWriter``, each shard through a file written by a thread of its own
(:mod:`hs_dataset.write.parts`), and publishes plain Arrow shards that load with ``load_dataset(dir)``. It can
also be used directly::

    builder = HiddenStatesBuilder(config=HiddenStatesConfig(model=..., source=..., layers=(1, 2)))
    builder.download_and_prepare("out_dir", file_format="arrow")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

import datasets
import pyarrow as pa
from datasets.builder import Key

from hs_dataset.write.capture_stream import CaptureStream
from hs_dataset.write.resolve import ResolvedBuild, resolve_build
from hs_dataset.capture.backends import make_backend
from hs_dataset.capture.base import BackendItem, CaptureBackend, start_capture
from hs_dataset.codec.encode import (bytes_per_token, encode_row, make_features, row_pieces, row_table,
                                     stored_state_columns)
from hs_dataset.codec.limits import arrow_max_elements
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigError, NonFiniteError, SampleError
from hs_dataset.integrity.stats import PartStatistics, StatsCollector
from hs_dataset.layout import state_columns
from hs_dataset.prepare.duplicates import skip_duplicates
from hs_dataset.prepare.samples import tokenized_samples
from hs_dataset.prepare.workers import TokenizeWorkers
from hs_dataset.prepare.tags import tag_dtypes
from hs_dataset.records import Counts, Reject

__all__ = ["HiddenStatesBuilder", "HiddenStatesBuilderConfig", "writer_batch_rows"]


@dataclass
class HiddenStatesBuilderConfig(datasets.BuilderConfig):
    """The ``datasets`` face of a build's configuration: ``datasets`` builders take a ``BuilderConfig``;
    this one carries the :class:`~hs_dataset.config.HiddenStatesConfig` (which imports no ``datasets``)."""

    build: HiddenStatesConfig | None = None


def writer_batch_rows(resolved: ResolvedBuild) -> int:
    """Rows per Arrow record batch, sized by bytes (``writer_batch_bytes`` for rows of the longest length:
    ``max_length``, or ``row_tokens`` when samples span rows): memory stays bounded and Array2D's 32-bit
    offsets never overflow (:mod:`hs_dataset.codec.limits`); at least 1, at most 1000."""
    config, hidden = resolved.config, resolved.info.hidden_size
    tokens = min(config.max_length, resolved.row_tokens)
    row_bytes = tokens * bytes_per_token(resolved.n_states, hidden, config.storage_dtype)
    by_bytes = config.writer_batch_bytes // max(row_bytes, 1)
    by_offsets = arrow_max_elements() // (tokens * hidden)
    return max(1, min(by_bytes, by_offsets, 1000))


class HiddenStatesBuilder(datasets.ArrowBasedBuilder):
    """Builds one row per sample: id, input_ids, loss_mask, num_tokens, one column per layer, final.

    An ``ArrowBasedBuilder``: rows are handed to the writer as Arrow tables that wrap the captured
    states without copying them (see :func:`row_table`).

    Args:
        config: the build configuration (or ``resolved``).
        resolved: the configuration resolved already (:func:`~hs_dataset.write.resolve.resolve_build`):
            the model is not read and the tokenizer not loaded again.
        part: the source rows ``(start, stop)`` to build (default: the whole source, up to ``max_samples``).
        backend: an already started capture backend to use (it is not closed); default: one is
            started from the config and closed at the end of generation.
        stream: a :class:`~hs_dataset.write.capture_stream.CaptureStream` serving this part (continuously
            batching backends).
        on_row: called after every written row with ``(num_tokens, payload_bytes)`` (progress).
        workers: the build's tokenize workers (None: tokenize in this process).
        on_table: called with ``(index, sample_id, table)`` for every written row, before the shard writer
            gets it (``index`` counts the written rows from 0; a :class:`~hs_dataset.write.sink.RowSink`).
    """

    BUILDER_CONFIG_CLASS = HiddenStatesBuilderConfig
    config: HiddenStatesBuilderConfig

    def __init__(self, *args: Any, config: HiddenStatesConfig | None = None, resolved: ResolvedBuild | None = None,
                 part: tuple[int, int] | None = None, backend: CaptureBackend | None = None,
                 on_row: Callable[[int, int], None] | None = None, stream: CaptureStream | None = None,
                 workers: TokenizeWorkers | None = None,
                 on_table: Callable[[int, str, pa.Table], None] | None = None, **kwargs: Any):
        if resolved is None and config is not None:
            resolved = resolve_build(config, info=backend.info if backend is not None else None)
        if resolved is not None:  # datasets >= 4 builders take their config's fields as keyword arguments
            kwargs["build"] = resolved.config
        self._resolved = resolved
        self._part = part
        self._backend = backend
        self._on_row = on_row
        self._on_table = on_table
        self._stream = stream
        self._workers = workers
        self.counts = Counts()
        self.rejects: list[Reject] = []
        # Samples rejected after some of their rows were written (a long sample's later piece): the part's
        # shards are rewritten without them before it is committed (hs_dataset.write.drop_rows).
        self.dropped: set[str] = set()
        self.statistics: PartStatistics | None = None  # of the rows written, once generation ends
        self.state_columns: tuple[str, ...] = ()  # the stored hidden-state columns, once generation starts
        super().__init__(*args, **kwargs)  # calls _info()
        # Rows of a long sample may be pieces of a windowed ring region, which the engine waits to write again:
        # each row goes to the file at once (datasets would otherwise keep single rows until a batch is full).
        self._writer_batch_size = 1 if self.resolved.long_rows else writer_batch_rows(self.resolved)

    @property
    def resolved(self) -> ResolvedBuild:
        """The build resolved (from ``self.config.build`` on first use when none was given)."""
        if self._resolved is None:
            if self.config.build is None:
                raise ConfigError("HiddenStatesBuilder needs config=HiddenStatesConfig(...) (or resolved=...)")
            self._resolved = resolve_build(self.config.build)
        return self._resolved

    @property
    def layers(self) -> tuple[int, ...]:
        return self.resolved.layers

    def _info(self) -> datasets.DatasetInfo:
        r = self.resolved
        return datasets.DatasetInfo(
            description=f"Hidden states of {r.info.architecture} ({r.info.path}) for EAGLE-3 drafter training",
            features=make_features(r.layers, r.info.hidden_size, r.storage_dtype,
                                   messages=r.config.responses == "regenerate", long_rows=r.long_rows,
                                   teacher_k=r.teacher_k, store_final=r.config.store_final,
                                   tags=tag_dtypes(r.config.to_dict())),
        )

    def _split_generators(self, dl_manager: Any) -> list[datasets.SplitGenerator]:
        start, stop = self._part if self._part is not None else (0, self.resolved.config.max_samples)
        return [datasets.SplitGenerator(name=datasets.Split.TRAIN, gen_kwargs={"start": start, "stop": stop})]

    def _reject(self, r: Reject) -> None:
        self.rejects.append(r)
        self.counts.rejected += 1
        self.counts.rejects_by_stage[r.stage] = self.counts.rejects_by_stage.get(r.stage, 0) + 1

    def _items(self, backend: CaptureBackend, start: int, stop: int | None) -> Iterator[BackendItem]:
        if self._stream is not None:
            if stop is None:
                raise ValueError("a CaptureStream serves parts with a known end")
            for item in self._stream.take(start, stop):
                if isinstance(item, Reject) or item.last:  # a long sample's earlier pieces are not samples
                    self.counts.samples_in += 1
                yield item
                del item  # before the next one is awaited (a windowed region's piece)
            return

        def reject(_index: int, r: Reject) -> None:
            self.counts.samples_in += 1
            self._reject(r)

        def kept(_index: int) -> None:
            self.counts.samples_in += 1

        r = self.resolved
        assert r.source is not None, "resolved with its source (resolve_build)"
        yield from start_capture(backend, skip_duplicates(tokenized_samples(r.source, r.config, r.tokenizer, r.vocab_size,
                                                                            [(start, stop)], reject, generator=backend,
                                                                            workers=self._workers),
                                                          r.duplicate_rows, reject, kept),
                                 r.storage_dtype, row_tokens=r.row_tokens, max_tokens=r.config.max_length,
                                 teacher_k=r.teacher_k, final=r.config.store_final)

    def _generate_tables(self, start: int, stop: int | None) -> Generator[tuple[Key, Any], None, None]:
        cfg = self.resolved.config
        schema = self.info.features.arrow_schema
        own = self._backend is None and self._stream is None
        backend = self._backend or make_backend(cfg.backend, self.resolved.info, self.layers,
                                                options=cfg.backend_options, trust_remote_code=cfg.trust_remote_code)
        cols = state_columns(self.layers)
        R, long_rows, teacher = self.resolved.row_tokens, self.resolved.long_rows, bool(self.resolved.teacher_k)
        self.state_columns = tuple(stored_state_columns(self.layers, cfg.store_final))
        stats = StatsCollector(list(self.state_columns), self.resolved.info.hidden_size, cfg.max_length)
        i = 0
        partial: dict[str, int] = {}  # samples with rows written and more to come: their rows so far
        skipping: set[str] = set()  # samples rejected with more pieces to come
        try:
            for item in self._items(backend, start, stop):
                if isinstance(item, Reject):
                    if item.sample_id in partial:
                        self._drop(item.sample_id, partial.pop(item.sample_id))
                    skipping.discard(item.sample_id)
                    self._reject(item)
                    continue
                sid = item.sample.sample_id
                if sid in skipping:
                    if item.last:
                        skipping.discard(sid)
                    del item  # the loop variable would keep the piece's ring rows while the next one is awaited
                    continue
                try:
                    rows = [(encode_row(p, cfg.storage_dtype, long_rows=long_rows, store_final=cfg.store_final,
                                        teacher=teacher), p.value_stats) for p in row_pieces(item, R)]
                except SampleError as e:
                    if cfg.on_nonfinite == "fail" and e.field in cols:
                        raise NonFiniteError(
                            f"sample {sid!r}, {e.field}: {e.reason}. The build stopped; run "
                            "the same command with --set on_nonfinite=reject (--on-nonfinite reject) to write such "
                            "samples to rejects.jsonl instead: it resumes this build") from None
                    if sid in partial:
                        self._drop(sid, partial.pop(sid))
                    if not item.last:
                        skipping.add(sid)
                    self._reject(Reject(sid, e.field, e.reason, "encode"))
                    del item
                    continue
                n_rows = len(rows)
                self.counts.rows_written += n_rows
                while rows:  # each row's dict dropped once written (and counted): it views the ring
                    row, counted = rows.pop(0)
                    stats.add(row, counted)  # counted by the backend, or on a worker thread while the row is written
                    table = row_table(row, schema)
                    if self._on_table is not None:
                        self._on_table(i, sid, table)
                    yield Key(0, i), table
                    del row, table
                    i += 1
                if item.last:
                    partial.pop(sid, None)
                    self.counts.written += 1
                    self.counts.tokens_written += item.sample.num_tokens
                else:
                    partial[sid] = partial.get(sid, 0) + n_rows
                if self._on_row is not None:
                    self._on_row(item.num_positions, item.states.numel() * item.states.element_size())
                del rows, item  # a windowed region's piece is released once nothing references it
            self.statistics = stats.result()
        finally:
            stats.close()
            if own:
                backend.close()
        if partial:
            raise RuntimeError(f"samples {sorted(partial)[:3]} ended before their last piece; this is a bug in hs_dataset")
        self.counts.check()

    def _drop(self, sample_id: str, rows: int) -> None:
        """A sample rejected after ``rows`` of its rows were written: they leave the part before its commit."""
        self.dropped.add(sample_id)
        self.counts.rows_written -= rows



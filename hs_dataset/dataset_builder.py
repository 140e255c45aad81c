"""The ``datasets`` builder: source -> tokenize+mask -> capture backend -> encode -> Arrow rows.

``HiddenStatesBuilder`` is a real :class:`datasets.ArrowBasedBuilder`. Since datasets 4.0
removed loading scripts, it is not loaded by name: ``hs-dataset build`` (the shard writer,
:mod:`hs_dataset.shard_writer`) runs ``download_and_prepare`` once per *part* (a fixed range of
source rows, the unit of resume) and publishes plain Arrow shards that load with
``load_dataset(dir)``. It can also be used directly::

    builder = HiddenStatesBuilder(config=HiddenStatesConfig(model=..., source=..., layers=(1, 2)))
    builder.download_and_prepare("out_dir", file_format="arrow")
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Callable, Iterator

import datasets
import numpy as np
import pyarrow as pa
from datasets.builder import Key

from .backends import CaptureBackend, check_layers, make_backend, read_model_info
from .backends.base import BackendItem, start_capture
from .config import HiddenStatesConfig
from .conversations import parse_row
from .encode import bytes_per_token, encode_row, make_features
from .errors import ConfigError, NonFiniteError, SampleError
from .layout import state_columns
from .records import Conversation, Counts, Reject, TokenizedSample
from .regenerate import GenerationOptions, messages_json, regenerate_conversations
from .sources import iter_source
from .tokenize_mask import load_tokenizer, tokenize_sample

__all__ = ["CaptureStream", "HiddenStatesBuilder", "HiddenStatesConfig", "row_table", "tokenized_samples"]

ARROW_MAX_ELEMENTS = 2**31 - 1  # Array2D's inner list offsets are 32-bit


def tokenized_samples(config: HiddenStatesConfig, backend: CaptureBackend, ranges: list[tuple[int | None, int | None]],
                      on_reject: Callable[[int, Reject], None]) -> Iterator[tuple[int, TokenizedSample]]:
    """Read, parse, (regenerate,) then tokenize and mask the source rows of ``ranges``: ``(row index, sample)``.

    A row that cannot be used goes to ``on_reject(row index, reject)`` instead (stage ``source``,
    ``regenerate`` or ``tokenize``). Token ids at or above the model's embedding rows are rejects
    too. With ``responses="regenerate"`` each range's conversations are regenerated together by
    ``backend.generate`` (:mod:`hs_dataset.regenerate`) before they are tokenized.
    """
    cfg = config
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    vocab = min(len(tokenizer), backend.info.vocab_size)

    def tokenized(index: int, sample_id: str, parsed: Conversation | TokenizedSample, stage: str):
        try:
            sample = tokenize_sample(parsed, tokenizer, max_length=cfg.max_length, mask=cfg.mask,
                                     truncation=cfg.truncation, vocab_size=vocab)
        except SampleError as e:
            on_reject(index, Reject(sample_id, e.field, e.reason, stage))
            return None
        if cfg.responses == "regenerate":
            sample.messages = messages_json(parsed)  # type: ignore[arg-type]
        return sample

    for start, stop in ranges:
        parsed_rows: list[tuple[int, str, Conversation | TokenizedSample]] = []
        for row in iter_source(cfg.source, start=start or 0, stop=stop, sample_id=cfg.sample_id):
            try:
                parsed = parse_row(row)
            except SampleError as e:
                on_reject(row.index, Reject(row.sample_id, e.field, e.reason, "source"))
                continue
            if cfg.responses == "source":
                sample = tokenized(row.index, row.sample_id, parsed, "tokenize")
                if sample is not None:
                    yield row.index, sample
            elif not isinstance(parsed, Conversation):
                on_reject(row.index, Reject(row.sample_id, "input_ids", "already tokenized rows have no replies to "
                                            "regenerate (responses=regenerate needs conversations)", "regenerate"))
            else:
                parsed_rows.append((row.index, row.sample_id, parsed))
        if parsed_rows:
            yield from _regenerated(parsed_rows, tokenizer, backend, cfg, on_reject, tokenized)


def _regenerated(rows: list[tuple[int, str, Conversation]], tokenizer, backend: CaptureBackend,
                 cfg: HiddenStatesConfig, on_reject: Callable[[int, Reject], None],
                 tokenized: Callable[..., TokenizedSample | None]) -> Iterator[tuple[int, TokenizedSample]]:
    if not hasattr(backend, "generate"):
        raise ConfigError(f"responses=regenerate: the {backend.name} backend cannot generate (use the transformers "
                          "or sglang backend, without isolate)")
    options = GenerationOptions.from_config(cfg.generation)
    convs = regenerate_conversations([c for _, _, c in rows], tokenizer, backend, options, cfg.max_length)
    for (index, sample_id, _), conv in zip(rows, convs):
        if isinstance(conv, SampleError):
            on_reject(index, Reject(sample_id, conv.field, conv.reason, "regenerate"))
            continue
        sample = tokenized(index, sample_id, conv, "tokenize")
        if sample is not None:
            yield index, sample


def _arrow_values(a: np.ndarray) -> pa.Array:
    """Zero-copy Arrow view of a contiguous 1-D numpy array (the buffer keeps ``a`` alive)."""
    a = np.ascontiguousarray(a).reshape(-1)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [None, pa.py_buffer(a)])


def _one_row_list(values: pa.Array, type_: pa.DataType | None = None) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values, type=type_)


def row_table(row: dict[str, Any], schema: pa.Schema) -> pa.Table:
    """One encoded row (see :func:`~hs_dataset.encode.encode_row`) as a one-row Arrow table of ``schema``.

    Hidden-state columns are wrapped **without copying** their bytes: the table's buffers are the
    backend's tensors. ``datasets``' own path (``Features.encode_example`` + ``TypedSequence``) copies
    every ``Array2D`` value three times (``np.array``, ``flatten``, ``concat_arrays``), which at
    Kimi scale (117 MB per sample) costs as much as writing the bytes to disk.
    """
    arrays = []
    for col in schema:
        v = row[col.name]
        t = col.type
        if isinstance(t, pa.ExtensionType):  # Array2D(shape=(None, H)): list<list<bits>>
            n, h = v.shape
            inner = pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * h, h, dtype=np.int32)),
                                             _arrow_values(v))
            arrays.append(pa.ExtensionArray.from_storage(t, _one_row_list(inner)))
        elif pa.types.is_list(t):
            arrays.append(_one_row_list(_arrow_values(np.asarray(v, dtype=t.value_type.to_pandas_dtype())), t))
        else:
            arrays.append(pa.array([v], t))
    return pa.Table.from_arrays(arrays, schema=schema)


class HiddenStatesBuilder(datasets.ArrowBasedBuilder):
    """Builds one row per sample: id, input_ids, loss_mask, num_tokens, one column per layer, final.

    An ``ArrowBasedBuilder``: rows are handed to the writer as Arrow tables that wrap the captured
    states without copying them (see :func:`row_table`).

    Args:
        config: the build configuration.
        part: the source rows ``(start, stop)`` to build (default: the whole source, up to ``max_samples``).
        backend: an already started capture backend to use (it is not closed); default: one is
            started from the config and closed at the end of generation.
        stream: a :class:`CaptureStream` serving this part (continuously batching backends).
        on_row: called after every written row with ``(num_tokens, payload_bytes)`` (progress).
    """

    BUILDER_CONFIG_CLASS = HiddenStatesConfig
    config: HiddenStatesConfig

    def __init__(self, *args, config: HiddenStatesConfig | None = None, part: tuple[int, int] | None = None,
                 backend: CaptureBackend | None = None, on_row: Callable[[int, int], None] | None = None,
                 stream: "CaptureStream | None" = None, **kwargs):
        if config is not None:  # datasets >= 4 builders take config fields as keyword arguments
            kwargs.update({f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                           if f.name not in ("version", "data_dir", "data_files", "description")})
        self._part = part
        self._backend = backend
        self._on_row = on_row
        self._stream = stream
        self.counts = Counts()
        self.rejects: list[Reject] = []
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.model_info = backend.info if backend is not None else read_model_info(cfg.model, cfg.model_revision)
        self.layers = check_layers(cfg.layers, self.model_info)
        n_states = len(self.layers) + 1
        row_bytes = cfg.max_length * bytes_per_token(n_states, self.model_info.hidden_size, cfg.storage_dtype)
        by_bytes = cfg.writer_batch_bytes // max(row_bytes, 1)
        by_offsets = ARROW_MAX_ELEMENTS // (cfg.max_length * self.model_info.hidden_size)
        # Rows per Arrow record batch, sized by bytes: memory stays bounded and 32-bit offsets never overflow.
        self._writer_batch_size = max(1, min(by_bytes, by_offsets, 1000))

    def _info(self) -> datasets.DatasetInfo:
        info = read_model_info(self.config.model, self.config.model_revision)
        layers = check_layers(self.config.layers, info)
        return datasets.DatasetInfo(
            description=f"Hidden states of {info.architecture} ({info.path}) for EAGLE-3 drafter training",
            features=make_features(layers, info.hidden_size, self.config.storage_dtype,
                                   messages=self.config.responses == "regenerate"),
        )

    def _split_generators(self, dl_manager) -> list[datasets.SplitGenerator]:
        start, stop = self._part if self._part is not None else (0, self.config.max_samples)
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
                self.counts.samples_in += 1
                yield item
            return

        def counted() -> Iterator[TokenizedSample]:
            def reject(_index: int, r: Reject) -> None:
                self.counts.samples_in += 1
                self._reject(r)

            for _, sample in tokenized_samples(self.config, backend, [(start, stop)], reject):
                self.counts.samples_in += 1
                yield sample

        yield from start_capture(backend, counted(), self.config.storage_dtype)

    def _generate_tables(self, start: int, stop: int | None):
        cfg = self.config
        schema = self.info.features.arrow_schema
        own = self._backend is None and self._stream is None
        backend = self._backend or make_backend(cfg.backend, cfg.model, self.layers, revision=cfg.model_revision,
                                                options=cfg.backend_options, trust_remote_code=cfg.trust_remote_code)
        cols = state_columns(self.layers)
        i = 0
        try:
            for item in self._items(backend, start, stop):
                if isinstance(item, Reject):
                    self._reject(item)
                    continue
                try:
                    row = encode_row(item, cfg.storage_dtype)
                except SampleError as e:
                    if cfg.on_nonfinite == "fail" and e.field in cols:
                        raise NonFiniteError(
                            f"sample {item.sample.sample_id!r}, {e.field}: {e.reason}. The build stopped; run "
                            "the same command with --set on_nonfinite=reject (--on-nonfinite reject) to write such "
                            "samples to rejects.jsonl instead: it resumes this build") from None
                    self._reject(Reject(item.sample.sample_id, e.field, e.reason, "encode"))
                    continue
                self.counts.written += 1
                self.counts.tokens_written += item.sample.num_tokens
                yield Key(0, i), row_table(row, schema)
                i += 1
                if self._on_row is not None:
                    self._on_row(item.sample.num_tokens, item.states.numel() * item.states.element_size())
        finally:
            if own:
                backend.close()
        self.counts.check()


class CaptureStream:
    """One ``backend.capture`` call over the source rows of several parts, consumed part by part.

    With an engine that batches continuously (SGLang), building each part with its own
    ``capture`` call drains the engine at every part boundary: the last rows of a part are written
    while the GPU waits for the next part's first requests. A stream keeps the next part's rows in
    flight instead. ``take(start, stop)`` yields one item per source row of ``[start, stop)``, in
    row order: the backend's result, or a :class:`Reject` (from the source, tokenization or the backend).
    """

    def __init__(self, config: HiddenStatesConfig, backend: CaptureBackend, ranges: list[tuple[int, int]]):
        self._order: deque[int] = deque()  # source row index of every submitted sample, in order
        self._early_rejects: dict[int, Reject] = {}

        def samples() -> Iterator[TokenizedSample]:
            for index, sample in tokenized_samples(config, backend, list(ranges), self._early_rejects.__setitem__):
                self._order.append(index)
                yield sample

        self._it = start_capture(backend, samples(), config.storage_dtype)
        self._next: tuple[int, BackendItem] | None = None

    def take(self, start: int, stop: int) -> Iterator[BackendItem]:
        while True:
            if self._next is None:
                item = next(self._it, None)  # tokenizes (and records rejects of) every row before it
                if item is not None:
                    self._next = (self._order.popleft(), item)
            bound = stop if self._next is None else min(self._next[0], stop)
            for idx in sorted(k for k in self._early_rejects if start <= k < bound):
                yield self._early_rejects.pop(idx)
            if self._next is None or self._next[0] >= stop:
                return
            item = self._next[1]
            self._next = None
            yield item

    def close(self) -> None:
        self._it.close()

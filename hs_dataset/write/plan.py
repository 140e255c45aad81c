"""A build's plan, made without running the model: ``hs-dataset plan`` (or ``build --dry-run``).

:func:`plan_build` reads and tokenizes the source exactly as the build will (the same
:func:`hs_dataset.prepare.samples.tokenized_samples`: parsing, chat template, loss mask, truncation,
rejects), reads only the model's ``config.json``, and counts per part: samples, tokens, loss-mask
tokens, rejects. From that follow the bytes on disk (:func:`hs_dataset.codec.encode.bytes_per_token` for
each storage dtype) and a time estimate at a stated prefill rate. The tokenizing runs in the build's
tokenize workers (``tokenize_workers``, :mod:`hs_dataset.prepare.workers`); ``sample=N`` tokenizes only
N rows, in blocks spread over the source (:func:`sample_ranges`), and scales the counts up: an estimate.

Measured rates (:data:`MEASURED_RATES`) are one H200's, with SGLang 0.5.17, for two model shapes
(README "GPU tests and benchmarks"); for another depth at the same width the rate is scaled by
depth (prefill cost per token grows about linearly with the number of layers), which is an estimate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import get_args

from hs_dataset.write.progress import RowProgress
from hs_dataset.write.resolve import resolve_build, start_tokenize_workers
from hs_dataset.capture.options import check_backend_options
from hs_dataset.codec.encode import bytes_per_token
from hs_dataset.config import GenerationOptions, HiddenStatesConfig
from hs_dataset.layout import StorageDtype, part_ranges
from hs_dataset.model_info import ModelInfo
from hs_dataset.prepare.duplicates import DuplicateIndex, duplicate_reject, token_digests
from hs_dataset.prepare.samples import tokenized_samples
from hs_dataset.prepare.tags import MODE_TAG, count_tags
from hs_dataset.prepare.thinking import sample_mode
from hs_dataset.records import Reject

__all__ = ["MEASURED_RATES", "SAMPLE_BLOCKS", "BuildPlan", "MeasuredRate", "ROW_BYTES_PER_TOKEN", "estimate_rate",
           "plan_build", "rate_for", "sample_ranges"]

ROW_BYTES_PER_TOKEN = 5  # input_ids (int32) + loss_mask (uint8), besides the states
SAMPLE_BLOCKS = 16  # a sample is read in this many blocks of consecutive rows, spread over the source


@dataclass(frozen=True)
class MeasuredRate:
    """A measured plain-prefill rate of one GPU for one model shape."""

    gpu: str
    shape: str
    hidden_size: int
    num_layers: int
    tokens_per_second: float


MEASURED_RATES = (
    MeasuredRate("H200", "DeepSeek-V3 architecture at Kimi-K2.5's width (hidden 7168, 6 layers, 8 experts)",
                 7168, 6, 119_702),
    MeasuredRate("H200", "8B-shaped Llama (hidden 4096, 32 layers)", 4096, 32, 39_965),
)


def estimate_rate(info: ModelInfo) -> tuple[float, MeasuredRate] | None:
    """The measured rate of the shape with ``info``'s width, scaled to its depth; None for other widths."""
    return rate_for(info.hidden_size, info.num_layers)


def rate_for(hidden_size: int, num_layers: int) -> tuple[float, MeasuredRate] | None:
    """:func:`estimate_rate` for a model of this width and depth."""
    for r in MEASURED_RATES:
        if r.hidden_size == hidden_size:
            return r.tokens_per_second * r.num_layers / num_layers, r
    return None


@dataclass
class BuildPlan:
    """What a build of ``config`` would read, write and cost (see the module docstring)."""

    config: HiddenStatesConfig
    info: ModelInfo
    layers: tuple[int, ...]
    source_rows: int  # rows in the source
    rows: int  # rows the build reads (max_samples applied)
    lengths: list[int] = field(default_factory=list)  # tokens of each usable sample, in row order
    masked_tokens: int = 0
    truncated: int = 0
    rejects: list[Reject] = field(default_factory=list)
    part_samples: list[int] = field(default_factory=list)
    part_tokens: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sampled: int | None = None  # with a sample: the rows tokenized (the counts above are theirs)
    duplicates: DuplicateIndex = field(default_factory=DuplicateIndex)  # samples repeating an earlier one's tokens
    tag_counts: dict[str, dict] = field(default_factory=dict)  # {tag column: {value: samples}} (tags, thinking modes)

    @property
    def tokens(self) -> int:
        """Tokens of the samples tokenized (with a sample: of the sample only)."""
        return sum(self.lengths)

    @property
    def scale(self) -> float:
        """Rows of the build per row tokenized: 1, or more for a sample."""
        return self.rows / self.sampled if self.sampled else 1.0

    @property
    def build_tokens(self) -> int:
        """Tokens the build would write: :attr:`tokens`, scaled up for a sample (an estimate)."""
        return round(self.tokens * self.scale)

    @property
    def n_states(self) -> int:
        return len(self.layers) + 1

    def bytes_per_token(self, storage_dtype: StorageDtype) -> int:
        """Bytes on disk per token (states + input_ids + loss_mask; Arrow framing not counted)."""
        return bytes_per_token(self.n_states, self.info.hidden_size, storage_dtype) + ROW_BYTES_PER_TOKEN

    def bytes_on_disk(self) -> dict[StorageDtype, int]:
        """``{storage_dtype: bytes}`` for every storage dtype."""
        return {d: self.build_tokens * self.bytes_per_token(d) for d in get_args(StorageDtype)}


def sample_ranges(rows: int, n: int, blocks: int = SAMPLE_BLOCKS) -> list[tuple[int, int]]:
    """About ``n`` of ``rows`` rows as ``(start, stop)`` blocks of consecutive rows, one at the start of each
    of ``blocks`` equal stretches of the source (all rows when ``n >= rows``)."""
    if n >= rows:
        return [(0, rows)]
    k = max(1, min(blocks, n))
    out = []
    for b in range(k):
        start, end = b * rows // k, (b + 1) * rows // k
        length = n // k + (b < n % k)
        if end > start and length:
            out.append((start, start + min(length, end - start)))
    return out


def plan_build(config: HiddenStatesConfig, *, sample: int | None = None, progress: bool = False) -> BuildPlan:
    """Read and tokenize the source of ``config`` as a build would, without loading the model.

    With ``responses=regenerate`` the source's own replies are tokenized instead (the model writes
    the real ones); the plan says so in ``notes``.

    Args:
        config: the build's configuration.
        sample: tokenize only about this many rows (:func:`sample_ranges`) and scale the counts up.
        progress: show the rows tokenized (a bar on a terminal, a line per tenth in a log:
            :class:`~hs_dataset.write.progress.RowProgress`).

    Raises:
        ConfigError: a bad layer, backend option, source, tokenizer... (what the build would refuse).
        TokenizeWorkerError: a tokenize worker died.
    """
    resolved = resolve_build(config)
    info, layers = resolved.info, resolved.layers
    check_backend_options(config.backend, dict(config.backend_options, trust_remote_code=config.trust_remote_code))
    source = resolved.source
    assert source is not None, "resolved with its source (resolve_build)"
    source_rows, rows = source.rows, source.rows_to_build(config.max_samples)
    ranges = part_ranges(rows, config.part_size)
    n_parts = len(ranges)
    plan = BuildPlan(config, info, layers, source_rows, rows, part_samples=[0] * n_parts, part_tokens=[0] * n_parts)
    cfg = config
    if config.responses == "regenerate":
        cfg = dataclasses.replace(config, responses="source", generation={})
        plan.notes.append("responses=regenerate: the model writes the replies; these counts tokenize the "
                          "source's own replies instead (prompt lengths are exact, reply lengths are not)")
    if rows == 0:
        return plan
    gen = GenerationOptions.from_config(config.generation if config.responses == "regenerate" else {})

    blocks = [(s, e) for _, s, e in ranges] if sample is None else sample_ranges(rows, sample)
    n_read = sum(e - s for s, e in blocks)
    if sample is not None and blocks != [(0, rows)]:
        plan.sampled = n_read
    read: list[tuple[int, int | None]] = list(blocks)
    bar = RowProgress(n_read, progress)

    def reject(_index: int, r: Reject) -> None:
        plan.rejects.append(r)
        bar.row(0)

    workers = start_tokenize_workers(dataclasses.replace(resolved, config=cfg), n_read)
    with workers if workers is not None else contextlib.nullcontext(), contextlib.closing(bar):
        for index, one in tokenized_samples(source, cfg, resolved.tokenizer, resolved.vocab_size, read, reject,
                                            workers=workers):
            bar.row(one.num_tokens)
            dup = plan.duplicates.add(index, one.sample_id, token_digests(one.input_ids, one.loss_mask),
                                      one.num_tokens)
            if dup is not None and dup.same_mask and config.duplicates == "skip":  # as the build will
                plan.rejects.append(duplicate_reject(one.sample_id, dup.first_id))
                continue
            p = index // config.part_size
            plan.lengths.append(one.num_tokens)
            plan.masked_tokens += int(one.loss_mask.sum())
            plan.truncated += bool(one.truncated)
            plan.part_samples[p] += 1
            plan.part_tokens[p] += one.num_tokens
            if one.tags is not None or gen.thinking_set:  # a regenerate build's mode: the one it will write in
                count_tags(plan.tag_counts, {**(one.tags or {}), **(
                    {MODE_TAG: sample_mode(gen, one.sample_id)} if config.responses == "regenerate" else {})})
    return plan

"""A build's plan, made without running the model: ``hs-dataset plan`` (or ``build --dry-run``).

:func:`plan_build` reads and tokenizes the source exactly as the build will (the same
:func:`hs_dataset.prepare.samples.tokenized_samples`: parsing, chat template, loss mask, truncation,
rejects), reads only the model's ``config.json``, and counts per part: samples, tokens, loss-mask
tokens, rejects. From that follow the bytes on disk (:func:`hs_dataset.codec.encode.bytes_per_token` for
each storage dtype) and a time estimate at a stated prefill rate.

Measured rates (:data:`MEASURED_RATES`) are one H200's, with SGLang 0.5.17, for two model shapes
(README "GPU tests and benchmarks"); for another depth at the same width the rate is scaled by
depth (prefill cost per token grows about linearly with the number of layers), which is an estimate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import get_args

from hs_dataset.write.resolve import resolve_build
from hs_dataset.write.resume import part_ranges
from hs_dataset.capture.options import check_backend_options
from hs_dataset.codec.encode import bytes_per_token
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo
from hs_dataset.prepare.duplicates import DuplicateIndex, duplicate_reject, token_digests
from hs_dataset.prepare.samples import tokenized_samples
from hs_dataset.prepare.source_spec import count_rows
from hs_dataset.records import Reject

__all__ = ["MEASURED_RATES", "BuildPlan", "MeasuredRate", "ROW_BYTES_PER_TOKEN", "estimate_rate", "plan_build",
           "rate_for"]

ROW_BYTES_PER_TOKEN = 5  # input_ids (int32) + loss_mask (uint8), besides the states


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
    duplicates: DuplicateIndex = field(default_factory=DuplicateIndex)  # samples repeating an earlier one's tokens

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def n_states(self) -> int:
        return len(self.layers) + 1

    def bytes_per_token(self, storage_dtype: StorageDtype) -> int:
        """Bytes on disk per token (states + input_ids + loss_mask; Arrow framing not counted)."""
        return bytes_per_token(self.n_states, self.info.hidden_size, storage_dtype) + ROW_BYTES_PER_TOKEN

    def bytes_on_disk(self) -> dict[StorageDtype, int]:
        """``{storage_dtype: bytes}`` for every storage dtype."""
        return {d: self.tokens * self.bytes_per_token(d) for d in get_args(StorageDtype)}


def plan_build(config: HiddenStatesConfig) -> BuildPlan:
    """Read and tokenize the source of ``config`` as a build would, without loading the model.

    With ``responses=regenerate`` the source's own replies are tokenized instead (the model writes
    the real ones); the plan says so in ``notes``.

    Raises:
        ConfigError: a bad layer, backend option, source, tokenizer... (what the build would refuse).
    """
    resolved = resolve_build(config)
    info, layers = resolved.info, resolved.layers
    check_backend_options(config.backend, dict(config.backend_options, trust_remote_code=config.trust_remote_code))
    source_rows = count_rows(config.source)
    rows = source_rows if config.max_samples is None else min(source_rows, config.max_samples)  # as rows_to_build
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

    def reject(_index: int, r: Reject) -> None:
        plan.rejects.append(r)

    for index, sample in tokenized_samples(cfg, resolved.tokenizer, resolved.vocab_size,
                                           [(s, e) for _, s, e in ranges], reject):
        dup = plan.duplicates.add(index, sample.sample_id, token_digests(sample.input_ids, sample.loss_mask),
                                  sample.num_tokens)
        if dup is not None and dup.same_mask and config.duplicates == "skip":  # as the build will
            plan.rejects.append(duplicate_reject(sample.sample_id, dup.first_id))
            continue
        p = index // config.part_size
        plan.lengths.append(sample.num_tokens)
        plan.masked_tokens += int(sample.loss_mask.sum())
        plan.truncated += bool(sample.truncated)
        plan.part_samples[p] += 1
        plan.part_tokens[p] += sample.num_tokens
    return plan

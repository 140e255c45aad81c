"""One source row through the prepare stage (``responses="source"``): parsed, tokenized, masked, or its
reject. The serial path (:func:`hs_dataset.prepare.samples.tokenized_samples`) and the tokenize workers
(:mod:`hs_dataset.prepare.workers`) run this same function, so their samples and rejects are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import SampleError
from hs_dataset.layout import MaskMode, TruncationMode
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.loss_mask import tokenize_sample
from hs_dataset.prepare.tags import set_tags, source_tags, user_columns
from hs_dataset.records import Reject, SourceRow, TokenizedSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TokenizeRules", "prepare_row"]


@dataclass(frozen=True)
class TokenizeRules:
    """How a conversation becomes tokens (the configuration's ``max_length``, ``mask``, ``truncation``) and the
    vocabulary its ids must fit (``vocab_size``: the smaller of the tokenizer's and the model's)."""

    max_length: int
    mask: MaskMode
    truncation: TruncationMode
    vocab_size: int
    tags: bool = False  # tag columns (hs_dataset.prepare.tags): the source's name, the user's columns
    source: str = ""
    tag_columns: tuple[str, ...] = field(default=())

    @classmethod
    def of(cls, config: HiddenStatesConfig, vocab_size: int, source_name: str) -> "TokenizeRules":
        """The rules of a build of ``config`` from the source named ``source_name`` (its sample ids' prefix)."""
        return cls(config.max_length, config.mask, config.truncation, int(vocab_size), config.tags,
                   source_name if config.tags else "", tuple(user_columns(config.tag_columns)))


def prepare_row(row: SourceRow, tokenizer: PreTrainedTokenizerBase, rules: TokenizeRules) -> TokenizedSample | Reject:
    """One source row parsed, tokenized and masked (``responses="source"``), or its reject (stage ``source``
    or ``tokenize``)."""
    try:
        parsed = parse_row(row)
    except SampleError as e:
        return Reject(row.sample_id, e.field, e.reason, "source")
    try:
        sample = tokenize_sample(parsed, tokenizer, max_length=rules.max_length, mask=rules.mask,
                                 truncation=rules.truncation, vocab_size=rules.vocab_size)
    except SampleError as e:
        return Reject(row.sample_id, e.field, e.reason, "tokenize")
    if rules.tags:
        set_tags(sample, source_tags(row, rules.source, parsed, list(rules.tag_columns)), "source")
    return sample

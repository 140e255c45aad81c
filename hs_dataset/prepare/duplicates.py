"""Duplicate prompts: samples whose token ids (and loss mask) repeat an earlier sample's, found before capture.

Two samples with the same token ids get the same hidden states, so the second one costs its GPU time
again for nothing new; with the same loss mask too, the two rows are identical. Each sample is keyed
by two xxh3-64 digests (:func:`token_digests`): of its token ids, and of its ids and mask together.
The *first* sample with a key (the lowest source row) is the original; every later one is a duplicate
of it.

``duplicates`` in the build configuration decides what happens to the exact duplicates (same ids
and mask): ``keep`` (the default: they are captured again, counted and named in ``hs_dataset.json``)
or ``skip`` (each becomes a reject of stage ``duplicate`` naming its original, so samples in =
written + rejected still holds). ``skip`` needs the duplicates of the whole source before the first
part is captured, so that a resumed or split build skips the same rows: :func:`find_duplicates`
tokenizes the source once (as ``hs-dataset plan`` does) and the build keeps the result in
``.hs_build/duplicates.json``. Samples with the same ids but another mask are never skipped (their
rows differ); they are counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

import numpy as np
import xxhash

from hs_dataset.atomic import atomic_write
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.layout import DUPLICATE_STAGE, DUPLICATES_FILE
from hs_dataset.prepare.samples import tokenized_samples
from hs_dataset.prepare.source_spec import Source
from hs_dataset.records import Reject, TokenizedSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Duplicate", "DuplicateIndex", "duplicate_reject", "find_duplicates",
           "load_skipped", "skip_duplicates", "token_digests"]



def token_digests(input_ids: np.ndarray, loss_mask: np.ndarray) -> tuple[str, str]:
    """(xxh3-64 of the token ids as int32, xxh3-64 of the ids and the mask as uint8), in hex."""
    ids = np.ascontiguousarray(input_ids, dtype=np.int32)
    h = xxhash.xxh3_64(ids.tobytes())
    ids_digest = h.hexdigest()
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    return ids_digest, h.hexdigest()


@dataclass(frozen=True)
class Duplicate:
    """A sample that repeats an earlier one: its row and id, the original's, whether the mask is the same too."""

    row: int
    sample_id: str
    first_row: int
    first_id: str
    same_mask: bool
    tokens: int


@dataclass
class DuplicateIndex:
    """The first row of every token key seen so far; :meth:`add` names the duplicates, in row order."""

    _ids: dict[str, tuple[int, str]] = field(default_factory=dict)
    _rows: dict[str, tuple[int, str]] = field(default_factory=dict)
    found: list[Duplicate] = field(default_factory=list)

    def add(self, row: int, sample_id: str, digests: tuple[str, str], tokens: int) -> Duplicate | None:
        """Record a sample (``digests`` from :func:`token_digests`); -> the :class:`Duplicate` it is, or None."""
        ids_digest, row_digest = digests
        first = self._rows.get(row_digest)
        same_mask = first is not None
        first = first or self._ids.get(ids_digest)
        self._ids.setdefault(ids_digest, (row, sample_id))
        self._rows.setdefault(row_digest, (row, sample_id))
        if first is None:
            return None
        dup = Duplicate(row, sample_id, first[0], first[1], same_mask, tokens)
        self.found.append(dup)
        return dup

    @property
    def same_ids(self) -> int:
        """Samples whose token ids repeat an earlier sample's (their states are the same)."""
        return len(self.found)

    @property
    def same_rows(self) -> int:
        """Of those, the ones with the same loss mask too (identical rows)."""
        return sum(d.same_mask for d in self.found)

    @property
    def tokens(self) -> int:
        """Tokens of the duplicates (what capturing them again costs)."""
        return sum(d.tokens for d in self.found)


def duplicate_reject(sample_id: str, first_id: str) -> Reject:
    """The reject of an exact duplicate that ``duplicates=skip`` leaves out."""
    return Reject(sample_id, "input_ids", f"the same token ids and loss mask as {first_id} (duplicates=skip)",
                  DUPLICATE_STAGE)


def find_duplicates(source: Source, config: HiddenStatesConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                    ranges: list[tuple[int, int | None]]) -> DuplicateIndex:
    """Tokenize the source rows of ``ranges`` as the build will and index their token keys (no model)."""
    index = DuplicateIndex()
    for row, sample in tokenized_samples(source, config, tokenizer, vocab_size, ranges, lambda _i, _r: None):
        index.add(row, sample.sample_id, token_digests(sample.input_ids, sample.loss_mask), sample.num_tokens)
    return index


def load_skipped(state: Path, source: Source, config: HiddenStatesConfig, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 rows: int) -> dict[int, str]:
    """``{row: original's id}`` of the exact duplicates among the first ``rows`` source rows, which
    ``duplicates=skip`` leaves out: read from ``state/duplicates.json``, or found (:func:`find_duplicates`)
    and kept there. (A resumed build has the configuration and source of the one that wrote it.)"""
    path = state / DUPLICATES_FILE
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("rows") == rows:
            return {int(k): str(v) for k, v in kept["skip"].items()}
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    index = find_duplicates(source, config, tokenizer, vocab_size, [(0, rows)])
    skip = {d.row: d.first_id for d in index.found if d.same_mask}
    atomic_write(path, json.dumps({"rows": rows, "skip": {str(k): v for k, v in sorted(skip.items())}}))
    return skip


def skip_duplicates(samples: Iterable[tuple[int, TokenizedSample]], skip: Mapping[int, str],
                    on_reject: Callable[[int, Reject], None], on_kept: Callable[[int], None]) -> Iterator[TokenizedSample]:
    """The samples a capture takes: the ``(row, sample)`` stream of
    :func:`~hs_dataset.prepare.samples.tokenized_samples` without the rows in ``skip`` (each goes to ``on_reject`` as a
    reject of stage :data:`DUPLICATE_STAGE`); each kept sample's row goes to ``on_kept`` before it is yielded."""
    for row, sample in samples:
        first = skip.get(row)
        if first is None:
            on_kept(row)
            yield sample
        else:
            on_reject(row, duplicate_reject(sample.sample_id, first))

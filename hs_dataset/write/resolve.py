"""Resolve once, pass down: one build's configuration with the model read, the layers checked, the
tokenizer loaded and the source resolved, made once at the start of a build and handed to the builder, the
backend, the plan and the final step (none of them reads ``config.json``, loads the tokenizer or parses the
source string again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hs_dataset.codec.limits import max_row_tokens
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.layout import StorageDtype, parse_teacher
from hs_dataset.model_info import ModelInfo, check_layers, read_model_info
from hs_dataset.prepare.duplicates import load_skipped
from hs_dataset.prepare.source_spec import Source, resolve_source
from hs_dataset.prepare.tokenizer import load_tokenizer, tokenizer_record
from hs_dataset.prepare.workers import TokenizeWorkers, tokenize_processes, tokenizer_identity

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ResolvedBuild", "resolve_build", "start_tokenize_workers"]


@dataclass(frozen=True)
class ResolvedBuild:
    """A build's configuration and what follows from it, checked once.

    Attributes:
        config: the configuration as given.
        info: the target model's sizes (its ``config.json``).
        layers: ``config.layers`` checked against ``info``.
        tokenizer: the target's tokenizer (``config.tokenizer`` or the model directory), loaded once.
        tokenizer_record: what ``hs_dataset.json`` records about it.
        duplicate_rows: with ``duplicates="skip"``, the source rows left out and their originals' ids
            (``{row: id}``, :func:`hs_dataset.prepare.duplicates.load_skipped`), when the build found them.
        given_source: the source as the caller resolved it (None: :attr:`source` resolves it on first use).
    """

    config: HiddenStatesConfig
    info: ModelInfo
    layers: tuple[int, ...]
    tokenizer: PreTrainedTokenizerBase
    tokenizer_record: dict[str, Any]
    duplicate_rows: Mapping[int, str] = field(default_factory=dict)
    given_source: Source | None = field(default=None, repr=False)

    @cached_property
    def source(self) -> Source:
        """The source, resolved once (kind, name, rows, fingerprint): the one given, else ``config.source``'s on
        first use (a probe or a merge resolves a build where the source need not be)."""
        return self.given_source or resolve_source(self.config.source)

    @property
    def storage_dtype(self) -> StorageDtype:
        return self.config.storage_dtype

    @property
    def n_states(self) -> int:
        """States per token: the layers and the final state."""
        return len(self.layers) + 1

    @property
    def row_tokens(self) -> int:
        """Positions per row at most: ``config.row_tokens``, lowered where one state of that many positions
        would pass Arrow's 32-bit list offsets (:func:`~hs_dataset.codec.encode.max_row_tokens`)."""
        return min(self.config.row_tokens, max_row_tokens(self.info.hidden_size))

    @property
    def long_rows(self) -> bool:
        """Whether a sample may span several rows (then rows carry ``token_start`` and ``sample_tokens``)."""
        return self.config.max_length > self.row_tokens

    @property
    def teacher_k(self) -> int:
        """K of ``teacher="topk:K"`` (0: no teacher)."""
        return parse_teacher(self.config.teacher)

    @property
    def vocab_size(self) -> int:
        """Token ids at or above this are rejects: the smaller of the tokenizer's and the model's rows."""
        return min(len(self.tokenizer), self.info.vocab_size)


def resolve_build(config: HiddenStatesConfig, *, info: ModelInfo | None = None, source: Source | None = None,
                  state: Path | None = None) -> ResolvedBuild:
    """Read the model's ``config.json`` (unless ``info`` is given: a started backend's), check the layers, load
    the tokenizer; with ``state`` and ``duplicates="skip"``, find the duplicates to leave out.

    Args:
        config: the build's configuration.
        info: the model as a started backend already read it.
        source: ``config.source`` resolved already (:func:`~hs_dataset.prepare.source_spec.resolve_source`).
        state: the build's state folder, where the duplicates found are kept
            (:func:`~hs_dataset.prepare.duplicates.load_skipped`; None: none are left out).

    Raises:
        MissingPathError: no ``config.json`` in the model directory.
        ConfigError: a bad layer id, or a tokenizer that cannot be used (the message names the fix).
    """
    info = info or read_model_info(config.model, config.model_revision)
    layers = check_layers(config.layers, info)
    path = config.tokenizer or config.model
    tokenizer = load_tokenizer(path, trust_remote_code=config.trust_remote_code)
    record = tokenizer_record(tokenizer, path, trust_remote_code=config.trust_remote_code)
    skip: dict[int, str] = {}
    if state is not None and config.duplicates == "skip":  # found before any capture, the same for every part
        source = source or resolve_source(config.source)
        skip = load_skipped(state, source, config, tokenizer, min(len(tokenizer), info.vocab_size),
                            source.rows_to_build(config.max_samples))
    return ResolvedBuild(config, info, layers, tokenizer, record, skip, source)


def start_tokenize_workers(resolved: ResolvedBuild, rows: int) -> TokenizeWorkers | None:
    """The tokenize workers for ``rows`` source rows of this build (``tokenize_workers``, see
    :func:`~hs_dataset.prepare.workers.tokenize_processes`), started; None: tokenize in this process (also
    with ``responses=regenerate``, whose replies are written by the backend). The caller closes them."""
    n = tokenize_processes(resolved.config.tokenize_workers, rows)
    if n == 0 or resolved.config.responses != "source":
        return None
    return TokenizeWorkers(n, resolved.tokenizer_record["path"], trust_remote_code=resolved.config.trust_remote_code,
                           identity=tokenizer_identity(resolved.tokenizer))

"""Resolve once, pass down: a build's configuration with the model read (sizes, weights' fingerprint), the layers
checked, the tokenizer loaded, the source resolved, and what the build records worked out (redacted): pure data, made
before anything is written and handed down (nothing below reads ``config.json``, loads the tokenizer, parses the
source string or redacts again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import logging
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hs_dataset.codec.limits import max_row_tokens
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.layout import StorageDtype, parse_teacher, part_ranges
from hs_dataset.model_info import ModelInfo, check_layers, read_model_info, weights_fingerprint
from hs_dataset.prepare.duplicates import load_skipped
from hs_dataset.prepare.source_spec import Source, resolve_source
from hs_dataset.prepare.tokenizer import load_tokenizer, tokenizer_record
from hs_dataset.prepare.workers import TokenizeWorkers, tokenize_processes, tokenizer_identity
from hs_dataset.redact import Found, redact, redact_command

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ResolvedBuild", "resolve_build", "start_tokenize_workers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedBuild:
    """A build's configuration and what follows from it, checked once.

    Attributes:
        config: the configuration as given.
        info: the target model's sizes (its ``config.json``).
        layers: ``config.layers`` checked against ``info``.
        tokenizer: the target's tokenizer (``config.tokenizer`` or the model directory), loaded once.
        tokenizer_record: what ``hs_dataset.json`` records about it.
        source: the source (kind, name, rows, fingerprint), resolved once; None: resolved without it (a probe,
            which may run where the source is not).
        state: the build's state folder, which keeps the duplicates found (:attr:`duplicate_rows`; None: a
            resolve that builds nothing, and leaves none out).
        key, rows, parts: with ``state``: the content key recorded in ``build.json`` (the configuration's, the
            source's and the weights' fingerprints, the model's sizes), the source rows read (at most
            ``max_samples``) and their parts (:func:`~hs_dataset.layout.part_ranges`).
        config_record, build_command: the configuration and the command line as recorded (redacted).
        secrets: the values redacted from both, whose salted digests the build keeps for push's scan.
    """

    config: HiddenStatesConfig
    info: ModelInfo
    layers: tuple[int, ...]
    tokenizer: PreTrainedTokenizerBase
    tokenizer_record: dict[str, Any]
    source: Source | None = field(default=None, repr=False)
    state: Path | None = None
    key: dict[str, Any] | None = field(default=None, repr=False)
    parts: list[tuple[int, int, int]] = field(default_factory=list, repr=False)
    rows: int = 0
    config_record: dict[str, Any] = field(default_factory=dict, repr=False)
    build_command: str | None = None
    secrets: Found = field(default_factory=list, repr=False)

    @cached_property
    def duplicate_rows(self) -> Mapping[int, str]:
        """With ``duplicates="skip"``, the source rows left out and their originals' ids (``{row: id}``): found
        once, before the first sample is captured, and kept in ``state/`` for every later part, run and worker
        (:func:`hs_dataset.prepare.duplicates.load_skipped`)."""
        if self.state is None or self.config.duplicates != "skip":
            return {}
        assert self.source is not None, "a build resolves its source"
        return load_skipped(self.state, self.source, self.config, self.tokenizer, self.vocab_size, self.rows)

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


def resolve_build(config: HiddenStatesConfig, *, info: ModelInfo | None = None, state: Path | None = None,
                  with_source: bool = True, build_command: str | None = None) -> ResolvedBuild:
    """Resolve the source (its string parsed once: :func:`~hs_dataset.prepare.source_spec.resolve_source`), load
    the tokenizer, read the model's ``config.json`` (unless ``info`` is given: a started backend's), check the layers;
    for a build (``state``), work out its content key (the source's fingerprint and the weights' read here).
    Without ``state`` the source's rows and fingerprint, and the duplicates, are worked out on first use.

    Args:
        config: the build's configuration.
        info: the model as a started backend already read it.
        state: the build's state folder ``OUT/.hs_build``: the source is refused inside ``OUT``, and the duplicates
            found are kept there (:attr:`ResolvedBuild.duplicate_rows`; None: no duplicate is left out).
        with_source: False: leave the source out (a probe, which may run where the source is not).
        build_command: the command line to record (redacted here).

    Raises:
        MissingPathError: no ``config.json`` in the model directory, or no source.
        ConfigError: a bad layer id, a tokenizer that cannot be used, an unsupported source (the message names the fix).
        ForeignFilesError: with ``state``, the source lies inside the output.
    """
    source = resolve_source(config.source) if with_source else None
    if source is not None and state is not None:  # a build owns its output: its source must not be in it
        source.check_outside(state.parent)
        if source.name_redacted:
            logger.warning("hs_dataset: the source's name looks like it holds a credential: its sample ids use %s "
                           "instead (hs_dataset.json says so)", source.name)
    info = info or read_model_info(config.model, config.model_revision)  # a wrong model path is the likelier mistake
    path = config.tokenizer or config.model
    tokenizer = load_tokenizer(path, trust_remote_code=config.trust_remote_code)
    record = tokenizer_record(tokenizer, path, trust_remote_code=config.trust_remote_code)
    layers = check_layers(config.layers, info)
    config_record, secrets = redact(config.to_dict())
    if build_command is not None:
        build_command, more = redact_command(build_command)
        secrets += more
    key, rows = None, 0
    if state is not None and source is not None:
        key = dict(config.content_key(), source_fingerprint=source.fingerprint, hidden_size=info.hidden_size,
                   num_layers=info.num_layers, model_weights=weights_fingerprint(info.path))
        key = redact(key)[0]  # local records hold no credential either
        rows = source.rows_to_build(config.max_samples)
    return ResolvedBuild(config, info, layers, tokenizer, record, source, state, key=key,
                         parts=part_ranges(rows, config.part_size), rows=rows, config_record=config_record,
                         build_command=build_command, secrets=secrets)


def start_tokenize_workers(resolved: ResolvedBuild, rows: int) -> TokenizeWorkers | None:
    """The tokenize workers for ``rows`` source rows of this build (``tokenize_workers``, see
    :func:`~hs_dataset.prepare.workers.tokenize_processes`), started; None: tokenize in this process (also
    with ``responses=regenerate``, whose replies are written by the backend). The caller closes them."""
    n = tokenize_processes(resolved.config.tokenize_workers, rows)
    if n == 0 or resolved.config.responses != "source":
        return None
    return TokenizeWorkers(n, resolved.tokenizer_record["path"], trust_remote_code=resolved.config.trust_remote_code,
                           identity=tokenizer_identity(resolved.tokenizer))

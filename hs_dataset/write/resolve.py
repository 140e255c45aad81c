"""Resolve once, pass down: one build's configuration with the model read, the layers checked and the
tokenizer loaded, made once at the start of a build and handed to the builder, the backend, the plan
and the final step (none of them reads ``config.json`` or loads the tokenizer again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo, check_layers, read_model_info
from hs_dataset.prepare.tokenizer import load_tokenizer, tokenizer_record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ResolvedBuild", "resolve_build"]


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
            (``{row: id}``, :func:`hs_dataset.prepare.duplicates.load_skipped`); set by the build driver.
    """

    config: HiddenStatesConfig
    info: ModelInfo
    layers: tuple[int, ...]
    tokenizer: PreTrainedTokenizerBase
    tokenizer_record: dict[str, Any]
    duplicate_rows: Mapping[int, str] = field(default_factory=dict)

    @property
    def storage_dtype(self) -> StorageDtype:
        return self.config.storage_dtype

    @property
    def n_states(self) -> int:
        """States per token: the layers and the final state."""
        return len(self.layers) + 1

    @property
    def vocab_size(self) -> int:
        """Token ids at or above this are rejects: the smaller of the tokenizer's and the model's rows."""
        return min(len(self.tokenizer), self.info.vocab_size)


def resolve_build(config: HiddenStatesConfig, *, info: ModelInfo | None = None) -> ResolvedBuild:
    """Read the model's ``config.json`` (unless ``info`` is given: a started backend's), check the layers,
    load the tokenizer.

    Args:
        config: the build's configuration.
        info: the model as a started backend already read it.

    Raises:
        MissingPathError: no ``config.json`` in the model directory.
        ConfigError: a bad layer id, or a tokenizer that cannot be used (the message names the fix).
    """
    info = info or read_model_info(config.model, config.model_revision)
    layers = check_layers(config.layers, info)
    path = config.tokenizer or config.model
    tokenizer = load_tokenizer(path, trust_remote_code=config.trust_remote_code)
    return ResolvedBuild(config, info, layers, tokenizer,
                         tokenizer_record(tokenizer, path, trust_remote_code=config.trust_remote_code))

"""The build configuration: one typed dataclass, documented field by field.

``HiddenStatesConfig`` is a :class:`datasets.BuilderConfig`. Its choice fields are typed
``Literal``s from :mod:`hs_dataset.layout`; each field's ``metadata["help"]`` is its one-line
documentation, from which ``hs-dataset build --help`` lists the fields (so the two cannot drift).
Fields in :data:`CONTENT_FIELDS` decide the rows: a resumed build refuses a change of any of them,
except ``on_nonfinite`` from ``fail`` to ``reject`` (:data:`hs_dataset.resume.RESUMABLE_CHANGES`:
parts written under ``fail`` hold no non-finite state). The others (``backend_options``,
``max_samples``, ``writer_batch_bytes``, ``max_shard_bytes``, ``trust_remote_code``) may change
between runs without changing a row already written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import datasets

from .errors import ConfigError
from .layout import (BACKENDS, FILE_FORMATS, MASK_MODES, NONFINITE_POLICIES, SAMPLE_ID_MODES, STORAGE_DTYPES,
                     TRUNCATION_MODES, FileFormat, MaskMode, NonfinitePolicy, SampleIdMode, StorageDtype,
                     TruncationMode)

__all__ = ["CHOICES", "CONTENT_FIELDS", "HiddenStatesConfig", "config_fields"]


def _f(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - the metadata key argparse users expect
    """A field with its one-line help; a ``dict`` default is a fresh dict per config."""
    if default is dict:
        return field(default_factory=dict, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class HiddenStatesConfig(datasets.BuilderConfig):
    """Everything that decides what a hidden-states dataset contains, and how it is built."""

    name: str = _f("default", "datasets config name", internal=True)
    model: str = _f("", "local model directory (config.json, weights, tokenizer); never downloaded")
    model_revision: str | None = _f(None, "revision recorded in the metadata (the directory is used as it is)")
    tokenizer: str | None = _f(None, "tokenizer directory (default: the model directory)")
    trust_remote_code: bool = _f(False, "allow the tokenizer's own Python code (Kimi-K2.5's tiktoken tokenizer needs it)")
    layers: tuple[int, ...] = _f((), "captured layers: output of decoder layer k, 0-based; L-1 = last layer before the norm")
    max_length: int = _f(2048, "tokens per sample at most (see truncation)")
    source: str = _f("", "conversations: .jsonl/.json/.parquet, a save_to_disk folder, or hf:<path>[:split]")
    sample_id: SampleIdMode = _f("row", "sample ids: <source>:<row> (row) or a content hash (hash)")
    mask: MaskMode = _f("all", "loss mask over every assistant reply (all) or only the last (last)")
    truncation: TruncationMode = _f("truncate", "longer than max_length: keep the first max_length tokens, or reject")
    # A str, not BackendName: a build given a started backend records that backend's own name.
    backend: str = _f("transformers", "capture backend: transformers (reference, any device) or sglang",
                      choices=BACKENDS)
    backend_options: dict[str, Any] = _f(dict, "the backend's options (e.g. tp_size, ring_bytes, engine_args)")
    storage_dtype: StorageDtype = _f("bfloat16", "exact bf16 bits, or fp8 e4m3 with a per-token scale (half the bytes)")
    on_nonfinite: NonfinitePolicy = _f("fail", "NaN/Inf in a state: stop the build (fail) or reject the sample")
    max_samples: int | None = _f(None, "build at most this many source rows (default: all)")
    part_size: int = _f(256, "source rows per resumable part")
    writer_batch_bytes: int = _f(64 * 2**20, "Arrow record batch budget; a row this big goes alone, without a copy")
    max_shard_bytes: int = _f(2 * 2**30, "largest shard file")
    file_format: FileFormat = _f("arrow", "shard format: arrow (zero-copy reads) or parquet")

    def __post_init__(self):
        super().__post_init__()
        self.layers = tuple(int(k) for k in self.layers)
        if not self.model:
            raise ConfigError("config needs model: a local model directory (--set model=/path/to/model)")
        if not self.source:
            raise ConfigError("config needs source: a JSON/JSONL/Parquet file or a datasets dir (--set source=...)")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if self.max_length < 1 or self.part_size < 1:
            raise ConfigError("max_length and part_size must be >= 1")

    def content_key(self) -> dict[str, Any]:
        """The fields that decide the rows; a resumed build must match them exactly."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in
                ((k, getattr(self, k)) for k in CONTENT_FIELDS)}

    def to_dict(self) -> dict[str, Any]:
        """The public fields, as recorded in ``hs_dataset.json``."""
        d = {f.name: getattr(self, f.name) for f in config_fields()}
        d["layers"] = list(self.layers)
        return d


CHOICES: dict[str, tuple[str, ...]] = {
    "mask": MASK_MODES, "truncation": TRUNCATION_MODES, "on_nonfinite": NONFINITE_POLICIES,
    "sample_id": SAMPLE_ID_MODES, "file_format": FILE_FORMATS, "storage_dtype": STORAGE_DTYPES,
}
CONTENT_FIELDS = ("model", "model_revision", "tokenizer", "layers", "max_length", "source", "sample_id", "mask",
                  "truncation", "backend", "storage_dtype", "on_nonfinite", "part_size", "file_format")


def config_fields() -> list[dataclasses.Field]:
    """The public fields of :class:`HiddenStatesConfig`, in definition order (datasets' own left out)."""
    return [f for f in dataclasses.fields(HiddenStatesConfig) if "help" in f.metadata and not f.metadata.get("internal")]

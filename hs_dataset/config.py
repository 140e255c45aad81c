"""The build configuration: one typed dataclass, documented field by field.

``HiddenStatesConfig`` is a plain dataclass (importing it costs no ``datasets``, so a command line
answers a mistake at once); the ``datasets`` builder carries it in its own ``BuilderConfig``
(:class:`hs_dataset.write.builder.HiddenStatesBuilderConfig`). Its choice fields are typed
``Literal``s from :mod:`hs_dataset.layout`; each field's ``metadata["help"]`` is its one-line
documentation, from which ``hs-dataset build --help`` lists the fields (so the two cannot drift).
Fields in :data:`CONTENT_FIELDS` decide the rows: a resumed build refuses a change of any of them,
except ``on_nonfinite`` from ``fail`` to ``reject`` (:data:`hs_dataset.write.resume.RESUMABLE_CHANGES`:
parts written under ``fail`` hold no non-finite state). The others (``backend_options``,
``max_samples``, ``writer_batch_bytes``, ``max_shard_bytes``, ``trust_remote_code``, ``tokenize_workers``,
``license``) may change between runs without changing a row already written.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from hs_dataset.errors import ConfigError
from hs_dataset.layout import (BACKENDS, COMPRESSIONS, DUPLICATES_POLICIES, FILE_FORMATS, MASK_MODES, NONFINITE_POLICIES,
                               RESPONSES_MODES, SAMPLE_ID_MODES, STORAGE_DTYPES, TRUNCATION_MODES, Compression, DuplicatesPolicy,
                               FileFormat, MaskMode, NonfinitePolicy, ResponsesMode, SampleIdMode, StorageDtype,
                               TruncationMode, parse_teacher)

__all__ = ["CHOICES", "CONTENT_FIELDS", "GenerationOptions", "HiddenStatesConfig", "coerce_field", "config_fields",
           "describe_type", "did_you_mean", "field_types"]


def _f(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - the metadata key argparse users expect
    """A field with its one-line help; a ``dict`` default is a fresh dict per config."""
    if default is dict:
        return field(default_factory=dict, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


OnLength = Literal["reject", "keep"]
# The template's thinking switch (hs_dataset.prepare.thinking): as the template defaults it (no switch passed), on,
# off, or both (a share of the samples on, the rest off).
ThinkingMode = Literal["template", "on", "off", "both"]
THINKING_MODES: tuple[str, ...] = typing.get_args(ThinkingMode)


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling for regenerated replies (the ``generation`` field of the build configuration).

    temperature 0 is greedy; ``stop``: extra stop strings, each a single token of the tokenizer
    (the template's end-of-turn token and EOS always stop); ``on_length``: a reply cut at
    ``max_new_tokens`` without an end of turn is rejected (``reject``, the default: its end-of-turn
    marker would be one the model did not write) or kept (``keep``).

    Thinking (:mod:`hs_dataset.prepare.thinking`): ``thinking`` is ``template`` (no switch passed), ``on``,
    ``off`` or ``both`` (``thinking_ratio`` of the samples on, chosen per sample id and seed); ``thinking_key``
    the template's switch (default: ``enable_thinking`` when the template names it, as Qwen3's does, else
    ``thinking``, Kimi-K2.5's); ``template_kwargs`` more keyword arguments for the chat template;
    ``train_thinking``: the thinking span (up to and with ``thinking_end``) in the loss mask or not.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    seed: int = 0
    stop: tuple[str, ...] = ()
    on_length: OnLength = "reject"
    thinking: ThinkingMode = "template"
    thinking_ratio: float = 0.5
    thinking_key: str | None = None
    thinking_end: str = "</think>"
    train_thinking: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, options: dict[str, Any]) -> "GenerationOptions":
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(f"generation.{key}: unknown option{hint}; known: {', '.join(names)}",
                                  field=f"generation.{key}", value=options[key])
        o = dict(options)
        if "stop" in o:
            o["stop"] = tuple([o["stop"]] if isinstance(o["stop"], str) else o["stop"])
        try:
            opts = cls(**o)
        except TypeError as e:
            raise ConfigError(f"generation: {e}") from None
        if opts.on_length not in ("reject", "keep"):
            raise ConfigError(f"generation.on_length={opts.on_length!r}: use reject or keep", field="generation.on_length",
                              value=opts.on_length)
        if opts.thinking not in THINKING_MODES:
            raise ConfigError(f"generation.thinking={opts.thinking!r}: use one of {', '.join(THINKING_MODES)}",
                              field="generation.thinking", value=opts.thinking)
        if not 0.0 <= float(opts.thinking_ratio) <= 1.0 or not isinstance(opts.template_kwargs, dict):
            raise ConfigError("generation.thinking_ratio must be within [0, 1] and generation.template_kwargs a JSON "
                              "object", field="generation.thinking_ratio", value=opts.thinking_ratio)
        if opts.max_new_tokens < 1 or opts.temperature < 0:
            raise ConfigError("generation.max_new_tokens must be >= 1 and generation.temperature >= 0")
        return opts

    def to_dict(self) -> dict[str, Any]:
        """The options as recorded; the thinking fields only when set (builds made before them keep their key)."""
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        for f in dataclasses.fields(self)[_THINKING_FIELDS:]:
            if d[f.name] == (f.default_factory() if callable(f.default_factory) else f.default):
                del d[f.name]
        return d

    @property
    def thinking_set(self) -> bool:
        """Whether the build passes a thinking switch or template arguments (then replies are kept as generated)."""
        return self.thinking != "template" or bool(self.template_kwargs)


_THINKING_FIELDS = 7  # GenerationOptions' fields before the thinking ones


@dataclass
class HiddenStatesConfig:
    """Everything that decides what a hidden-states dataset contains, and how it is built.

    Args:
        every field below, by keyword: each field's one-line documentation is its ``metadata["help"]``
        (``hs-dataset build --help`` lists them all); values given as text (``--set``) are parsed to
        the field's type.

    Raises:
        ConfigError: a value that does not fit its field (naming the field and an example), a missing
            ``model`` or ``source``, unknown ``generation`` options.
    """

    model: str = _f("", "local model directory (config.json, weights, tokenizer); never downloaded")
    model_revision: str | None = _f(None, "revision recorded in the metadata (the directory is used as it is)")
    tokenizer: str | None = _f(None, "tokenizer directory (default: the model directory)")
    trust_remote_code: bool = _f(False, "run the model directory's own Python code (auto_map): Kimi-K2.5's tiktoken "
                                        "tokenizer and processor need it; for the tokenizer, and passed to the backend")
    layers: tuple[int, ...] = _f((), "captured layers: output of decoder layer k, 0-based; L-1 = last layer before the norm")
    max_length: int = _f(2048, "tokens per sample at most (see truncation)")
    row_tokens: int = _f(8192, "a longer sample is stored as rows of at most this many tokens, in order (columns "
                                "token_start, sample_tokens); no stage then holds it whole")
    source: str = _f("", "conversations: .jsonl/.json/.parquet, a save_to_disk folder, or hf:<path>[:split]")
    sample_id: SampleIdMode = _f("row", "sample ids: <source>:<row> (row) or a content hash (hash)")
    mask: MaskMode = _f("all", "loss mask over every assistant reply (all) or only the last (last)")
    truncation: TruncationMode = _f("truncate", "longer than max_length: keep the first max_length tokens, or reject")
    responses: ResponsesMode = _f("source", "assistant replies from the source, or regenerated by the target model")
    generation: dict[str, Any] = _f(dict, "with responses=regenerate: temperature, top_p, top_k, max_new_tokens, seed, "
                                          "stop, on_length (reject|keep)")
    # A str, not BackendName: a build given a started backend records that backend's own name.
    backend: str = _f("transformers", "capture backend: transformers (reference, any device) or sglang",
                      choices=BACKENDS)
    backend_options: dict[str, Any] = _f(dict, "the backend's options (e.g. tp_size, ring_bytes, engine_args)")
    storage_dtype: StorageDtype = _f("bfloat16", "exact bf16 bits, or fp8 e4m3 with a per-token scale (half the bytes)")
    teacher: str | None = _f(None, "topk:K: also store the target's top-K log-probs and logsumexp at loss-masked "
                                   "positions (computed on the engine's GPU)")
    store_final: bool = _f(True, "store hidden_final; false (with teacher) leaves it out: the teacher replaces it")
    tags: bool = _f(False, "store per-sample tag columns (tag_source, tag_row, tag_mode, tag_turns, tag_tokens, "
                           "tag_language): plain columns for datasets filters, plan/inspect and derive")
    tag_columns: str | None = _f(None, "with tags: source columns copied as tag_<name> (comma-separated, e.g. category,lang)")
    sample_stats: bool = _f(False, "after the build, write sample_stats.parquet: the teacher's entropy and flatness "
                                   "per row at loss-masked positions (from hidden_final and lm_head, or the teacher)")
    on_nonfinite: NonfinitePolicy = _f("fail", "NaN/Inf in a state: stop the build (fail) or reject the sample")
    duplicates: DuplicatesPolicy = _f("keep", "a sample with the token ids and loss mask of an earlier one: capture it "
                                              "again (keep; counted in hs_dataset.json) or reject it (skip)")
    max_samples: int | None = _f(None, "build at most this many source rows (default: all)")
    part_size: int = _f(256, "source rows per resumable part")
    tokenize_workers: int | None = _f(None, "processes that tokenize the source (chat template, tokenizer, loss mask), "
                                            "results in row order: default one per CPU core (at most 8) for a build "
                                            "of 1024 rows or more; 0: in the build's own process")
    writer_batch_bytes: int = _f(64 * 2**20, "Arrow record batch budget; a row this big goes alone, without a copy")
    max_shard_bytes: int = _f(512 * 2**20, "largest shard file: a part's rows go to several, written side by side")
    file_format: FileFormat = _f("arrow", "shard format: arrow (zero-copy reads) or parquet (byte planes + zstd)")
    compression: Compression = _f("none", "arrow shards: none (zero-copy reads), or zstd: lossless, each shard's buffers "
                                          "zstd-compressed as it is written (read decoded, like parquet)")
    license: str = _f("unknown", "the dataset's license in its card (a Hub license id: apache-2.0, mit, cc-by-4.0, "
                                 "other...); the states derive from the model and the source: follow both their terms")

    def __post_init__(self) -> None:
        for f in config_fields():  # each value as its field's type (``--set`` text included), else a ConfigError
            setattr(self, f.name, coerce_field(f.name, getattr(self, f.name)))
        if not self.model:
            raise ConfigError("config needs model: a local model directory (--set model=/path/to/model)", field="model")
        if not self.source:
            raise ConfigError("config needs source: a JSON/JSONL/Parquet file or a datasets dir (--set source=...)",
                              field="source")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}", field=name,
                                  value=getattr(self, name))
        try:
            parse_teacher(self.teacher)
        except ValueError as e:
            raise ConfigError(str(e), field="teacher", value=self.teacher) from None
        if not isinstance(self.store_final, bool) or (not self.store_final and not self.teacher):
            raise ConfigError(f"store_final={self.store_final!r}: true, or false with teacher=topk:K (a build needs the "
                              "final state or the teacher's distribution)", field="store_final", value=self.store_final)
        if not isinstance(self.trust_remote_code, bool):
            raise ConfigError(f"trust_remote_code={self.trust_remote_code!r}: use true or false "
                              "(--set trust_remote_code=true)")
        for name in ("max_length", "row_tokens", "part_size", "writer_batch_bytes", "max_shard_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1 (--set {name}=...)", field=name,
                                  value=getattr(self, name))
        if self.tokenize_workers is not None and self.tokenize_workers < 0:
            raise ConfigError(f"tokenize_workers={self.tokenize_workers}: must be >= 0 (0: tokenize in the build's "
                              "process), or null for one per CPU core", field="tokenize_workers",
                              value=self.tokenize_workers)
        if self.max_samples is not None and self.max_samples < 0:
            raise ConfigError(f"max_samples={self.max_samples}: must be >= 0, or null for every source row",
                              field="max_samples", value=self.max_samples)
        if self.responses == "regenerate":
            GenerationOptions.from_config(self.generation)  # unknown or bad options fail here
        elif self.generation:
            raise ConfigError("generation options are set but responses='source': set responses=regenerate")
        if self.tag_columns and not self.tags:
            raise ConfigError("tag_columns needs tags=true (--set tags=true)", field="tag_columns", value=self.tag_columns)
        if self.compression != "none" and self.file_format != "arrow":
            raise ConfigError(f"compression={self.compression!r} is for arrow shards; parquet shards are coded with "
                              "byte planes + zstd already: leave compression out", field="compression",
                              value=self.compression)
        if self.duplicates == "skip" and self.responses == "regenerate":
            raise ConfigError("duplicates=skip needs responses=source: regenerated replies are not known before "
                              "capture (keep them: --set duplicates=keep)", field="duplicates", value=self.duplicates)

    def content_key(self) -> dict[str, Any]:
        """The fields that decide the rows; a resumed build must match them exactly."""
        key = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ((k, getattr(self, k)) for k in CONTENT_FIELDS)}
        if self.teacher or not self.store_final:  # builds made before teachers existed keep their key
            key.update(teacher=self.teacher, store_final=self.store_final)
        if self.max_length > self.row_tokens:  # only then it decides rows: shorter builds keep their key
            key["row_tokens"] = self.row_tokens
        if self.responses != "source":  # only then: builds made before regeneration existed keep their key
            key.update(responses=self.responses, generation=GenerationOptions.from_config(self.generation).to_dict())
        if self.tags or self.tag_columns:  # likewise: tag columns change the rows
            key.update(tags=self.tags, tag_columns=self.tag_columns)
        if self.duplicates != "keep":  # likewise: builds made before duplicates existed keep their key
            key["duplicates"] = self.duplicates
        if self.compression != "none":  # likewise: the shards' bytes differ, a resumed build must not mix them
            key["compression"] = self.compression
        return key

    def to_dict(self) -> dict[str, Any]:
        """The public fields, as recorded in ``hs_dataset.json``."""
        d = {f.name: getattr(self, f.name) for f in config_fields()}
        d["layers"] = list(self.layers)
        return d


CHOICES: dict[str, tuple[str, ...]] = {
    "mask": MASK_MODES, "truncation": TRUNCATION_MODES, "on_nonfinite": NONFINITE_POLICIES,
    "sample_id": SAMPLE_ID_MODES, "file_format": FILE_FORMATS, "compression": COMPRESSIONS, "storage_dtype": STORAGE_DTYPES,
    "responses": RESPONSES_MODES, "duplicates": DUPLICATES_POLICIES,
}
CONTENT_FIELDS = ("model", "model_revision", "tokenizer", "layers", "max_length", "source", "sample_id", "mask",
                  "truncation", "backend", "storage_dtype", "on_nonfinite", "part_size", "file_format")


def config_fields() -> list[dataclasses.Field]:
    """The fields of :class:`HiddenStatesConfig`, in definition order."""
    return list(dataclasses.fields(HiddenStatesConfig))


@functools.lru_cache(maxsize=None)
def field_types() -> dict[str, Any]:
    """The type of every public field (:func:`config_fields`), resolved: ``{"max_length": int, ...}``."""
    hints = typing.get_type_hints(HiddenStatesConfig)
    return {f.name: hints[f.name] for f in config_fields()}


def _optional(t: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (t, False)."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(t)) == 2:
            return args[0], True
    return t, False


def describe_type(t: Any) -> str:
    """A field type as ``build --help`` shows it: ``int``, ``int or null``, ``list of ints``, ``all|last``..."""
    t, optional = _optional(t)
    if typing.get_origin(t) is Literal:
        text = "|".join(map(str, typing.get_args(t)))
    elif typing.get_origin(t) is tuple:
        text = "list of ints"
    elif typing.get_origin(t) is dict or t is dict:
        text = "JSON object"
    else:
        text = getattr(t, "__name__", str(t))
    return f"{text} or null" if optional else text


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """``" (did you mean 'max_length'?)"`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _expected(name: str, what: str, value: Any, example: str) -> ConfigError:
    return ConfigError(f"{name}={value!r}: expected {what}, e.g. --set {name}={example}", field=name, value=value)


def coerce_field(name: str, value: Any) -> Any:
    """``value`` as the type of config field ``name``: a builder script's value, or ``--set`` text.

    Text is accepted for every type: ``--set max_length=2048``, ``--set layers=0,1`` or ``[0,1]``,
    ``--set trust_remote_code=true``, ``--set max_samples=null``, ``--set backend_options={"tp_size": 8}``.

    Raises:
        ConfigError: ``name`` is not a field (with the closest field's name), or the value does not
            fit the field's type (naming the type and an example).
    """
    ftypes = field_types()
    if name not in ftypes:
        raise ConfigError(f"unknown config field {name!r}{did_you_mean(name, ftypes)}; "
                          "`hs-dataset build --help` lists the fields", field=name, value=value)
    t, optional = _optional(ftypes[name])
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none"))):
        return None
    if typing.get_origin(t) is Literal:
        allowed = typing.get_args(t)
        if value not in allowed:
            raise ConfigError(f"{name}={value!r}: use one of {', '.join(allowed)}{did_you_mean(str(value), allowed)}",
                              field=name, value=value)
        return value
    if t is bool:
        text = str(value).strip().lower()
        if isinstance(value, bool) or text in ("true", "false", "1", "0", "yes", "no"):
            return value if isinstance(value, bool) else text in ("true", "1", "yes")
        raise _expected(name, "true or false", value, "true")
    if t is int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _expected(name, "an integer" + (" or null" if optional else ""), value, "2048")
    if typing.get_origin(t) is tuple:  # layers: a list of ints
        items = value
        if isinstance(value, str):
            text = value.strip()
            items = json.loads(text) if text.startswith("[") and _is_json(text) else text.replace(",", " ").split()
        if isinstance(items, int) and not isinstance(items, bool):
            items = [items]
        try:
            if isinstance(items, (str, bytes)) or any(isinstance(k, (bool, float)) for k in items):
                raise TypeError
            return tuple(int(k) for k in items)
        except (TypeError, ValueError):
            raise _expected(name, "a list of integers", value, "1,29,57 (or [1,29,57])") from None
    if typing.get_origin(t) is dict:
        parsed = json.loads(value) if isinstance(value, str) and _is_json(value) else value
        if not isinstance(parsed, dict):
            raise _expected(name, "a JSON object", value, "'{\"key\": 1}' (or " + name + ".key=1)")
        return parsed
    if not isinstance(value, str):
        raise _expected(name, "a string", value, "...")
    return value


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True

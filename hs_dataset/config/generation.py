"""The options of ``responses="regenerate"`` (the build config's ``generation`` object): sampling, stops, and the
chat template's thinking switch, checked once (:meth:`GenerationOptions.from_config`)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from hs_dataset.errors import ConfigError

__all__ = ["THINKING_MODES", "GenerationOptions", "OnLength", "ThinkingMode"]


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

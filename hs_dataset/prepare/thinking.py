"""Thinking modes of a regenerate build: the template's thinking switch per sample, and the tokens as generated.

A reasoning target serves with thinking on or off, and a drafter must see both in the proportion it will
serve. ``generation.thinking`` (:class:`~hs_dataset.config.GenerationOptions`) picks the mode of each
sample: ``on``, ``off``, or ``both`` (a sample is on when a hash of the seed and its id falls below
``thinking_ratio``: the same samples in every run). The mode is passed to the chat template as its switch,
``thinking_key``: Qwen3's templates call it ``enable_thinking``, Kimi-K2.5's ``thinking``; by default the
key the template's text names. ``template_kwargs`` are passed through to any template.

**Tokens as generated.** A thinking template renders a finished assistant turn differently from what the
model wrote after the generation prompt: Kimi-K2.5's drops the reasoning of every turn (``<think></think>``),
Qwen3's moves it into a ``<think>`` block it formats itself. So with a thinking switch set, a sample's last
assistant turn is kept exactly as generated: the text is the prompt (the template over the turns before it,
with its generation prompt and the switch), the generated reply, and the template's end-of-turn marker.
Earlier turns are history as the template renders them (masked with ``mask="all"``, where the template is
prefix-stable: :mod:`hs_dataset.prepare.loss_mask`). The last turn's span is masked, less its thinking span
(from the reply's start to the end of the first ``thinking_end``, ``</think>``) when ``train_thinking`` is
false; a reply with thinking on and no ``thinking_end`` (cut at the length limit) is all thinking.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Literal

import numpy as np

from hs_dataset.config import GenerationOptions
from hs_dataset.errors import SampleError
from hs_dataset.layout import MaskMode, TruncationMode
from hs_dataset.prepare.loss_mask import (_check_modes, _check_vocab, _finish, _mask_from_offsets, _turn_spans,
                                          encode_bounded, render_conversation)
from hs_dataset.prepare.token_offsets import encode_with_offsets
from hs_dataset.records import Conversation, Message, TokenizedSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Mode", "end_marker", "sample_mode", "template_kwargs", "thinking_key", "tokenize_generated",
           "tokenize_in_mode"]

Mode = Literal["on", "off", "template"]
_SENTINEL = "hs_dataset reply sentinel 7f3a"


def thinking_key(tokenizer: PreTrainedTokenizerBase, options: GenerationOptions) -> str:
    """The template's thinking switch: ``options.thinking_key``, else ``enable_thinking`` when the template's
    text names it (Qwen3), else ``thinking`` (Kimi-K2.5)."""
    if options.thinking_key:
        return options.thinking_key
    template = getattr(tokenizer, "chat_template", None) or ""
    return "enable_thinking" if "enable_thinking" in str(template) else "thinking"


def sample_mode(options: GenerationOptions, sample_id: str) -> Mode:
    """The thinking mode of sample ``sample_id``: ``template`` (no switch), ``on`` or ``off``; with ``both``,
    on for a ``thinking_ratio`` share of the ids (a hash of the seed and the id: the same in every run)."""
    if options.thinking == "both":
        u = zlib.crc32(f"{options.seed}\0{sample_id}".encode()) / 2**32
        return "on" if u < options.thinking_ratio else "off"
    return options.thinking


def template_kwargs(tokenizer: PreTrainedTokenizerBase, options: GenerationOptions, mode: Mode) -> dict:
    """The chat template's arguments for a sample of ``mode``: ``template_kwargs`` and the switch."""
    kwargs = dict(options.template_kwargs)
    if mode != "template":
        kwargs[thinking_key(tokenizer, options)] = mode == "on"
    return kwargs


def end_marker(tokenizer: PreTrainedTokenizerBase, kwargs: dict) -> str:
    """What the template writes after the last assistant reply (``<|im_end|>``, ``<|im_end|>\\n``...)."""
    chat = [Message("user", "u"), Message("assistant", _SENTINEL)]
    full = render_conversation(tokenizer, chat, add_generation_prompt=False, template_kwargs=kwargs)
    at = full.rfind(_SENTINEL)
    return full[at + len(_SENTINEL):] if at >= 0 else ""


def tokenize_generated(conv: Conversation, tokenizer: PreTrainedTokenizerBase, kwargs: dict, *, max_length: int,
                       mask: MaskMode = "all", truncation: TruncationMode = "truncate", train_thinking: bool = True,
                       thinking_end: str = "</think>", thinking_on: bool = False) -> TokenizedSample:
    """``conv``, whose last assistant turn was generated under ``kwargs``, as tokens and a loss mask (module
    docstring: the last turn as generated, earlier turns as the template renders them).

    Raises:
        SampleError: a template failure, an earlier masked turn that is not prefix-stable, nothing to train on,
            a sample too long under ``truncation="reject"``.
    """
    _check_modes(max_length, mask, truncation)
    msgs = conv.messages
    last = max(i for i, m in enumerate(msgs) if m.role == "assistant")
    prompt = render_conversation(tokenizer, msgs[:last], add_generation_prompt=True, template_kwargs=kwargs)
    reply = msgs[last].content
    full = prompt + reply + end_marker(tokenizer, kwargs)
    (ids, offsets), cut = encode_bounded(full, max_length, lambda text: encode_with_offsets(tokenizer, text),
                                         lambda e: len(e[0]))
    if not ids.size:
        raise SampleError("chat_template", "the rendered conversation tokenizes to no tokens")
    spans = list(_turn_spans(tokenizer, msgs[:last], prompt, "all", kwargs)) if mask == "all" and last else []
    spans.append((len(prompt), len(full)))
    loss_mask = _mask_from_offsets(offsets, spans)
    if not train_thinking:
        at = reply.find(thinking_end)
        think = at + len(thinking_end) if at >= 0 else (len(reply) if thinking_on else 0)
        if think:
            loss_mask[_mask_from_offsets(offsets, [(len(prompt), len(prompt) + think)]).astype(bool)] = 0
    return _finish(conv.sample_id, ids, np.asarray(loss_mask, dtype=np.uint8), max_length=max_length,
                   truncation=truncation, cut=cut)


def tokenize_in_mode(conv: Conversation, tokenizer: PreTrainedTokenizerBase, options: GenerationOptions, *,
                     max_length: int, mask: MaskMode, truncation: TruncationMode, vocab_size: int) -> TokenizedSample:
    """A regenerated conversation of a build with a thinking switch as tokens and a loss mask, in its sample's mode
    (what the build writes, and what ``verify --probe`` checks a stored row against).

    Raises:
        SampleError: as :func:`tokenize_generated`, and a token id at or above ``vocab_size``.
    """
    mode = sample_mode(options, conv.sample_id)
    sample = tokenize_generated(conv, tokenizer, template_kwargs(tokenizer, options, mode), max_length=max_length,
                                mask=mask, truncation=truncation, train_thinking=options.train_thinking,
                                thinking_end=options.thinking_end, thinking_on=mode == "on")
    _check_vocab(sample.input_ids, vocab_size)
    return sample

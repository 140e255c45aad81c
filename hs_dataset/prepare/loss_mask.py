"""Tokenize + loss-mask stage: conversation -> token ids and a mask of the assistant replies.

The tokenizer's OWN chat template renders the conversation; nothing about a model's separators is
hard-coded here. The assistant spans come from the template itself, by rendering growing
prefixes of the conversation. For assistant turn ``i``:

* ``A`` = render(messages[:i], add_generation_prompt=True): everything up to where the model
  starts to write;
* ``B`` = render(messages[:i+1]): the same plus the reply and whatever the template writes after
  it (end-of-turn marker(s), e.g. ``<|im_end|>\\n`` or ``<|eot_id|>``).

Both must be string prefixes of the full rendering (else the template is not prefix-stable, e.g.
it rewrites earlier turns, and the sample is rejected). The characters ``[len(A), len(B))`` of the
full text are the assistant span: the reply as the template renders it (a template may trim it)
plus the end-of-turn marker(s). The full text is tokenized once (``add_special_tokens=False``:
the template renders BOS itself) with each token's character range (fast tokenizers' offsets, or
exact token bytes for tiktoken / byte-level slow tokenizers: :mod:`hs_dataset.prepare.token_offsets`), and
a token is in the loss mask when its characters overlap an assistant span.

Thinking templates. An assistant turn's ``reasoning_content`` is given to the template, which
decides what of it to render. The rule for a template that renders a turn differently once later
turns follow (e.g. drops the reasoning of earlier turns, as Qwen3's does): every masked turn (that
the kept tokens reach: "Linear time" below) must be prefix-stable, so ``mask="all"`` rejects such a
multi-turn sample ("not prefix-stable"), while ``mask="last"`` works: only the last turn is masked,
rendered as the template renders the last turn, and the earlier turns are context in their history
form. Kimi-K2.5's template is prefix-stable:
every assistant turn up to the last one without tool calls, the last reply included, renders an
empty ``<think></think>`` (its reasoning is not rendered), so the masked text of a turn is
``</think>`` (the generation prompt ends with ``<think>``), the reply and ``<|im_end|>``.

**Bounded memory** (:func:`encode_bounded`): only a prefix of the rendered text is tokenized, so a
50 MB conversation costs what a short one does. The prefix is the first ``C = 8 * (max_length +
64)`` characters; while it tokenizes to fewer than ``max_length + 64`` tokens (and is not the whole
text), ``C`` doubles. A token covers at most ``L`` characters (the vocabulary's longest token), so
this ends by ``C <= 2 * L * (max_length + 64)`` characters, whatever the text's size. The kept
tokens are those of the whole text: tokenizers match added tokens first, split the rest into
pre-tokens (words, digit groups, whitespace runs) and tokenize each pre-token on its own, so a cut
changes only the pre-token it falls in, and at least 64 tokens lie between the first
``max_length`` tokens and the cut. (Only one pre-token of more than 64 tokens that reaches from the
``max_length``-th token to the cut, e.g. tens of thousands of letters without a space, could make
them differ; they are then those of the prefix, the same in every build.) A text cut this way has
more than ``max_length`` tokens: ``truncation="truncate"`` keeps the first ``max_length``,
``"reject"`` rejects it; the mask rule is unchanged.

**Linear time** (:func:`tokenize_conversation`). Rendering ``A`` and ``B`` of turn ``i`` costs
``O(i)``, so rendering them for every turn is quadratic in the number of turns (a row of 100k short
turns ran for more than 8 minutes). Only the tokens a build keeps (the first ``max_length``) need
their mask, so the conversation is rendered once and tokenized (bounded, as above), then the masked
turns are walked in order: each turn's ``A`` and ``B`` are rendered and checked, and the walk stops
after the first turn whose span starts past the last character the kept tokens touch. The turns
after it start later still (a rendering of more turns is longer) and cannot mask a kept token, so
they are neither rendered nor checked: the mask of every kept token is the one rendering every
prefix gives, and "every masked turn must be prefix-stable" holds for each turn that reaches the kept
tokens (a turn cut off by truncation no longer rejects its sample). Two rejects come earlier or
later than a full walk: with ``truncation="reject"`` a sample over ``max_length`` is rejected before
any turn is rendered (so for that reason, not a template's), and when the kept tokens hold no
assistant token the walk goes on to the end of the tokenized text, so that the reject names the
first assistant token there as before. Cost: one rendering of the conversation, plus ``O(K^2)`` for
the ``K`` turns that reach the kept tokens (bounded by ``max_length``, whatever the conversation's
length); ``mask="last"`` renders the last turn only, ``O(n)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

import numpy as np

from hs_dataset.errors import SampleError
from hs_dataset.layout import MASK_MODES, TRUNCATION_MODES, MaskMode, TruncationMode
from hs_dataset.prepare.token_offsets import encode_with_offsets
from hs_dataset.records import Conversation, Message, TokenizedSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["assistant_char_spans", "encode_bounded", "render_conversation", "tokenize_conversation", "tokenize_sample"]


def render_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[Message], *, add_generation_prompt: bool,
                        template_kwargs: dict | None = None) -> str:
    """Render ``messages`` with the tokenizer's chat template (``template_kwargs``: the template's own arguments,
    e.g. a thinking switch); a template failure is a SampleError."""
    chat = [m.as_chat() for m in messages]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as e:  # jinja2 errors, raise_exception() in templates, TypeError...
        raise SampleError(
            "chat_template",
            f"rendering {len(chat)} message(s) failed: {type(e).__name__}: {e}",
        ) from None
    if not isinstance(text, str):
        raise SampleError("chat_template", f"rendering returned {type(text).__name__}, not a string")
    return text


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], *, mask: MaskMode = "all"
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return ``(full_text, spans)``: the ``[start, end)`` character spans
    of the assistant replies (reply + the end-of-turn marker(s) the template renders after it).

    ``mask="last"`` returns only the last reply's span. Every turn is rendered (quadratic in the
    number of turns); :func:`tokenize_conversation` renders only the turns its kept tokens need.
    """
    if mask not in MASK_MODES:
        raise ValueError(f"mask must be one of {MASK_MODES}, got {mask!r}")
    full = render_conversation(tokenizer, messages, add_generation_prompt=False)
    return full, list(_turn_spans(tokenizer, messages, full, mask))


def _turn_spans(tokenizer: PreTrainedTokenizerBase, messages: list[Message], full: str,
                mask: MaskMode, template_kwargs: dict | None = None) -> Iterator[tuple[int, int]]:
    """The span of each masked assistant turn of ``messages`` in ``full`` (their full rendering), in
    turn order: each turn is rendered (``A`` and ``B`` of the module docstring) and checked only when
    its span is asked for."""
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if mask == "last":
        turns = turns[-1:]
    for i in turns:
        before = render_conversation(tokenizer, messages[:i], add_generation_prompt=True,
                                     template_kwargs=template_kwargs) if i > 0 else ""
        upto = render_conversation(tokenizer, messages[: i + 1], add_generation_prompt=False,
                                   template_kwargs=template_kwargs)
        for name, text in (("prompt", before), ("reply", upto)):
            if not full.startswith(text):
                at = _first_difference(full, text)
                raise SampleError(
                    "chat_template",
                    f"template is not prefix-stable at turn {i}: the {name} rendering differs from the "
                    f"full conversation at character {at} ({text[at:at + 30]!r} vs {full[at:at + 30]!r}); "
                    "the loss mask cannot be derived from this template (does it rewrite earlier turns, e.g. drop "
                    "their reasoning?); with mask=last only the last turn has to be prefix-stable",
                )
        if len(upto) <= len(before):
            raise SampleError(
                "chat_template",
                f"template renders nothing for the assistant turn {i} after the generation prompt",
            )
        yield len(before), len(upto)


def _spans_reaching(spans: Iterator[tuple[int, int]], reach: int) -> list[tuple[int, int]]:
    """The next spans of ``spans``, up to and with the first that starts after character ``reach``
    (the later ones start later still, so none of them touches a character up to ``reach``)."""
    out = []
    for a, b in spans:
        out.append((a, b))
        if a > reach:
            break
    return out


def _reach(offsets: np.ndarray) -> int:
    """The last character position any of these tokens touches (an empty token: its start); ``offsets``:
    ``[n, 2]`` character spans."""
    return int(offsets.max()) if offsets.size else 0


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def _mask_from_offsets(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters (``offsets``: ``[n, 2]`` starts and ends) overlap a span (an empty
    token: whose start lies in one)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans:
        return mask
    starts, ends = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        overlap = (starts < b) & (ends > a)
        empty_inside = (ends <= starts) & (starts >= a) & (starts < b)
        mask[overlap | empty_inside] = 1
    return mask


CUT_MARGIN = 64  # tokens tokenized beyond max_length, between the kept tokens and the cut
CUT_CHARS_PER_TOKEN = 8  # the first cut, in characters per token (doubled while too few tokens)
_Enc = TypeVar("_Enc")


def encode_bounded(text: str, max_length: int, encode: Callable[[str], _Enc],
                   count: Callable[[_Enc], int]) -> tuple[_Enc, bool]:
    """``encode`` a prefix of ``text`` long enough for ``max_length + CUT_MARGIN`` tokens (the rule
    is in the module docstring) -> ``(encoding, cut)``; ``cut``: the text was longer than the prefix,
    so it holds more than ``max_length`` tokens. ``count(encoding)`` is its number of tokens."""
    limit = CUT_CHARS_PER_TOKEN * (max_length + CUT_MARGIN)
    while len(text) > limit:
        enc = encode(text[:limit])
        if count(enc) >= max_length + CUT_MARGIN:
            return enc, True
        limit *= 2
    return encode(text), False


def _check_modes(max_length: int, mask: str, truncation: str) -> None:
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    if mask not in MASK_MODES:
        raise ValueError(f"mask must be one of {MASK_MODES}, got {mask!r}")
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")


def _too_long(n: int, max_length: int, cut: bool) -> SampleError:
    return SampleError(
        "input_ids",
        f"sample has {'more than ' if cut else ''}{n} tokens, more than max_length={max_length} (truncation='reject'); "
        "raise max_length or use truncation='truncate'",
    )


def _finish(sample_id: str, ids: np.ndarray, loss_mask: np.ndarray, *, max_length: int, truncation: str,
            cut: bool = False) -> TokenizedSample:
    """Apply the truncation policy and the 'something to train on' check (``cut``: ``ids`` are the
    tokens of a prefix of the text, see :func:`encode_bounded`)."""
    n = int(ids.shape[0])
    truncated = False
    if n > max_length:
        if truncation == "reject":
            raise _too_long(n, max_length, cut)
        ones = np.flatnonzero(loss_mask)
        ids, loss_mask, truncated = ids[:max_length], loss_mask[:max_length], True
        if not loss_mask.any():
            first = int(ones[0]) if ones.size else -1
            raise SampleError(
                "input_ids",
                f"truncating {n} tokens to max_length={max_length} leaves no assistant token (the first "
                f"one is at position {first}); raise max_length or drop this sample",
            )
    if not loss_mask.any():
        raise SampleError("loss_mask", "no token has loss_mask=1; there is nothing to train on")
    return TokenizedSample(
        sample_id=sample_id,
        input_ids=np.ascontiguousarray(ids, dtype=np.int32),
        loss_mask=np.ascontiguousarray(loss_mask, dtype=np.uint8),
        truncated=truncated,
    )


def tokenize_conversation(
    conv: Conversation,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    mask: MaskMode = "all",
    truncation: TruncationMode = "truncate",
) -> TokenizedSample:
    """Render ``conv`` with the tokenizer's chat template, tokenize it, and mask the assistant replies.

    ``mask``: ``"all"`` assistant turns or only the ``"last"``. ``truncation``: ``"truncate"`` keeps
    the first ``max_length`` tokens (rejected if no masked token remains), ``"reject"`` rejects a
    longer sample. Problems raise :class:`SampleError`. Time: one rendering of the conversation, plus
    the turns that reach the kept tokens (module docstring, "Linear time").
    """
    _check_modes(max_length, mask, truncation)
    full = render_conversation(tokenizer, conv.messages, add_generation_prompt=False)
    (ids, offsets), cut = encode_bounded(full, max_length, lambda text: encode_with_offsets(tokenizer, text),
                                         lambda e: len(e[0]))
    n = int(ids.size)
    if n == 0:
        raise SampleError("chat_template", "the rendered conversation tokenizes to no tokens")
    if n > max_length and truncation == "reject":
        raise _too_long(n, max_length, cut)
    # Only the turns that reach the kept tokens are rendered (module docstring, "Linear time").
    turns = _turn_spans(tokenizer, conv.messages, full, mask)
    kept = min(n, max_length)
    spans = _spans_reaching(turns, _reach(offsets[:kept]))
    loss_mask = _mask_from_offsets(offsets, spans)
    if kept < n and not loss_mask[:kept].any():  # a reject naming the first assistant token tokenized
        spans += _spans_reaching(turns, _reach(offsets))
        loss_mask = _mask_from_offsets(offsets, spans)
    return _finish(conv.sample_id, ids, loss_mask, max_length=max_length, truncation=truncation, cut=cut)


def tokenize_sample(
    parsed: Conversation | TokenizedSample,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    mask: MaskMode = "all",
    truncation: TruncationMode = "truncate",
    vocab_size: int | None = None,
) -> TokenizedSample:
    """A parsed source row (:func:`~hs_dataset.prepare.conversations.parse_row`) as tokens and a loss mask:
    a conversation goes through :func:`tokenize_conversation`; raw token rows are checked against the
    truncation policy instead.

    Every token id must be below ``vocab_size`` (default ``len(tokenizer)``; the builder passes the
    smaller of that and the model's embedding rows, so an id the model cannot embed is a reject
    naming the position, not a crash of the whole batch).
    """
    _check_modes(max_length, mask, truncation)
    vocab = len(tokenizer) if vocab_size is None else int(vocab_size)
    if isinstance(parsed, Conversation):
        sample = tokenize_conversation(parsed, tokenizer, max_length=max_length, mask=mask, truncation=truncation)
        _check_vocab(sample.input_ids, vocab)
        return sample
    _check_vocab(parsed.input_ids, vocab)
    return _finish(parsed.sample_id, parsed.input_ids.astype(np.int64), parsed.loss_mask, max_length=max_length,
                   truncation=truncation)


def _check_vocab(ids: np.ndarray, vocab: int) -> None:
    ids = ids.astype(np.int64, copy=False)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        j = int(bad[0])
        raise SampleError(f"input_ids[{j}]", f"token id {int(ids[j])} out of vocabulary of size {vocab}")

"""Token ids and each token's character range, for fast and for slow tokenizers (the loss mask needs both).

:mod:`hs_dataset.prepare.loss_mask` marks the tokens whose characters overlap an assistant span of the
rendered text, so it needs every token's ``[start, end)`` characters. How they are obtained
(:func:`offsets_method`):

* ``"offsets"``: a fast (``tokenizers``-backed) tokenizer reports them (``return_offsets_mapping``).
* ``"tiktoken bytes"`` / ``"byte-level bytes"``: a slow tokenizer whose tokens are exact byte strings
  (a ``tiktoken.Encoding``, as Kimi-K2.5's ``TikTokenTokenizer`` holds; or a GPT-2 style byte-level
  BPE with a ``byte_decoder``). The ids are the tokenizer's own
  (``tokenizer.encode(text, add_special_tokens=False)``); each id is mapped to its bytes (added and
  special tokens: their text), the bytes must spell ``text.encode("utf-8")`` exactly (checked for
  every sample: a sample that fails is rejected), and a token's byte range becomes the characters its
  bytes belong to (a token holding part of a multi-byte character touches that whole character, as
  fast tokenizers' offsets do). This is used instead of converting the tokenizer to a fast one
  (``transformers``' ``TikTokenConverter``) so that the ids are exactly those of the model's own
  tokenizer, whatever regex engine a conversion would split the text with.

Any other slow tokenizer (SentencePiece, WordPiece, ...) is refused by :func:`offsets_method`: its
tokens are not exact bytes of the text, so the mask could not be placed exactly.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from hs_dataset.errors import ConfigError, SampleError

__all__ = ["OFFSET_METHODS", "encode_with_offsets", "offsets_method"]

OFFSET_METHODS = ("offsets", "tiktoken bytes", "byte-level bytes")


def _tiktoken_encoding(tokenizer: Any) -> Any:
    """The ``tiktoken.Encoding`` a slow tokenizer holds as an attribute (Kimi's: ``.model``), or None."""
    for value in vars(tokenizer).values():
        if type(value).__module__.startswith("tiktoken") and hasattr(value, "decode_single_token_bytes"):
            return value
    return None


def offsets_method(tokenizer: Any, where: str | os.PathLike[str] = "") -> str:
    """How token character ranges are computed for ``tokenizer`` (one of :data:`OFFSET_METHODS`).

    Args:
        tokenizer: a loaded ``transformers`` tokenizer.
        where: its directory, for the error message.

    Raises:
        ConfigError: a slow tokenizer whose tokens are not exact bytes (no tiktoken encoding, no
            byte-level vocabulary), for which the loss mask cannot be placed exactly.
    """
    if getattr(tokenizer, "is_fast", False):
        return "offsets"
    if _tiktoken_encoding(tokenizer) is not None:
        return "tiktoken bytes"
    if isinstance(getattr(tokenizer, "byte_decoder", None), dict):
        return "byte-level bytes"
    raise ConfigError(
        f"tokenizer at {os.fspath(where)!r} is a slow tokenizer ({type(tokenizer).__name__}) whose tokens are not "
        "exact bytes (neither tiktoken nor byte-level BPE), so the loss mask cannot be placed on them exactly; "
        "provide a tokenizer.json (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(...))"
    )


def _bytes_of(tokenizer: Any, method: str) -> Callable[[list[int]], list[bytes]]:
    added = {int(i): str(t).encode("utf-8") for i, t in tokenizer.added_tokens_decoder.items()}
    if method == "tiktoken bytes":
        enc = _tiktoken_encoding(tokenizer)
        return lambda ids: [added[i] if i in added else enc.decode_single_token_bytes(i) for i in ids]
    byte_decoder = tokenizer.byte_decoder

    def level(ids: list[int]) -> list[bytes]:
        tokens = tokenizer.convert_ids_to_tokens(ids)
        return [added[i] if i in added else bytes(byte_decoder[c] for c in t) for i, t in zip(ids, tokens)]

    return level


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Tokenize ``text`` (no special tokens added) and return ``(ids, char offsets)``, one ``(start, end)`` per token.

    Raises:
        SampleError: tokenizing failed, or (slow tokenizers) the tokens do not spell ``text`` byte for byte.
        ConfigError: see :func:`offsets_method`.
    """
    method = offsets_method(tokenizer)
    try:
        if method == "offsets":
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return np.asarray(enc["input_ids"], dtype=np.int64), [tuple(o) for o in enc["offset_mapping"]]
        ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
        pieces = _bytes_of(tokenizer, method)(ids)
    except Exception as e:  # tokenizers raise many kinds (ValueError, KeyError, pyo3 panics...)
        raise SampleError("chat_template", f"tokenizing the rendered text failed: {type(e).__name__}: {e}") from None
    data = text.encode("utf-8")
    spelled = b"".join(pieces)
    if spelled != data:
        n = min(len(spelled), len(data))
        at = next((k for k in range(n) if spelled[k] != data[k]), n)
        raise SampleError(
            "chat_template",
            f"the tokenizer's tokens do not spell the rendered text byte for byte (they differ at byte {at}: "
            f"{spelled[at:at + 20]!r} vs {data[at:at + 20]!r}), so the loss mask cannot be placed; use a fast "
            "tokenizer (tokenizer.json) for this model",
        )
    # The character each byte belongs to: count the bytes that start a UTF-8 character.
    raw = np.frombuffer(data, dtype=np.uint8)
    char_of_byte = np.cumsum((raw & 0xC0) != 0x80) - 1
    ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
    offsets = []
    start = 0
    for end in ends.tolist():
        if end > start:
            offsets.append((int(char_of_byte[start]), int(char_of_byte[end - 1]) + 1))
        else:
            c = int(char_of_byte[start]) if start < len(data) else len(text)
            offsets.append((c, c))
        start = end
    return np.asarray(ids, dtype=np.int64), offsets

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
import weakref
from typing import Any

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


class _ByteTable:
    """Every token id's exact bytes, made once per tokenizer (added and special tokens: their text); ``None``
    (length -1) for an id that has no bytes (a gap in the ranks, a token outside the byte alphabet)."""

    def __init__(self, tokenizer: Any, method: str):
        added = {int(i): str(t).encode("utf-8") for i, t in tokenizer.added_tokens_decoder.items()}
        n = max(len(tokenizer), max(added, default=-1) + 1)
        pieces: list[bytes | None] = [None] * n
        if method == "tiktoken bytes":
            enc = _tiktoken_encoding(tokenizer)
            n = max(n, enc.n_vocab)
            pieces += [None] * (n - len(pieces))
            for i in range(enc.n_vocab):
                try:
                    pieces[i] = enc.decode_single_token_bytes(i)
                except KeyError:  # a gap in the ranks: no text encodes to it
                    pass
        else:
            byte_decoder = tokenizer.byte_decoder
            for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(n)))):
                if t is not None and all(c in byte_decoder for c in t):
                    pieces[i] = bytes(byte_decoder[c] for c in t)
        for i, b in added.items():
            pieces[i] = b
        self.size = len(tokenizer)
        self.pieces = pieces
        self.lengths = np.fromiter((-1 if b is None else len(b) for b in pieces), dtype=np.int64, count=n)


_TABLES: "weakref.WeakKeyDictionary[Any, _ByteTable]" = weakref.WeakKeyDictionary()


def _byte_table(tokenizer: Any, method: str) -> _ByteTable:
    """The :class:`_ByteTable` of ``tokenizer`` (made again if tokens were added since)."""
    table = _TABLES.get(tokenizer)
    if table is None or table.size != len(tokenizer):
        table = _TABLES[tokenizer] = _ByteTable(tokenizer, method)
    return table


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize ``text`` (no special tokens added) and return ``(ids, char offsets)``: ``offsets[k]`` is the
    ``[start, end)`` characters of token ``k`` (an ``[n, 2]`` int64 array).

    Raises:
        SampleError: tokenizing failed, or (slow tokenizers) the tokens do not spell ``text`` byte for byte.
        ConfigError: see :func:`offsets_method`.
    """
    method = offsets_method(tokenizer)
    try:
        if method == "offsets":
            # verbose=False: the text may be longer than model_max_length (it is cut to max_length later)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
            return np.asarray(enc["input_ids"], dtype=np.int64), offsets
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False, verbose=False), dtype=np.int64)
        table = _byte_table(tokenizer, method)
        bad = np.flatnonzero((ids < 0) | (ids >= len(table.pieces)))
        bad = bad if bad.size else np.flatnonzero(table.lengths[ids] < 0)
        if bad.size:
            raise SampleError("chat_template", f"token {int(ids[bad[0]])} (at position {int(bad[0])}) has no exact "
                              "bytes in this tokenizer's vocabulary, so the loss mask cannot be placed")
        spelled = b"".join(map(table.pieces.__getitem__, ids.tolist()))  # type: ignore[arg-type]
    except SampleError:
        raise
    except Exception as e:  # tokenizers raise many kinds (ValueError, KeyError, pyo3 panics...)
        raise SampleError("chat_template", f"tokenizing the rendered text failed: {type(e).__name__}: {e}") from None
    data = text.encode("utf-8")
    if spelled != data:
        n = min(len(spelled), len(data))
        at = next((k for k in range(n) if spelled[k] != data[k]), n)
        raise SampleError(
            "chat_template",
            f"the tokenizer's tokens do not spell the rendered text byte for byte (they differ at byte {at}: "
            f"{spelled[at:at + 20]!r} vs {data[at:at + 20]!r}), so the loss mask cannot be placed; use a fast "
            "tokenizer (tokenizer.json) for this model",
        )
    return ids, _char_offsets(data, len(text), table.lengths[ids])


def _char_offsets(data: bytes, n_chars: int, lengths: np.ndarray) -> np.ndarray:
    """Each token's ``[start, end)`` characters from its byte length (the tokens spell ``data`` in order)."""
    # The character each byte belongs to: count the bytes that start a UTF-8 character.
    raw = np.frombuffer(data, dtype=np.uint8)
    char_of_byte = np.append(np.cumsum((raw & 0xC0) != 0x80) - 1, n_chars)  # one past the end: the text's length
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first = char_of_byte[starts]  # an empty token: at the character its position starts (or the end)
    last = np.where(lengths > 0, char_of_byte[np.maximum(ends - 1, 0)] + 1, first)
    return np.stack([first, last], axis=1).astype(np.int64, copy=False)

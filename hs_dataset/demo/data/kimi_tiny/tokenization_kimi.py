"""A small tiktoken-backed slow tokenizer, packaged the way Kimi-K2.5's tokenizer is.

hs_dataset's own code (written for its tests, not Moonshot's): a ``PreTrainedTokenizer`` whose
vocabulary is a ``tiktoken.model`` file of mergeable ranks (``base64(token bytes) rank`` per line),
with the special tokens of ``tokenizer_config.json``'s ``added_tokens_decoder`` after the ranks.
``tokenizer_config.json`` names this module in its ``auto_map``, so loading it needs
``trust_remote_code=True``, as Kimi's does. The ranks are read from the local file directly (not
through ``tiktoken.load``, which caches files by path in the temp directory): nothing is downloaded.
"""

from __future__ import annotations

import base64
import os
import shutil
from typing import Any

import tiktoken
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# Pre-tokenization: runs of Han characters, letters with one leading non-letter, numbers of up to
# three digits, punctuation runs, newlines, other whitespace.
PATTERN = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def read_ranks(path: str) -> dict[bytes, int]:
    """The mergeable ranks of a ``tiktoken.model`` file."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_alphabet() -> dict[int, str]:
    """Each byte as one printable character (GPT-2's byte-level alphabet): token strings for bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TikTokenTokenizer(PreTrainedTokenizer):
    """Tokenizes with a ``tiktoken.Encoding`` (``self.model``); token strings are byte-level."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 unk_token: str = "[UNK]", pad_token: str = "[PAD]", added_tokens_decoder: dict | None = None,
                 **kwargs: Any):
        added = dict(added_tokens_decoder or {})
        ranks = read_ranks(vocab_file)
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=PATTERN,
            mergeable_ranks=ranks,
            special_tokens={str(token): int(i) for i, token in added.items()},
        )
        alphabet = byte_alphabet()
        self.byte_decoder = {c: b for b, c in alphabet.items()}
        self._token_of = {rank: "".join(alphabet[b] for b in token) for token, rank in ranks.items()}
        self._id_of = {s: rank for rank, s in self._token_of.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added, **kwargs)
        # A plain attribute, as Kimi's own unk_id: the base class's unk_token_id is a property looked up
        # through __getattr__, which per token would cost more than the tokenization itself.
        self.unk_id = self.added_tokens_encoder.get(str(unk_token))

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return {**self._id_of, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Added (special) tokens were split off by the base class: this is plain text.
        return [self._token_of[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._id_of.get(token, self.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._token_of.get(index, self.unk_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self.byte_decoder[c] for t in tokens for c in t).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)

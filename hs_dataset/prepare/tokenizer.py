"""Loading the target's tokenizer, and what a build records about it.

:func:`load_tokenizer` loads a local directory's tokenizer once per build: a fast one, or a slow one
whose tokens are exact bytes (:mod:`hs_dataset.prepare.token_offsets`); a tokenizer that is its own
Python code (``auto_map``, Kimi-K2.5's) only with ``trust_remote_code``. :func:`tokenizer_record`
describes the loaded tokenizer for ``hs_dataset.json`` without loading it again.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from hs_dataset.errors import ConfigError
from hs_dataset.prepare.token_offsets import offsets_method

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ['chat_template_sha256', 'load_tokenizer', 'tokenizer_record']


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer with a chat template from a local directory.

    A fast (``tokenizers``-backed) tokenizer, or a slow one whose tokens are exact bytes (tiktoken,
    byte-level BPE; see :mod:`hs_dataset.prepare.token_offsets`). ``trust_remote_code`` allows a tokenizer
    that ships its own Python code (``auto_map`` in ``tokenizer_config.json``, e.g. Kimi-K2.5's).

    Raises:
        ConfigError: saying what to fix if it cannot be loaded, needs ``trust_remote_code``, has
            tokens that are not exact bytes, or has no chat template.
    """
    from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

    remote = _remote_class(path)
    if remote is not None and not trust_remote_code:
        # Checked here, not left to transformers: it may load some other tokenizer instead (e.g. convert
        # tiktoken.model itself), whose ids need not be the model's own tokenizer's.
        raise ConfigError(
            f"tokenizer at {os.fspath(path)!r} is its own Python code ({remote}, named by tokenizer_config.json's "
            "auto_map); if you trust it, rerun with --set trust_remote_code=true "
            "(hs-dataset import: --trust-remote-code)"
        )
    try:
        if remote is not None:
            # The class auto_map names, loaded directly: AutoTokenizer may prefer a tokenizer of its own for
            # the model type even when trusted (transformers 5 maps kimi_k25 to a converted fast tokenizer).
            from transformers.dynamic_module_utils import get_class_from_dynamic_module  # deferred: a slow import

            cls: Any = get_class_from_dynamic_module(remote, os.fspath(path))
            tok = cls.from_pretrained(
                os.fspath(path), trust_remote_code=True)
        else:
            tok = AutoTokenizer.from_pretrained(os.fspath(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds here (OSError, ValueError, KeyError, ImportError...)
        raise ConfigError(
            f"cannot load a tokenizer from {os.fspath(path)!r}: {type(e).__name__}: {e}; point to a "
            "directory with tokenizer.json and tokenizer_config.json (the model directory)"
        ) from e
    offsets_method(tok, path)
    if not tok.chat_template:
        raise ConfigError(
            f"tokenizer at {os.fspath(path)!r} has no chat template; use the instruct/chat model's "
            "tokenizer, or set tokenizer.chat_template and save_pretrained it"
        )
    return tok


def _remote_class(path: str | os.PathLike[str]) -> str | None:
    """The tokenizer class of ``tokenizer_config.json``'s ``auto_map`` (the directory's own code), or None."""
    try:
        with open(os.path.join(os.fspath(path), "tokenizer_config.json"), encoding="utf-8") as f:
            ref = json.load(f)["auto_map"]["AutoTokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    refs = [r for r in (ref if isinstance(ref, list) else [ref]) if r]
    return str(refs[0]) if refs else None


def chat_template_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 hex digest of the tokenizer's chat template (a dict of named templates is hashed as canonical JSON)."""
    template = tokenizer.chat_template
    if template is None:
        raise ValueError("tokenizer has no chat template")
    if isinstance(template, str):
        data = template.encode("utf-8")
    else:
        data = json.dumps(template, sort_keys=True, ensure_ascii=True).encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def tokenizer_record(tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str], *,
                     trust_remote_code: bool = False) -> dict[str, Any]:
    """What ``hs_dataset.json`` records about a loaded tokenizer (:func:`load_tokenizer` of ``path``): its
    directory, class, whether its own code was trusted, how token offsets are computed, the chat
    template's sha256."""
    return {"path": os.path.abspath(path), "class": type(tokenizer).__name__,
            "trust_remote_code": bool(trust_remote_code), "token_offsets": offsets_method(tokenizer, path),
            "chat_template_sha256": chat_template_sha256(tokenizer)}

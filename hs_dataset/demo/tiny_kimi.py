"""A tiny tokenizer directory packaged like Kimi-K2.5's, made locally (no downloads).

Kimi-K2.5 ships no ``tokenizer.json``. Its tokenizer is ``tiktoken.model`` (mergeable ranks) plus a
tokenization module (a slow ``PreTrainedTokenizer`` on the ``tiktoken`` package) that
``tokenizer_config.json``'s ``auto_map`` names, so loading it needs ``trust_remote_code=True``; the
special tokens (``<|im_user|>``, ``<|im_assistant|>``, ``<|im_middle|>``, ``<|im_end|>``, ``<think>``...)
follow the ranks; the chat template is a thinking template (``chat_template.jinja``). Its processor
(``preprocessor_config.json`` -> remote code) is what SGLang's Kimi-K2.5 multimodal processor reads.

* :func:`make_kimi_tokenizer` writes all of that with hs_dataset's own code
  (``hs_dataset/demo/data/kimi_tiny/``): the ranks come from the tiny byte-level BPE of
  :mod:`hs_dataset.demo.tiny` (same corpus), so the directory is deterministic.
* :func:`kimi_fast_tokenizer` converts the same ranks to a fast tokenizer with ``transformers``'
  ``TikTokenConverter``: one vocabulary, two implementations (the tests compare them).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from importlib import util
from pathlib import Path
from typing import TYPE_CHECKING

from hs_dataset.demo.tiny import train_byte_level_bpe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["KIMI_CHAT_TEMPLATE", "KIMI_SPECIAL_TOKENS", "MEDIA_PROC_CFG", "kimi_chat_template", "kimi_fast_tokenizer",
           "make_kimi_tokenizer"]

_DATA = Path(__file__).resolve().parent / "data" / "kimi_tiny"
KIMI_CHAT_TEMPLATE = _DATA / "chat_template.jinja"

# Kimi-style special tokens, in id order right after the mergeable ranks.
KIMI_SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<think>", "</think>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[UNK]", "[PAD]",
)
_NAMED = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}

# The vision geometry SGLang's Kimi-K2.5 processor reads (matches tests/gpu_models.py's tiny MoonViT).
MEDIA_PROC_CFG = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 1024, "patch_limit_on_one_side": 64,
    "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "temporal_merge_kernel_size": 4,
}


def kimi_chat_template() -> str:
    """The Kimi-K2.5-style thinking chat template of the tiny directory."""
    return KIMI_CHAT_TEMPLATE.read_text(encoding="utf-8")


def _ranks() -> dict[bytes, int]:
    """Mergeable ranks of the tiny BPE: the 256 bytes (in byte order), then each merge's new token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # deferred: transformers takes seconds to import

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    model = json.loads(train_byte_level_bpe().to_str())["model"]
    ranks = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(bytes(byte_of[c] for c in left + right), len(ranks))
    return ranks


def make_kimi_tokenizer(out_dir: str | os.PathLike[str]) -> Path:
    """Write a Kimi-K2.5-packaged tokenizer (and text-only processor) to ``out_dir``.

    Files: ``tiktoken.model``, ``tokenization_kimi.py`` (``TikTokenTokenizer``), ``tokenizer_config.json``
    (``auto_map``, special tokens), ``chat_template.jinja``, ``kimi_k25_processor.py`` and
    ``preprocessor_config.json`` (``auto_map`` for ``AutoProcessor``/``AutoImageProcessor``,
    ``media_proc_cfg``). Load it with ``AutoTokenizer.from_pretrained(out_dir, trust_remote_code=True)``.
    Deterministic; returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = _ranks()
    lines = [f"{base64.b64encode(t).decode('ascii')} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "tiktoken.model").write_text("".join(lines), encoding="ascii")
    for name in ("tokenization_kimi.py", "kimi_k25_processor.py", "chat_template.jinja"):
        shutil.copyfile(_DATA / name, out / name)
    first = len(ranks)
    added = {str(first + k): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True} for k, t in enumerate(KIMI_SPECIAL_TOKENS)}
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in KIMI_SPECIAL_TOKENS if t not in _NAMED.values()],
        **_NAMED,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    pre = {
        "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor",
                     "AutoImageProcessor": "kimi_k25_processor.KimiK25VisionProcessor"},
        "image_processor_type": "KimiK25VisionProcessor",
        "processor_class": "KimiK25Processor",
        "media_proc_cfg": MEDIA_PROC_CFG,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=1) + "\n", encoding="utf-8")
    return out


def kimi_fast_tokenizer(kimi_dir: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """The vocabulary of a :func:`make_kimi_tokenizer` directory as a fast tokenizer, converted by
    ``transformers``' ``TikTokenConverter`` (same ranks, same pattern, same special-token ids)."""
    from transformers import PreTrainedTokenizerFast  # deferred: transformers takes seconds to import
    from transformers.convert_slow_tokenizer import TikTokenConverter  # deferred: transformers takes seconds to import

    d = Path(kimi_dir)
    ranks_path = d / "tiktoken.model"
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    specials = [v["content"] for _, v in sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))]

    class _LocalRanks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:  # no tiktoken file cache
            return {base64.b64decode(t): int(r) for t, r in (line.split() for line in Path(tiktoken_url).read_text(
                encoding="ascii").splitlines() if line.strip())}

    spec = util.spec_from_file_location("_hs_tiny_kimi_tok", d / "tokenization_kimi.py")
    assert spec is not None and spec.loader is not None
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    backend = _LocalRanks(str(ranks_path), pattern=module.PATTERN, extra_special_tokens=specials).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, model_max_length=4096,
                                  **{k: v for k, v in _NAMED.items()})
    tok.chat_template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    return tok

"""Tiny random-weight models and tokenizers for the demo and the tests, made locally (no downloads).

* :func:`make_tiny_tokenizer` trains a small byte-level BPE (:func:`train_byte_level_bpe`) on the
  bundled text (``hs_dataset/demo/data/tiny_corpus.txt``) with the special tokens and a real Jinja chat
  template of one of three styles: ``"chatml"`` (Qwen), ``"llama3"`` or ``"deepseek"`` (DeepSeek-V3).
  :mod:`hs_dataset.demo.tiny_kimi` packages the same BPE as Kimi-K2.5's tiktoken tokenizer.
* :func:`make_tiny_llama` makes a random-weight ``LlamaForCausalLM`` saved in bfloat16.
* :func:`make_tiny_model_dir` puts both in one directory, deterministically for a seed.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATES",
    "TEMPLATE_STYLES",
    "make_tiny_llama",
    "make_tiny_model_dir",
    "make_tiny_tokenizer",
    "tiny_corpus_path",
    "train_byte_level_bpe",
]

TINY_VOCAB_SIZE = 1536

# ChatML as Qwen2.5 ships it, minus the tool-call branches and the default system prompt.
_CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Meta-Llama-3-8B-Instruct's template (content is trimmed, BOS rendered by the template).
_LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# DeepSeek-V3's template, minus the tool-call branches: the system prompt is rendered right after
# BOS, whatever its position; user turns are '<｜User｜>...', assistant turns
# '<｜Assistant｜>...<｜end▁of▁sentence｜>'.
_DEEPSEEK_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}"
    "{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

CHAT_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML_TEMPLATE,
    "llama3": _LLAMA3_TEMPLATE,
    "deepseek": _DEEPSEEK_TEMPLATE,
}
TEMPLATE_STYLES = tuple(CHAT_TEMPLATES)


@dataclass(frozen=True)
class _Style:
    special: tuple[str, ...]  # all special tokens, in id order (ids 0..n-1)
    bos: str | None
    eos: str
    pad: str


_STYLES: dict[str, _Style] = {
    "chatml": _Style(
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
    ),
    "llama3": _Style(
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|finetune_right_pad_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
    ),
    "deepseek": _Style(
        special=(
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜▁pad▁｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
        ),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        pad="<｜▁pad▁｜>",
    ),
}


def tiny_corpus_path() -> Path:
    """The bundled English text the tiny BPE is trained on."""
    return Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


def _check_style(template: str) -> _Style:
    if template not in _STYLES:
        raise ValueError(f"unknown template style {template!r}; choose one of {list(TEMPLATE_STYLES)}")
    return _STYLES[template]


def train_byte_level_bpe(special: Sequence[str] = (), vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE (GPT-2 style: all 256 bytes, then merges) trained on the bundled corpus.

    ``special`` tokens take ids ``0..len(special)-1`` and count in ``vocab_size``. Deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # deferred: a slow import

    text = tiny_corpus_path().read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    return bpe


def make_tiny_tokenizer(out_dir: str | os.PathLike[str], template: str = "chatml") -> PreTrainedTokenizerFast:
    """Train a ~1.5k-token byte-level BPE with ``template``'s special tokens and chat template.

    Deterministic (the corpus is bundled); saved with ``save_pretrained`` to ``out_dir`` and
    returned as a ``PreTrainedTokenizerFast``.
    """
    from transformers import PreTrainedTokenizerFast  # deferred: a slow import

    style = _check_style(template)
    bpe = train_byte_level_bpe(style.special)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=style.bos,
        eos_token=style.eos,
        pad_token=style.pad,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATES[template]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return tok


def make_tiny_llama(
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    random_norms: bool = False,
) -> LlamaForCausalLM:
    """Make a random-weight ``LlamaForCausalLM`` (seeded) and save it in bfloat16 to ``out_dir``.

    ``random_norms``: draw every RMSNorm weight from U(0.5, 1.5) instead of leaving it all ones (a
    model on which "before" and "after" the final norm differ by more than a scale).
    """
    import torch  # deferred: the demo's model is made once, with transformers
    import transformers  # deferred: a slow import
    from transformers import LlamaConfig, LlamaForCausalLM  # deferred: a slow import

    if hidden_size % heads or heads % kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of heads ({heads}), and heads a "
            f"multiple of kv_heads ({kv_heads})"
        )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    config.dtype = torch.bfloat16
    with torch.random.fork_rng(devices=[]):  # seed the CPU generator without touching the caller's
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        if random_norms:
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    with torch.no_grad():
                        p.uniform_(0.5, 1.5)
    model = model.to(torch.bfloat16).eval()  # type: ignore[arg-type]  # transformers' stub types .to() narrowly
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    transformers.logging.disable_progress_bar()  # no "Writing model shards" bar before a build's own
    try:
        model.save_pretrained(str(out))
    finally:
        with warnings.catch_warnings():  # HF_HUB_DISABLE_PROGRESS_BARS=1: huggingface_hub warns, and keeps them off
            warnings.simplefilter("ignore")
            transformers.logging.enable_progress_bar()
    return model


_MARKER = "tiny_model.json"
_DONE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def make_tiny_model_dir(out_dir: str | os.PathLike[str], template: str = "chatml", seed: int = 0,
                        random_norms: bool = False) -> Path:
    """Make a tiny tokenizer + random Llama in ``out_dir`` (idempotent, deterministic for a seed).

    If the directory already holds a complete tiny model, return at once; if it was made with
    another template, seed or ``random_norms`` (see :func:`make_tiny_llama`), raise (use another directory).
    """
    _check_style(template)
    out = Path(out_dir)
    marker = out / _MARKER
    if all((out / f).exists() for f in _DONE_FILES):
        if marker.exists():
            made = json.loads(marker.read_text(encoding="utf-8"))
            if (made.get("template"), made.get("seed"), made.get("random_norms", False)) != (template, seed,
                                                                                           random_norms):
                raise ValueError(
                    f"{out} already holds a tiny model made with {made}, not "
                    f"template={template!r} seed={seed} random_norms={random_norms}; use another directory or delete it"
                )
        return out
    tok = make_tiny_tokenizer(out, template)
    make_tiny_llama(
        out,
        vocab_size=len(tok),
        seed=seed,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        random_norms=random_norms,
    )
    made = {"template": template, "seed": seed, **({"random_norms": True} if random_norms else {})}
    marker.write_text(json.dumps(made) + "\n", encoding="utf-8")
    return out

"""Tests of the tiny local models and tokenizers (hs_dataset.demo.tiny)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hs_dataset.demo.tiny import TEMPLATE_STYLES, make_tiny_llama, make_tiny_model_dir, make_tiny_tokenizer
from hs_dataset.prepare.tokenizer import load_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]

# The exact renderings of MESSAGES with add_generation_prompt=True, as the real models' templates give them.
EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "deepseek": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
    "<｜User｜>Bye<｜Assistant｜>",
}
SPECIALS = {
    "chatml": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "deepseek": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model") / "m", "llama3", seed=0)


@pytest.mark.parametrize("style", TEMPLATE_STYLES)
def test_tiny_tokenizer(tmp_path: Path, style: str) -> None:
    t0 = time.perf_counter()
    tok = make_tiny_tokenizer(tmp_path, style)
    assert time.perf_counter() - t0 < 5
    assert 1000 <= len(tok) <= 2000
    assert (tmp_path / "tokenizer.json").exists()
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == EXPECTED[style]
    # Without the generation prompt, the rendering stops after the last message.
    no_prompt = tok.apply_chat_template(MESSAGES[:3], tokenize=False)
    assert EXPECTED[style].startswith(no_prompt) and no_prompt.endswith(("<|im_end|>\n", "<|eot_id|>", "<｜end▁of▁sentence｜>"))
    for special in SPECIALS[style]:
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [special]
    # Reloaded from disk, it is the same tokenizer with the same template.
    again = load_tokenizer(tmp_path)
    assert again.chat_template == tok.chat_template
    text = EXPECTED[style] + " Some plain English text, with numbers 123 and ünïcödé."
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.decode(again(text, add_special_tokens=False)["input_ids"]) == text


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    make_tiny_tokenizer(tmp_path / "a", "chatml")
    make_tiny_tokenizer(tmp_path / "b", "chatml")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="unknown template style"):
        make_tiny_tokenizer(tmp_path / "c", "mistral")


def test_tiny_llama_is_bf16_and_runs(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    make_tiny_llama(tmp_path, vocab_size=300, hidden_size=32, num_layers=2, heads=4, kv_heads=2, seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 300
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (32, 2, 4, 2)
    assert config["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3, 299]]), output_hidden_states=True)
    assert out.logits.shape == (1, 4, 300)
    assert len(out.hidden_states) == 3 and all(torch.isfinite(h.float()).all() for h in out.hidden_states)
    with pytest.raises(ValueError, match="multiple"):
        make_tiny_llama(tmp_path / "bad", vocab_size=10, hidden_size=30, heads=4)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_tiny_model_dir(model_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tok)
    assert config["bos_token_id"] == tok.bos_token_id and config["eos_token_id"] == tok.eos_token_id
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == EXPECTED["llama3"]

    # Idempotent: a second call returns at once and changes nothing.
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    t0 = time.perf_counter()
    assert make_tiny_model_dir(model_dir, "llama3", seed=0) == model_dir
    assert time.perf_counter() - t0 < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    with pytest.raises(ValueError, match="already holds"):
        make_tiny_model_dir(model_dir, "chatml", seed=0)

    # Deterministic for a seed; another seed gives other weights but the same tokenizer.
    same = make_tiny_model_dir(tmp_path / "same", "llama3", seed=0)
    assert _files(same) == _files(model_dir)
    other = make_tiny_model_dir(tmp_path / "other", "llama3", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def test_tiny_model_runs_on_a_chat(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tok: Any = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 4 + 1
    assert out.hidden_states[-1].shape == (1, ids.shape[1], 64)

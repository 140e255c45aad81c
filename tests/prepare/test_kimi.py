"""Kimi-K2.5 as it ships, on the CPU: a tiktoken tokenizer behind trust_remote_code, the thinking chat
template, image parts rejected, and the Kimi preset run end to end on a tiny Kimi-K2.5 directory."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hs_dataset.demo.tiny_kimi import KIMI_SPECIAL_TOKENS, kimi_chat_template, kimi_fast_tokenizer
from hs_dataset.errors import ConfigError, SampleError
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.loss_mask import assistant_char_spans, tokenize_conversation, tokenize_sample
from hs_dataset.prepare.sources import iter_source
from hs_dataset.prepare.token_offsets import offsets_method
from hs_dataset.prepare.tokenizer import load_tokenizer
from hs_dataset.read.iterate import iter_torch
from hs_dataset.records import Conversation, Message, SourceRow
from tests.fixtures.builds import DEMO, IMAGE_ROW, ROOT, THINKING_ROWS, load_built, write_thinking_source

PRESET = ROOT / "builder_scripts" / "kimi_eagle3_hs.py"


@pytest.fixture(scope="module")
def slow(kimi: Any) -> Any:
    return kimi


@pytest.fixture(scope="module")
def fast(kimi_dir: Path) -> Any:
    return kimi_fast_tokenizer(kimi_dir)


def masked_runs(tok: Any, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded text of each run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def conv(*turns: tuple[str, str] | tuple[str, str, str]) -> Conversation:
    return Conversation("c", [Message(*t) for t in turns])


# ----------------------------------------------------------------------------------------------
# The tokenizer directory and trust_remote_code
# ----------------------------------------------------------------------------------------------


def test_directory_is_packaged_like_kimis(kimi_dir: Path, slow: Any) -> None:
    assert not (kimi_dir / "tokenizer.json").exists()
    cfg = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    assert cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    assert type(slow).__name__ == "TikTokenTokenizer" and not slow.is_fast
    assert offsets_method(slow) == "tiktoken bytes"
    n_ranks = sum(1 for line in (kimi_dir / "tiktoken.model").read_text().splitlines() if line)
    for k, special in enumerate(KIMI_SPECIAL_TOKENS):
        assert slow.encode(special, add_special_tokens=False) == [n_ranks + k]
    assert len(slow) == n_ranks + len(KIMI_SPECIAL_TOKENS)
    assert slow.chat_template == kimi_chat_template()


def test_without_trust_remote_code_one_line_names_the_option(kimi_dir: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        load_tokenizer(kimi_dir)
    msg = str(ei.value)
    assert "\n" not in msg and "--set trust_remote_code=true" in msg and "tokenization_kimi.TikTokenTokenizer" in msg


def test_tiktoken_ranks_load_offline_without_a_cache(kimi_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks are a local file: loading opens no connection and writes no tiktoken cache."""
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))

    def no_network(*_a: Any, **_k: Any) -> None:
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    tok = load_tokenizer(kimi_dir, trust_remote_code=True)
    assert tok.decode(tok.encode("offline 你好", add_special_tokens=False)) == "offline 你好"
    assert list(cache.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# One vocabulary, fast and slow: identical ids and masks
# ----------------------------------------------------------------------------------------------


def test_fast_and_tiktoken_slow_give_identical_ids_and_masks(slow: Any, fast: Any) -> None:
    rows = list(iter_source(str(DEMO))) + [SourceRow(f"t{i}", i, r) for i, r in enumerate(THINKING_ROWS)
                                           if i != IMAGE_ROW]
    assert len(rows) > 20
    for r in rows:
        parsed = parse_row(r)
        for mask in ("all", "last"):
            a = tokenize_sample(parsed, slow, max_length=4096, mask=mask)
            b = tokenize_sample(parsed, fast, max_length=4096, mask=mask)
            assert a.input_ids.tolist() == b.input_ids.tolist(), r.sample_id
            assert a.loss_mask.tolist() == b.loss_mask.tolist(), (r.sample_id, mask)
            assert a.loss_mask.sum() > 0


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Co", "Cn")), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user=TEXT, reply=TEXT.filter(str.strip), reasoning=st.none() | TEXT)
def test_slow_mask_equals_fast_mask_on_any_text(slow: Any, fast: Any, user: str, reply: str,
                                                reasoning: str | None) -> None:
    c = conv(("user", user), ("assistant", reply, reasoning), ("user", user[::-1] or "x"), ("assistant", reply))
    a = tokenize_conversation(c, slow, max_length=10_000)
    b = tokenize_conversation(c, fast, max_length=10_000)
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a.loss_mask.tolist() == b.loss_mask.tolist()


def hiding_tiktoken(cls: type, **attrs: Any) -> type:
    """A subclass whose tiktoken encoding is not an instance attribute (so not found by the offsets code)."""
    store: dict[int, Any] = {}
    model = property(lambda self: store[id(self)], lambda self, v: store.__setitem__(id(self), v))
    return type(f"Hidden{cls.__name__}", (cls,), {"model": model, **attrs})


def test_byte_level_path_gives_the_same_mask(kimi_dir: Path, slow: Any) -> None:
    """Without the tiktoken encoding in sight, the byte-level token strings (``byte_decoder``) place the mask."""
    tok = hiding_tiktoken(type(slow)).from_pretrained(str(kimi_dir))
    assert offsets_method(tok) == "byte-level bytes"
    c = conv(("user", "Zähle bis 3 🙂"), ("assistant", "1, 2, 3 — 中文", "count"))
    a, b = tokenize_conversation(c, tok, max_length=512), tokenize_conversation(c, slow, max_length=512)
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()


def test_slow_tokenizers_that_are_not_exact_bytes_are_refused(kimi_dir: Path, slow: Any) -> None:
    cls = type(slow)
    # No tiktoken encoding, no byte-level vocabulary: refused at load time.
    opaque = hiding_tiktoken(cls, byte_decoder=property(lambda self: None, lambda self, v: None))
    with pytest.raises(ConfigError, match="not exact bytes"):
        offsets_method(opaque.from_pretrained(str(kimi_dir)), kimi_dir)
    # Tokens that do not spell the text (a tokenizer that strips an accent): that sample is rejected.
    strip = type("AccentStripping", (cls,),
                 {"_tokenize": lambda self, text, **k: cls._tokenize(self, text.replace("é", "e"))})
    tok = strip.from_pretrained(str(kimi_dir))
    with pytest.raises(SampleError, match="do not spell the rendered text"):
        tokenize_conversation(conv(("user", "Un café ?"), ("assistant", "Oui.")), tok, max_length=512)
    tokenize_conversation(conv(("user", "Un the ?"), ("assistant", "Oui.")), tok, max_length=512)


# ----------------------------------------------------------------------------------------------
# Thinking content: the template's own rendering decides (tokenize_mask's module docstring)
# ----------------------------------------------------------------------------------------------

THINK = conv(("user", "Name a prime."), ("assistant", "7 is prime.", "Small primes: 2, 3, 5, 7."),
             ("user", "An even one?"), ("assistant", "2.", "Even: only 2."))


def with_template(slow: Any, template: str) -> Any:
    import copy

    tok = copy.copy(slow)
    tok.chat_template = template
    return tok


def test_kimi_template_renders_no_reasoning_up_to_the_last_plain_reply(slow: Any) -> None:
    """Kimi-K2.5's structure: every assistant turn up to the last one without tool calls is history and
    renders an empty <think></think>; the generation prompt ends with <think>, so a turn's mask is
    '</think>' + reply + '<|im_end|>' and no reasoning is trained on."""
    full, spans = assistant_char_spans(slow, THINK.messages)
    assert "primes" not in full and "only 2" not in full
    assert [full[a:b] for a, b in spans] == ["</think>7 is prime.<|im_end|>", "</think>2.<|im_end|>"]
    s = tokenize_conversation(THINK, slow, max_length=512)
    assert masked_runs(slow, s.input_ids, s.loss_mask) == ["</think>7 is prime.<|im_end|>", "</think>2.<|im_end|>"]
    last = tokenize_conversation(THINK, slow, max_length=512, mask="last")
    assert masked_runs(slow, last.input_ids, last.loss_mask) == ["</think>2.<|im_end|>"]


def test_template_keeping_all_reasoning_masks_it_in_every_turn(slow: Any) -> None:
    """No history split (like Kimi-K2.6's preserve_thinking): each turn's reasoning is rendered and masked."""
    keep = with_template(slow, kimi_chat_template().replace("{%- set ns.history_end = loop.index0 -%}", ""))
    s = tokenize_conversation(THINK, keep, max_length=512)
    assert masked_runs(keep, s.input_ids, s.loss_mask) == ["Small primes: 2, 3, 5, 7.</think>7 is prime.<|im_end|>",
                                                           "Even: only 2.</think>2.<|im_end|>"]


def test_template_rendering_history_differently_needs_mask_last(slow: Any) -> None:
    """Reasoning kept only after the last user turn (Qwen3's rule): the first reply renders with its
    reasoning while it is the last turn and without it once the conversation goes on. mask=all
    rejects the sample; mask=last masks the last turn as rendered, history as context."""
    tpl = kimi_chat_template().replace(
        "{%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}",
        "{%- if message['role'] == 'user' -%}").replace("{%- set ns.history_end = loop.index0 -%}",
                                                        "{%- set ns.history_end = loop.index0 - 1 -%}")
    qwen_like = with_template(slow, tpl)
    with pytest.raises(SampleError) as ei:
        tokenize_conversation(THINK, qwen_like, max_length=512)
    assert ei.value.field == "chat_template" and "not prefix-stable at turn 1" in ei.value.reason
    assert "mask=last" in ei.value.reason
    s = tokenize_conversation(THINK, qwen_like, max_length=512, mask="last")
    assert masked_runs(qwen_like, s.input_ids, s.loss_mask) == ["Even: only 2.</think>2.<|im_end|>"]
    assert "Small primes" not in qwen_like.decode(s.input_ids.tolist())
    one = conv(*[(m.role, m.content, m.reasoning_content) for m in THINK.messages[:2]])
    s = tokenize_conversation(one, qwen_like, max_length=512)
    assert masked_runs(qwen_like, s.input_ids, s.loss_mask) == [
        "Small primes: 2, 3, 5, 7.</think>7 is prime.<|im_end|>"]


# ----------------------------------------------------------------------------------------------
# Source rows: reasoning_content is carried, image inputs are rejected
# ----------------------------------------------------------------------------------------------


def test_reasoning_is_parsed_and_images_are_rejected_not_dropped() -> None:
    parsed = parse_row(SourceRow("r", 0, THINKING_ROWS[1]))
    assert [m.reasoning_content for m in parsed.messages] == [None, None, "Small primes: 2, 3, 5, 7.", None,
                                                              "Even: only 2."]
    with pytest.raises(SampleError) as ei:
        parse_row(SourceRow("r", 0, THINKING_ROWS[IMAGE_ROW]))
    assert ei.value.field == "messages[0].content[1]" and "image inputs are not supported yet" in ei.value.reason
    for part in ({"type": "image", "image": "x.png"}, {"image_url": {"url": "u"}}, {"type": "input_audio"}):
        with pytest.raises(SampleError, match="inputs are not supported yet"):
            parse_row(SourceRow("r", 0, {"messages": [{"role": "user", "content": [part]},
                                                      {"role": "assistant", "content": "x"}]}))
    llava = {"image": "cat.jpg", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                                   {"from": "gpt", "value": "A cat."}]}
    with pytest.raises(SampleError) as ei:
        parse_row(SourceRow("r", 0, llava))
    assert ei.value.field == "image" and "image inputs are not supported yet" in ei.value.reason
    with pytest.raises(SampleError, match="only assistant turns carry reasoning"):
        parse_row(SourceRow("r", 0, {"messages": [{"role": "user", "content": "q", "reasoning_content": "r"},
                                                  {"role": "assistant", "content": "a"}]}))


# ----------------------------------------------------------------------------------------------
# The Kimi preset end to end on a tiny Kimi-K2.5 directory (transformers backend, CPU)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.gpu.models import make_kimi_k25

    return make_kimi_k25(tmp_path_factory.mktemp("kimi-k25") / "tiny-kimi-k25", hidden=64, vocab=2048)


def test_processor_gives_what_sglangs_kimi_k25_processor_reads(kimi_model: Path) -> None:
    """SGLang builds its Kimi-K2.5 multimodal processor (sglang/srt/multimodal/processors/kimi_k25.py) from
    AutoProcessor(trust_remote_code=True) of the model directory: it reads processor.tokenizer,
    processor.image_processor, processor.media_processor.media_proc_cfg[...] and the config's
    media_placeholder_token_id (the <|media_pad|> token)."""
    from PIL import Image
    from transformers import AutoProcessor

    cfg = json.loads((kimi_model / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoProcessor.from_pretrained(str(kimi_model), trust_remote_code=False)
    proc = AutoProcessor.from_pretrained(str(kimi_model), trust_remote_code=True)
    assert type(proc.tokenizer).__name__ == "TikTokenTokenizer" and proc.image_processor is proc.media_processor
    mp = proc.media_processor.media_proc_cfg
    for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean",
                "image_std"):
        assert key in mp, key
    assert "fixed_output_tokens" in mp
    assert (mp["patch_size"], [mp["merge_kernel_size"]] * 2) == (cfg["vision_config"]["patch_size"],
                                                                cfg["vision_config"]["merge_kernel_size"])
    assert proc.tokenizer.convert_ids_to_tokens([cfg["media_placeholder_token_id"]]) == ["<|media_pad|>"]
    text = "<|im_user|>user<|im_middle|>hi"
    assert proc(text=[text])["input_ids"][0] == proc.tokenizer.encode(text, add_special_tokens=False)
    # 280 x 140 pixels = 20 x 10 patches of 14, merged 2 x 2: 50 placeholder tokens.
    assert proc.media_processor.media_tokens_calculator({"type": "image", "image": Image.new("RGB", (280, 140))}) == 50
    names = {p.name for p in kimi_model.iterdir()}
    assert {"model.safetensors", "tiktoken.model", "tokenization_kimi.py", "kimi_k25_processor.py",
            "preprocessor_config.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    from safetensors import safe_open

    with safe_open(str(kimi_model / "model.safetensors"), "pt") as f:
        prefixes = {k.split(".")[0] for k in f.keys()}
    assert prefixes == {"language_model", "vision_tower", "mm_projector"}


def run_preset(out: Path, model: Path, source: Path, *extra: str) -> subprocess.CompletedProcess:
    sets = [f"model={model}", f"source={source}", "backend=transformers",
            'backend_options={"device": "cpu", "batch_tokens": 4096}', "layers=[0,2,3]", "max_length=512",
            "part_size=2", *extra]
    cmd = [sys.executable, "-m", "hs_dataset.cli", "build", str(PRESET), "--output", str(out), "--no-progress",
           "--max-reject-rate", "0.2"]  # the image row is 1 reject of 5: more than the default 0.1
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_kimi_preset_end_to_end_on_a_tiny_kimi_k25(kimi_model: Path, tmp_path: Path) -> None:
    source = write_thinking_source(tmp_path / "thinking.jsonl")
    # Without trust_remote_code: the build stops on a one-line error naming the option (exit 2), nothing built.
    r = run_preset(tmp_path / "refused", kimi_model, source, "trust_remote_code=false")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = [line for line in r.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("hs-dataset build: error: ") and "--set trust_remote_code=true" in last, r.stderr[-3000:]
    assert not (tmp_path / "refused" / "hs_dataset.json").exists()

    out = tmp_path / "kimi-hs"
    r = run_preset(out, kimi_model, source)
    assert r.returncode == 0 and "image inputs are not supported yet" in r.stdout, r.stderr[-3000:]  # the breakdown
    meta = json.loads((out / "hs_dataset.json").read_text())
    assert meta["config"]["trust_remote_code"] is True
    assert {k: meta["tokenizer"][k] for k in ("class", "trust_remote_code", "token_offsets")} == {
        "class": "TikTokenTokenizer", "trust_remote_code": True, "token_offsets": "tiktoken bytes"}
    assert meta["model"]["architecture"] == "KimiK25ForConditionalGeneration"
    readme = (out / "README.md").read_text()
    assert "| tokenizer's own code trusted (`trust_remote_code`) | yes |" in readme
    assert "`TikTokenTokenizer`, token offsets from tiktoken bytes" in readme
    assert meta["counts"]["samples_in"] == len(THINKING_ROWS) and meta["counts"]["written"] == len(THINKING_ROWS) - 1
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 1 and "image inputs are not supported yet" in rejects[0]["reason"]

    # Rows: the slow tiktoken tokenizer's ids and masks; states of the text model (a DeepSeek-V3 made of
    # the same language_model.* tensors), built the same way from the plain DeepSeek-V3 directory.
    slow = load_tokenizer(kimi_model, trust_remote_code=True)
    rows = list(iter_torch(load_built(out)))
    kept = [r for i, r in enumerate(THINKING_ROWS) if i != IMAGE_ROW]
    for row, raw in zip(rows, kept):
        want = tokenize_sample(parse_row(SourceRow("x", 0, raw)), slow, max_length=512)
        assert row["input_ids"].tolist() == want.input_ids.tolist()
        assert row["loss_mask"].tolist() == want.loss_mask.tolist()
    text_dir = kimi_model.parent / f".{kimi_model.name}-text"
    ref_out = tmp_path / "dsv3-hs"
    r = run_preset(ref_out, text_dir, source, f"tokenizer={kimi_model}")
    assert r.returncode == 0, r.stderr[-3000:]
    ref = list(iter_torch(load_built(ref_out)))
    assert len(ref) == len(rows)
    for a, b in zip(rows, ref):
        for col in ("hidden_layer_0", "hidden_layer_2", "hidden_layer_3", "hidden_final"):
            assert a[col].dtype == torch.bfloat16 and torch.equal(a[col], b[col]), col


def test_specforge_round_trip_of_a_kimi_build_records_trust_remote_code(kimi_model: Path, tmp_path: Path) -> None:
    """Importing hidden states of Kimi-K2.5 (raw tokens) still loads its tokenizer for the record: the
    import needs the same opt-in (``hs-dataset import --trust-remote-code``)."""
    from hs_dataset.write.driver import build
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.interop import export_specforge, import_dataset

    source = write_thinking_source(tmp_path / "thinking.jsonl")
    # three aux layers below L-1 (SpecForge's contract; L-1 is the pre-norm last layer, not an aux layer)
    cfg = HiddenStatesConfig(model=str(kimi_model), source=str(source), layers=(0, 1, 2), max_length=512,
                             trust_remote_code=True, backend_options={"device": "cpu"})
    build(cfg, tmp_path / "built", progress=False)
    export_specforge(tmp_path / "built", tmp_path / "specforge")
    with pytest.raises(ConfigError, match="trust_remote_code"):
        import_dataset(tmp_path / "specforge", "specforge", tmp_path / "refused")
    s = import_dataset(tmp_path / "specforge", "specforge", tmp_path / "imported", trust_remote_code=True)
    assert s.written == len(THINKING_ROWS) - 1
    meta = json.loads((tmp_path / "imported" / "hs_dataset.json").read_text())
    assert meta["tokenizer"]["trust_remote_code"] is True and meta["config"]["trust_remote_code"] is True
    a, b = list(iter_torch(load_built(tmp_path / "built"))), list(iter_torch(load_built(tmp_path / "imported")))
    assert [r["id"] for r in a] == [r["id"] for r in b]
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["hidden_layer_2"], y["hidden_layer_2"])

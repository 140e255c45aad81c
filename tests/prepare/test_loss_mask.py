"""Tests of the tokenize + loss-mask stage against the three tiny template styles."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hs_dataset.demo.tiny import TEMPLATE_STYLES, make_tiny_tokenizer
from hs_dataset.errors import SampleError
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.loss_mask import assistant_char_spans, tokenize_conversation, tokenize_sample
from hs_dataset.prepare.sources import iter_source
from hs_dataset.prepare.tokenizer import chat_template_sha256, load_tokenizer
from hs_dataset.records import Conversation, Message, SourceRow, TokenizedSample

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "builder_scripts" / "data" / "demo_conversations.jsonl"

# What each template renders right after an assistant reply (the end-of-turn marker(s)).
END_OF_TURN = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "deepseek": "<｜end▁of▁sentence｜>"}


@pytest.fixture(scope="session")
def tok_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for style in TEMPLATE_STYLES:
        d = tmp_path_factory.mktemp(f"tok_{style}")
        make_tiny_tokenizer(d, style)
        dirs[style] = d
    return dirs


@pytest.fixture(scope="session")
def toks(tok_dirs: dict[str, Path]) -> dict[str, Any]:
    return {style: load_tokenizer(d) for style, d in tok_dirs.items()}


SYSTEM = "You are a careful assistant."
TURNS = [
    ("user", "What is the capital of France?"),
    ("assistant", "The capital of France is Paris."),
    ("user", "And of Italy?"),
    ("assistant", "Rome is the capital of Italy.\nIt is also its largest city."),
    ("user", "Thanks!"),
    ("assistant", "You are welcome."),
]


def make_conv(system: bool = True, turns: list[tuple[str, str]] = TURNS) -> Conversation:
    msgs = ([Message("system", SYSTEM)] if system else []) + [Message(r, c) for r, c in turns]
    return Conversation("c:0", msgs)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def masked_texts(tok: Any, s: TokenizedSample) -> list[str]:
    return [tok.decode(s.input_ids[a:b].tolist()) for a, b in runs(s.loss_mask)]


def replies(conv: Conversation, style: str) -> list[str]:
    # Llama-3's template trims the content; the others render it as is.
    return [
        (m.content.strip() if style == "llama3" else m.content) + END_OF_TURN[style]
        for m in conv.messages
        if m.role == "assistant"
    ]


@pytest.mark.parametrize("style", TEMPLATE_STYLES)
@pytest.mark.parametrize("system", [True, False])
def test_mask_covers_exactly_the_assistant_replies(toks: dict[str, Any], style: str, system: bool) -> None:
    tok = toks[style]
    conv = make_conv(system)
    s = tokenize_conversation(conv, tok, max_length=4096)
    assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
    assert s.input_ids.shape == s.loss_mask.shape and not s.truncated
    # The tokens are those of the template's own rendering.
    full = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in conv.messages], tokenize=False)
    assert s.input_ids.tolist() == tok(full, add_special_tokens=False)["input_ids"]
    assert tok.decode(s.input_ids.tolist()) == full
    # Each masked run decodes to one reply plus its end-of-turn marker, and nothing else is masked.
    assert masked_texts(tok, s) == replies(conv, style)
    # No user or system token is masked: check their characters through the offsets.
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for m in conv.messages:
        if m.role == "assistant":
            continue
        start = full.index(m.content)
        end = start + len(m.content)
        for k, (a, b) in enumerate(offsets):
            if a < end and b > start:
                assert s.loss_mask[k] == 0, (m, k)
    # Template headers (role names, BOS, generation prompts) are not masked either.
    unmasked = tok.decode(s.input_ids[s.loss_mask == 0].tolist())
    for m in conv.messages:
        if m.role == "assistant":
            assert m.content.strip() not in unmasked


@pytest.mark.parametrize("style", TEMPLATE_STYLES)
def test_mask_last_covers_only_the_last_reply(toks: dict[str, Any], style: str) -> None:
    tok = toks[style]
    conv = make_conv(True)
    every = tokenize_conversation(conv, tok, max_length=4096, mask="all")
    last = tokenize_conversation(conv, tok, max_length=4096, mask="last")
    assert np.array_equal(every.input_ids, last.input_ids)
    assert masked_texts(tok, last) == replies(conv, style)[-1:]
    assert np.all(last.loss_mask <= every.loss_mask)
    last_run = runs(every.loss_mask)[-1]
    assert runs(last.loss_mask) == [last_run]


@pytest.mark.parametrize("style", TEMPLATE_STYLES)
def test_single_turn_and_reply_needing_trim(toks: dict[str, Any], style: str) -> None:
    tok = toks[style]
    conv = make_conv(False, [("user", "Hi"), ("assistant", "  Hello there.  ")])
    s = tokenize_conversation(conv, tok, max_length=4096)
    assert masked_texts(tok, s) == replies(conv, style)


def test_sharegpt_and_openai_give_the_same_tokens(toks: dict[str, Any]) -> None:
    sharegpt = {"conversations": [{"from": "system", "value": SYSTEM}] + [
        {"from": {"user": "human", "assistant": "gpt"}[r], "value": c} for r, c in TURNS
    ]}
    openai = {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}] + [
        {"role": r, "content": c} for r, c in TURNS
    ]}
    for tok in toks.values():
        a = tokenize_sample(parse_row(SourceRow("a", 0, sharegpt)), tok, max_length=4096)
        b = tokenize_sample(parse_row(SourceRow("a", 0, openai)), tok, max_length=4096)
        assert np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(a.loss_mask, b.loss_mask)


@pytest.mark.parametrize("style", TEMPLATE_STYLES)
def test_truncation_policies(toks: dict[str, Any], style: str) -> None:
    tok = toks[style]
    conv = make_conv(True)
    full = tokenize_conversation(conv, tok, max_length=4096)
    n = full.num_tokens
    first = int(np.flatnonzero(full.loss_mask)[0])

    exact = tokenize_conversation(conv, tok, max_length=n, truncation="reject")
    assert exact.num_tokens == n and not exact.truncated

    cut = tokenize_conversation(conv, tok, max_length=first + 3, truncation="truncate")
    assert cut.truncated and cut.num_tokens == first + 3
    assert np.array_equal(cut.input_ids, full.input_ids[: first + 3])
    assert cut.loss_mask.tolist() == full.loss_mask[: first + 3].tolist()
    assert int(cut.loss_mask.sum()) == 3

    with pytest.raises(SampleError) as ei:
        tokenize_conversation(conv, tok, max_length=first, truncation="truncate")
    assert ei.value.field == "input_ids" and "no assistant token" in ei.value.reason

    with pytest.raises(SampleError) as ei:
        tokenize_conversation(conv, tok, max_length=n - 1, truncation="reject")
    assert ei.value.field == "input_ids" and f"{n} tokens" in ei.value.reason and f"max_length={n - 1}" in ei.value.reason


def test_bad_options_are_config_errors(toks: dict[str, Any]) -> None:
    conv = make_conv()
    tok = toks["chatml"]
    for kwargs in ({"max_length": 0}, {"max_length": 10, "mask": "first"}, {"max_length": 10, "truncation": "drop"}):
        with pytest.raises(ValueError):
            tokenize_conversation(conv, tok, **kwargs)


def test_raw_token_rows(toks: dict[str, Any]) -> None:
    tok = toks["chatml"]
    vocab = len(tok)
    s = tokenize_sample(parse_row(SourceRow("r", 0, {"input_ids": [1, 2, vocab - 1], "loss_mask": [0, 1, 1]})), tok, max_length=8)
    assert s.input_ids.tolist() == [1, 2, vocab - 1] and s.loss_mask.tolist() == [0, 1, 1]
    assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
    with pytest.raises(SampleError) as ei:
        tokenize_sample(parse_row(SourceRow("r", 0, {"input_ids": [1, vocab, 2]})), tok, max_length=8)
    assert ei.value.field == "input_ids[1]"
    assert ei.value.reason == f"token id {vocab} out of vocabulary of size {vocab}"
    cut = tokenize_sample(parse_row(SourceRow("r", 0, {"input_ids": list(range(10))})), tok, max_length=4)
    assert cut.truncated and cut.input_ids.tolist() == [0, 1, 2, 3]
    with pytest.raises(SampleError, match="more than max_length=4"):
        tokenize_sample(parse_row(SourceRow("r", 0, {"input_ids": list(range(10))})), tok, max_length=4, truncation="reject")
    with pytest.raises(SampleError, match="no assistant token"):
        tokenize_sample(parse_row(SourceRow("r", 0, {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]})), tok, max_length=2)
    with pytest.raises(SampleError, match="nothing to train on"):
        tokenize_sample(parse_row(SourceRow("r", 0, {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]})), tok, max_length=8)


def test_demo_file_tokenizes_in_every_style(toks: dict[str, Any]) -> None:
    rows = list(iter_source(DEMO))
    for style, tok in toks.items():
        lengths = []
        for r in rows:
            s = tokenize_sample(parse_row(r), tok, max_length=4096)
            conv = parse_row(r)
            assert masked_texts(tok, s) == replies(conv, style), r.sample_id
            lengths.append(s.num_tokens)
        assert min(lengths) < 40 and max(lengths) > 300, lengths


# ----------------------------------------------------------------------------------------------
# Templates that cannot be used
# ----------------------------------------------------------------------------------------------


def with_template(tok_dir: Path, template: str) -> Any:
    tok = load_tokenizer(tok_dir)
    tok.chat_template = template
    return tok


def test_template_errors_are_sample_errors(tok_dirs: dict[str, Path]) -> None:
    raising = with_template(
        tok_dirs["chatml"],
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system prompts') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}",
    )
    with pytest.raises(SampleError) as ei:
        tokenize_conversation(make_conv(True), raising, max_length=4096)
    assert ei.value.field == "chat_template" and "no system prompts" in ei.value.reason
    # Without a system prompt the same template renders fine.
    tokenize_conversation(make_conv(False), raising, max_length=4096)

    broken = with_template(tok_dirs["chatml"], "{{ messages[0]['content'] + 1 }}")
    with pytest.raises(SampleError) as ei:
        tokenize_conversation(make_conv(False), broken, max_length=4096)
    assert ei.value.field == "chat_template"


def test_template_that_rewrites_history_is_rejected(tok_dirs: dict[str, Path]) -> None:
    # Like templates that drop the reasoning of earlier turns: earlier replies render differently
    # once the conversation goes on, so growing prefixes are not prefixes of the full text.
    history_rewriting = with_template(
        tok_dirs["chatml"],
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    with pytest.raises(SampleError) as ei:
        tokenize_conversation(make_conv(False), history_rewriting, max_length=4096)
    assert ei.value.field == "chat_template"
    assert "not prefix-stable at turn" in ei.value.reason
    # A single-turn conversation is fine with it.
    one = make_conv(False, TURNS[:2])
    s = tokenize_conversation(one, history_rewriting, max_length=4096)
    assert masked_texts(history_rewriting, s) == [TURNS[1][1] + "<|im_end|>\n"]


def test_assistant_char_spans(toks: dict[str, Any]) -> None:
    conv = make_conv(True)
    full, spans = assistant_char_spans(toks["chatml"], conv.messages)
    assert [full[a:b] for a, b in spans] == [c + "<|im_end|>\n" for r, c in TURNS if r == "assistant"]


def test_load_tokenizer_and_template_hash(tok_dirs: dict[str, Path], toks: dict[str, Any], tmp_path: Path) -> None:
    hashes = {style: chat_template_sha256(tok) for style, tok in toks.items()}
    assert len(set(hashes.values())) == 3
    for style, tok in toks.items():
        assert hashes[style] == hashlib.sha256(tok.chat_template.encode("utf-8")).hexdigest()
        assert tok.is_fast
    # No chat template.
    tok = load_tokenizer(tok_dirs["chatml"])
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    for f in (tmp_path / "plain").glob("chat_template*"):
        f.unlink()
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path / "plain")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path / "missing")


def test_load_tokenizer_rejects_slow_tokenizers(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    class Slow:
        is_fast = False
        chat_template = "{{ messages }}"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Slow())
    with pytest.raises(ValueError, match="not exact bytes"):
        load_tokenizer("anywhere")


# ----------------------------------------------------------------------------------------------
# Property: malformed rows only ever give SampleError
# ----------------------------------------------------------------------------------------------

_texts = st.one_of(
    st.text(max_size=30),
    st.builds(lambda a, s: a + s, st.text(max_size=5), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
    st.sampled_from(["", " ", "<|im_end|>", "<|eot_id|>", "<｜Assistant｜>", "{{ x }}", "{% if %}"]),
    st.integers(1, 400).map(lambda n: "long words " * n),
)
_junk = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | _texts | st.binary(max_size=4),
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=5), ch, max_size=3),
    max_leaves=8,
)
_roles = st.sampled_from(["system", "user", "human", "USER", "assistant", "gpt", "GPT", "model", "bing", "chatgpt",
                          "tool", "bot", "", " user"]) | _junk
_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | _junk}, optional={"text": _texts | _junk}),
    max_size=3,
)


def _turn(role_key: str, content_key: str) -> st.SearchStrategy[Any]:
    content = _texts | _junk | _parts if content_key == "content" else _texts | _junk
    valid = st.fixed_dictionaries({role_key: _roles, content_key: content})
    partial = st.fixed_dictionaries({}, optional={role_key: _roles, content_key: content, "extra": _junk})
    return st.one_of(valid, valid, partial, _junk)


_good_texts = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30).filter(str.strip),
    st.integers(1, 400).map(lambda n: "long words " * n),
)


def _alternating(role_key: str, content_key: str, names: tuple[str, str]) -> st.SearchStrategy[Any]:
    """Mostly valid conversations (optional system, alternating turns), sometimes with a bad text."""

    def build(system: str | None, texts: list[str]) -> list[dict[str, Any]]:
        out = [{role_key: "system", content_key: system}] if system is not None else []
        return out + [{role_key: names[k % 2], content_key: t} for k, t in enumerate(texts)]

    text = st.one_of(_good_texts, _good_texts, _good_texts, _texts)
    return st.builds(build, st.none() | text, st.lists(text, min_size=2, max_size=8))


_ids = st.lists(st.integers(-3, 3000) | st.sampled_from([2**40, 1.5, True, "7", None]), max_size=12)
_good_ids = st.lists(st.integers(0, 1535), min_size=1, max_size=12)
_rows = st.one_of(
    st.fixed_dictionaries({"input_ids": _good_ids}),
    st.fixed_dictionaries({"conversations": st.lists(_turn("from", "value"), max_size=6) | _junk}, optional={"id": _junk}),
    st.fixed_dictionaries({"messages": st.lists(_turn("role", "content"), max_size=6) | _junk}, optional={"meta": _junk}),
    st.fixed_dictionaries({"conversations": _alternating("from", "value", ("human", "gpt"))}),
    st.fixed_dictionaries({"messages": _alternating("role", "content", ("user", "assistant"))}),
    st.fixed_dictionaries({"conversations": _alternating("from", "value", ("human", "gpt"))}),
    st.fixed_dictionaries({"messages": _alternating("role", "content", ("user", "assistant"))}),
    st.fixed_dictionaries({"input_ids": _ids | _junk}, optional={"loss_mask": st.lists(st.integers(-1, 2), max_size=12) | _junk}),
    _junk,
)


@settings(max_examples=500, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=_rows,
    style=st.sampled_from(TEMPLATE_STYLES),
    max_length=st.sampled_from([1, 8, 64, 4096]),
    mask=st.sampled_from(["all", "last"]),
    truncation=st.sampled_from(["truncate", "reject"]),
)
def test_malformed_rows_only_raise_sample_error(
    toks: dict[str, Any], data: Any, style: str, max_length: int, mask: str, truncation: str
) -> None:
    r = SourceRow("fuzz:0", 0, data)
    try:
        parse_row(r)
    except SampleError as e:
        assert e.field and e.reason
    try:
        s = tokenize_sample(parse_row(r), toks[style], max_length=max_length, mask=mask, truncation=truncation)
    except SampleError as e:
        assert e.field and e.reason
        event(f"rejected: {e.field.split('[')[0]}")
    else:
        event("tokenized")
        assert s.sample_id == "fuzz:0"
        assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
        assert s.input_ids.shape == s.loss_mask.shape
        assert 1 <= s.num_tokens <= max_length
        assert s.loss_mask.any() and set(np.unique(s.loss_mask).tolist()) <= {0, 1}
        assert int(s.input_ids.min()) >= 0 and int(s.input_ids.max()) < len(toks[style])


@settings(max_examples=40, deadline=3000, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(_rows, max_size=8))
def test_fuzz_jsonl_through_the_stage(toks: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, rows: list[Any]) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "rows.jsonl"
    lines = []
    for data in rows:
        try:
            lines.append(json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError):  # bytes values are not JSON: use undecodable bytes instead
            lines.append(b"\xc3\x28 not utf-8")
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    got = list(iter_source(path))
    assert len(got) == len(rows)
    written = rejected = 0
    for r in got:
        try:
            tokenize_sample(parse_row(r), toks["chatml"], max_length=64)
            written += 1
        except SampleError as e:
            assert e.field and e.reason
            rejected += 1
    assert written + rejected == len(rows)

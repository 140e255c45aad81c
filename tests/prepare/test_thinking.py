"""Thinking modes in regenerate builds and per-sample tags (CPU, the tiny model).

The replies are written by a scripted generator (a transformers backend whose ``generate`` answers with a
fixed reasoning and reply, the reasoning only when the prompt's thinking switch is on), so that the masks
can be checked against known text; the prompts, the template's switch, the tokens, masks, states and tags
are the real build's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.cli import main
from hs_dataset.config import GenerationOptions, HiddenStatesConfig
from hs_dataset.integrity.quality import ProbeOptions
from hs_dataset.integrity.verify import verify_build
from hs_dataset.prepare.regenerate import Generation, Prompt, regenerate_conversations
from hs_dataset.prepare.thinking import end_marker, template_kwargs, thinking_key, tokenize_generated
from hs_dataset.prepare.tokenizer import load_tokenizer
from hs_dataset.records import Conversation, Message
from hs_dataset.write.driver import build
from hs_dataset.write.plan import plan_build
from tests.fixtures.builds import DEMO, LAYERS, load_built

REASONING, ANSWER = "I think hard about it.", "Answer: forty two."
QWEN_THINK = f"<think>\n{REASONING}\n</think>\n\n"

# A Qwen3-style chat template (the structure of Qwen3's: a <think> block on the turns after the last user
# query, the switch `enable_thinking`; false opens and closes an empty block in the generation prompt).
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'user' -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{%- set content = m.content -%}{%- set reasoning = m.reasoning_content or '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


def scripted_reply(prompt_text: str, style: str) -> str:
    """What the scripted target writes: reasoning then the answer when the prompt leaves thinking open."""
    closed = prompt_text.endswith("</think>\n\n") if style == "qwen" else prompt_text.endswith("<think></think>")
    if closed:
        return ANSWER
    return QWEN_THINK + ANSWER if style == "qwen" else REASONING + "</think>" + ANSWER


class ScriptedGenerator:
    def __init__(self, tokenizer, style: str) -> None:
        self.tokenizer, self.style, self.prompts = tokenizer, style, []

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p.ids, skip_special_tokens=False)
            self.prompts.append(text)
            out.append(Generation(self.tokenizer(scripted_reply(text, self.style), add_special_tokens=False)["input_ids"],
                                  True))
        return out


class ScriptedBackend(TransformersBackend):
    """The real capture backend; its replies scripted (:class:`ScriptedGenerator`)."""

    def generate(self, prompts: list[Prompt]) -> list[Generation]:
        return self.script.generate(prompts)


@pytest.fixture(scope="module")
def qwen_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with the Qwen3-style thinking template."""
    d = tmp_path_factory.mktemp("qwen3") / "model"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (d / extra).unlink(missing_ok=True)
    return d


def masked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


@pytest.mark.parametrize("train_thinking", [True, False])
def test_both_modes_in_one_build_with_their_masks_modes_and_tags(qwen_model, tmp_path, train_thinking):
    tok = load_tokenizer(qwen_model)
    assert thinking_key(tok, GenerationOptions()) == "enable_thinking"
    cfg = HiddenStatesConfig(model=str(qwen_model), layers=LAYERS, source=str(DEMO), max_length=256, part_size=4,
                             max_samples=12, mask="last", responses="regenerate", tags=True, tag_columns="id",
                             generation={"thinking": "both", "thinking_ratio": 0.5, "train_thinking": train_thinking,
                                         "max_new_tokens": 64},
                             backend_options={"device": "cpu", "batch_tokens": 2048})
    backend = ScriptedBackend(str(qwen_model), LAYERS, device="cpu", batch_tokens=2048)
    backend.script = ScriptedGenerator(tok, "qwen")
    try:
        s = build(cfg, tmp_path / "out", backend=backend, progress=False)
    finally:
        backend.close()
    assert s.counts.written == 12, s.counts
    ds = load_built(tmp_path / "out")  # plain load_dataset, the card's schema
    modes = ds["tag_mode"]
    assert set(modes) == {"on", "off"}
    assert len(ds.filter(lambda r: r["tag_mode"] == "on")) == modes.count("on")
    for row in ds:
        msgs = [Message(m["role"], m["content"]) for m in json.loads(row["messages"])]
        on = row["tag_mode"] == "on"
        kwargs = {"enable_thinking": on}
        prompt = tok.apply_chat_template([m.as_chat() for m in msgs[:-1]], tokenize=False, add_generation_prompt=True,
                                         **kwargs)
        reply = QWEN_THINK + ANSWER if on else ANSWER
        assert msgs[-1].content == reply
        # the text as generated: prompt (with the row's switch), the reply, the end-of-turn marker
        assert tok.decode(row["input_ids"], skip_special_tokens=False) == prompt + reply + "<|im_end|>\n"
        want = (reply if train_thinking or not on else "\n\n" + ANSWER) + "<|im_end|>\n"
        assert masked_text(tok, row["input_ids"], row["loss_mask"]) == want
        assert row["tag_source"] == "demo_conversations" and row["tag_row"] >= 0
        assert row["tag_turns"] == sum(m.role == "assistant" for m in msgs)
        assert row["tag_tokens"] == row["num_tokens"] == len(row["input_ids"])
        assert row["tag_id"] is not None and row["tag_id"].startswith("demo-")
        assert row["tag_language"] is None
    # verify --probe retokenizes each stored conversation in its row's mode and re-runs the reference backend
    report = verify_build(tmp_path / "out", probe=ProbeOptions(rows=4, device="cpu"))
    assert report.ok and report.probe is not None and report.probe.ok, report.message()


def test_kimi_switch_and_masks_over_several_turns(kimi):
    """Kimi-K2.5's spelling (`thinking`), mask=all: the history turns as the template renders them, the last one
    as generated, its thinking span in or out of the mask."""
    conv = Conversation("s:0", [Message("user", "Hi there"), Message("assistant", "old reply"),
                                Message("user", "And now?"), Message("assistant", "x")])
    for mode, thinking_on in (("on", True), ("off", False)):
        opts = GenerationOptions.from_config({"thinking": mode})
        assert thinking_key(kimi, opts) == "thinking"
        gen = ScriptedGenerator(kimi, "kimi")
        (out,) = regenerate_conversations([conv], kimi, gen, opts, 512)
        assert isinstance(out, Conversation)
        assert all(p.endswith("<think>" if thinking_on else "<think></think>") for p in gen.prompts)
        kwargs = template_kwargs(kimi, opts, mode)
        assert end_marker(kimi, kwargs) == "<|im_end|>"
        last = out.messages[-1].content
        assert last == (REASONING + "</think>" + ANSWER if thinking_on else ANSWER)
        for train in (True, False):
            s = tokenize_generated(out, kimi, kwargs, max_length=512, mask="all", train_thinking=train,
                                   thinking_on=thinking_on)
            first = out.messages[1].content
            want_last = (last if train or not thinking_on else ANSWER) + "<|im_end|>"
            # the first (history) turn as the template renders it after the prompt of its mode (thinking on: the
            # prompt opened <think>, the template closes the empty block)
            head = "</think>" if thinking_on else ""
            assert masked_text(kimi, s.input_ids, s.loss_mask) == head + first + "<|im_end|>" + want_last
            text = kimi.decode(s.input_ids.tolist(), skip_special_tokens=False)
            assert text.endswith(("<think>" if thinking_on else "<think></think>") + last + "<|im_end|>")


def test_tags_of_a_source_build_are_plain_filterable_columns(tiny_model, tmp_path, capsys):
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": f"Reply {i}."}],
             "language": ["en", "fr"][i % 2], "category": ["math", "code", "chat"][i % 3]} for i in range(9)]
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = HiddenStatesConfig(model=tiny_model, layers=LAYERS, source=str(src), max_length=64, part_size=4, tags=True,
                             tag_columns="category", backend_options={"device": "cpu", "batch_tokens": 2048})
    build(cfg, tmp_path / "out", progress=False)
    ds = load_built(tmp_path / "out")
    assert ds["tag_row"] == list(range(9)) and set(ds["tag_mode"]) == {"source"}
    assert ds["tag_language"] == [r["language"] for r in rows]
    assert ds["tag_category"] == [r["category"] for r in rows]
    assert ds["tag_turns"] == [1] * 9
    math_fr = ds.filter(lambda r: r["tag_category"] == "math" and r["tag_language"] == "fr")
    assert math_fr["tag_row"] == [3]
    # plan and inspect count rows by tag
    assert plan_build(cfg).tag_counts["tag_category"] == {"math": 3, "code": 3, "chat": 3}
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "rows by tag" in text
    assert any(line.split()[:4] == ["tag_language", "en", "5", "55.6%"] for line in text.splitlines()), text


def test_plan_counts_the_thinking_modes_a_regenerate_build_will_write(tiny_model):
    cfg = HiddenStatesConfig(model=tiny_model, layers=LAYERS, source=str(DEMO), max_length=256, max_samples=40,
                             responses="regenerate", generation={"thinking": "both", "thinking_ratio": 0.25})
    modes = plan_build(cfg).tag_counts["tag_mode"]
    assert set(modes) == {"on", "off"} and sum(modes.values()) == 40 and 4 <= modes["on"] <= 16


@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory) -> Path:
    from tests.gpu.models import make_kimi_k25

    return make_kimi_k25(tmp_path_factory.mktemp("kimi-k25") / "tiny-kimi-k25", hidden=64, vocab=2048)


def test_both_modes_in_one_build_on_the_tiny_kimi_template(kimi_model, tmp_path):
    """Kimi-K2.5's switch (`thinking`) in a real build, mask=all: every turn of every row, its mode recorded."""
    tok = load_tokenizer(kimi_model, trust_remote_code=True)
    cfg = HiddenStatesConfig(model=str(kimi_model), layers=(0, 1, 2), source=str(DEMO), max_length=512, part_size=4,
                             max_samples=10, responses="regenerate", trust_remote_code=True,
                             generation={"thinking": "both", "train_thinking": False, "max_new_tokens": 64},
                             backend_options={"device": "cpu", "batch_tokens": 4096})
    backend = ScriptedBackend(str(kimi_model), (0, 1, 2), device="cpu", batch_tokens=4096, trust_remote_code=True)
    backend.script = ScriptedGenerator(tok, "kimi")
    try:
        s = build(cfg, tmp_path / "out", backend=backend, progress=False)
    finally:
        backend.close()
    assert s.counts.written == 10, s.counts
    ds = load_built(tmp_path / "out")
    assert set(ds["tag_mode"]) == {"on", "off"}
    for row in ds:
        on = row["tag_mode"] == "on"
        msgs = json.loads(row["messages"])
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert replies[-1] == (REASONING + "</think>" + ANSWER if on else ANSWER)
        # history turns as the template renders them after the row's prompt; the last turn without its thinking
        want = "".join(("</think>" if on else "") + r + "<|im_end|>" for r in replies[:-1])
        want += ANSWER + "<|im_end|>"
        assert masked_text(tok, row["input_ids"], row["loss_mask"]) == want, row["id"]

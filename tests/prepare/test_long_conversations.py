"""Conversations of very many turns tokenize and mask in time linear in their length (issue 27, finding 5):
one row of 100k short turns and one of 50k turns of 1 KB, directly and through ``plan``, each in seconds,
with the tokens and mask that rendering every prefix of a short prefix of the conversation gives."""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hs_dataset.errors import SampleError
from hs_dataset.prepare.loss_mask import tokenize_conversation
from hs_dataset.prepare.tokenizer import load_tokenizer
from hs_dataset.records import Conversation, Message
from hs_dataset.write.plan import plan_build
from tests.fixtures.builds import config

LIMIT_S = 30  # generous: each takes a few seconds here; before, the 100k-turn row ran for more than 8 minutes
MAX_LENGTH = 2048


@contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    """Fail (rather than hang for minutes) when the block runs past ``seconds``; print its time."""

    def expired(_signum: int, _frame: Any) -> None:
        pytest.fail(f"{what} took more than {seconds} s")  # a BaseException: no `except Exception` swallows it

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    print(f"\n{what}: {time.perf_counter() - t0:.2f} s")


def turns(n: int, chars: int, seed: int) -> list[Message]:
    """``n`` alternating user/assistant turns of about ``chars`` characters of words each."""
    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "Paris", "naïve", "123", "ok", "yes", "no", "why", "日本"]

    def text() -> str:
        return " ".join(rng.choices(words, k=max(1, chars // 4)))[:chars].strip() or "x"

    return [Message("user" if k % 2 == 0 else "assistant", text()) for k in range(n)]


ROWS = {"100k short turns": (100_000, 3), "50k turns of 1 KB": (50_000, 1024)}


@pytest.fixture(scope="module")
def tok(tiny_model: str) -> Any:
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def rows() -> dict[str, list[Message]]:
    return {name: turns(n, chars, seed) for seed, (name, (n, chars)) in enumerate(ROWS.items())}


def by_every_prefix(tok: Any, messages: list[Message], max_length: int) -> tuple[list[int], list[int]]:
    """The definition (loss_mask's module docstring), computed directly on a conversation short enough
    to render every prefix: the first ``max_length`` tokens of the full rendering, and 1 for each that
    overlaps ``[len(render(messages[:i], add_generation_prompt=True)), len(render(messages[:i+1])))``
    of an assistant turn ``i``."""
    chat = [m.as_chat() for m in messages]
    full = tok.apply_chat_template(chat, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m.role == "assistant":
            a = tok.apply_chat_template(chat[:i], tokenize=False, add_generation_prompt=True)
            b = tok.apply_chat_template(chat[: i + 1], tokenize=False)
            assert full.startswith(a) and full.startswith(b)
            spans.append((len(a), len(b)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_length], enc["offset_mapping"][:max_length]
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]
    return ids, mask


def short_prefix(tok: Any, messages: list[Message], tokens: int) -> list[Message]:
    """The shortest prefix of ``messages`` (an even number of turns, doubling) rendering to ``tokens`` tokens or more."""
    k = 2
    while len(tok(tok.apply_chat_template([m.as_chat() for m in messages[:k]], tokenize=False),
                  add_special_tokens=False)["input_ids"]) < tokens:
        k *= 2
    assert k < len(messages)
    return messages[:k]


@pytest.mark.parametrize("name", list(ROWS))
def test_many_turns_tokenize_in_seconds_with_the_mask_of_every_prefix(tok: Any, rows: dict[str, list[Message]],
                                                                     name: str) -> None:
    messages = rows[name]
    with within(LIMIT_S, f"tokenize + mask one row of {name}"):
        s = tokenize_conversation(Conversation("long:0", messages), tok, max_length=MAX_LENGTH)
    assert s.truncated and s.num_tokens == MAX_LENGTH
    ids, mask = by_every_prefix(tok, short_prefix(tok, messages, MAX_LENGTH + 200), MAX_LENGTH)
    assert s.input_ids.tolist() == ids
    assert s.loss_mask.tolist() == mask
    assert 0 < sum(mask) < MAX_LENGTH


def test_mask_last_and_truncation_reject_are_linear_too(tok: Any, rows: dict[str, list[Message]]) -> None:
    """mask=last renders only the last turn (past the kept tokens here: rejected, as before); truncation=reject
    rejects an over-long row before rendering any turn."""
    conv = Conversation("long:0", rows["100k short turns"])
    with within(LIMIT_S, "mask=last on 100k short turns"), pytest.raises(SampleError) as ei:
        tokenize_conversation(conv, tok, max_length=MAX_LENGTH, mask="last")
    assert ei.value.field == "input_ids" and "leaves no assistant token" in ei.value.reason
    with within(LIMIT_S, "truncation=reject on 100k short turns"), pytest.raises(SampleError) as ei:
        tokenize_conversation(conv, tok, max_length=MAX_LENGTH, truncation="reject")
    assert ei.value.field == "input_ids"
    assert re.match(rf"sample has more than \d+ tokens, more than max_length={MAX_LENGTH} ", ei.value.reason), ei.value


def test_plan_reads_the_long_rows_in_seconds(tiny_model: str, tok: Any, rows: dict[str, list[Message]],
                                             tmp_path: Path) -> None:
    """``plan`` (the samples generator the build uses, from a JSONL file) counts the long rows as tokenized."""
    src = tmp_path / "long.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for messages in rows.values():
            f.write(json.dumps({"messages": [m.as_chat() for m in messages]}, ensure_ascii=False) + "\n")
    print(f"\nsource: {src.stat().st_size / 1e6:.0f} MB")
    with within(LIMIT_S, "plan of both rows"):
        plan = plan_build(config(tiny_model, source=str(src), max_length=MAX_LENGTH, max_samples=None))
    assert plan.rejects == []
    assert plan.lengths == [MAX_LENGTH, MAX_LENGTH] and plan.truncated == 2
    masks = [by_every_prefix(tok, short_prefix(tok, m, MAX_LENGTH + 200), MAX_LENGTH)[1] for m in rows.values()]
    assert plan.masked_tokens == sum(sum(m) for m in masks)


# A ChatML template that renders assistant turns from turn 20 on differently once later turns follow
# (as templates that drop earlier reasoning do): not prefix-stable from turn 21 on.
LATE_REWRITE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 >= 20 and not loop.last %}{{ m['content'][:1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_only_the_turns_within_the_kept_tokens_must_be_prefix_stable(tiny_model: str,
                                                                    rows: dict[str, list[Message]]) -> None:
    tok = load_tokenizer(tiny_model)
    tok.chat_template = LATE_REWRITE
    conv = Conversation("late:0", rows["50k turns of 1 KB"][:60])
    with pytest.raises(SampleError) as ei:  # every turn kept: turn 21 is masked, and not prefix-stable
        tokenize_conversation(conv, tok, max_length=100_000)
    assert ei.value.field == "chat_template" and "not prefix-stable at turn 21" in ei.value.reason
    # Cut to the first turns, the mask is the one of every prefix of those turns.
    s = tokenize_conversation(conv, tok, max_length=1536)
    ids, mask = by_every_prefix(tok, conv.messages[:8], 1536)
    assert s.input_ids.tolist() == ids and s.loss_mask.tolist() == mask and sum(mask) > 0

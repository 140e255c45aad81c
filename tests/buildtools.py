"""Helpers shared by the build, resume, fault and interop tests."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import datasets
import torch

from hs_dataset.dataset_builder import HiddenStatesConfig
from hs_dataset.reader import iter_torch

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "builder_scripts" / "data" / "demo_conversations.jsonl"
LAYERS = (0, 1, 2)


def config(model: str, **kw) -> HiddenStatesConfig:
    """A small build of the demo conversations (parts of 4 rows) on the tiny model, CPU."""
    base = dict(model=model, layers=LAYERS, source=str(DEMO), max_length=256, part_size=4, max_samples=24,
                backend_options={"device": "cpu", "batch_tokens": 2048})
    base.update(kw)
    return HiddenStatesConfig(**base)


def load_built(out: Path) -> datasets.Dataset:
    """``load_dataset(out)`` with a private cache: datasets keys its cache of a local folder by the
    folder's name and README metadata (features, row and byte counts), not by the shards' content,
    so two builds in folders of the same name and size would otherwise read each other's rows."""
    return datasets.load_dataset(str(out), split="train", cache_dir=tempfile.mkdtemp(prefix="hf-cache-", dir=out.parent))


def content_hash(out: Path) -> str:
    """sha256 over every row of every shard of a build, in order."""
    h = hashlib.sha256()
    for row in iter_torch(load_built(Path(out))):
        for k in sorted(row):
            v = row[k]
            h.update(k.encode())
            h.update(v.encode() if isinstance(v, str) else v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# Conversations for the Kimi-K2.5 tests: thinking (reasoning_content) in the last turn and in history,
# non-ASCII text (Han characters, accents, emoji: multi-byte tokens), and one image row (a reject).
THINKING_ROWS = [
    {"messages": [{"role": "user", "content": "What is 17 * 3?"},
                  {"role": "assistant", "content": "17 * 3 = 51.", "reasoning_content": "17 * 3 is 10 * 3 + 7 * 3 = 51."}]},
    {"messages": [{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "Name a prime number."},
                  {"role": "assistant", "content": "7 is prime.", "reasoning_content": "Small primes: 2, 3, 5, 7."},
                  {"role": "user", "content": "And an even one?"},
                  {"role": "assistant", "content": "2 is the only even prime.", "reasoning_content": "Even: only 2."}]},
    {"conversations": [{"from": "human", "value": "你好！用中文说一句话。"},
                       {"from": "gpt", "value": "你好，世界 🙂 — ça va?"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                  {"role": "assistant", "content": "A cat."}]},
    {"messages": [{"role": "user", "content": "Tell me about tea in two sentences."},
                  {"role": "assistant", "content": "Tea is brewed from the leaves of Camellia sinensis. 中国茶 is famous.",
                   "reasoning_content": "Keep it to two sentences; mention 中国."}]},
]
IMAGE_ROW = 3


def write_thinking_source(path: Path) -> Path:
    """:data:`THINKING_ROWS` as a JSONL file."""
    import json

    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in THINKING_ROWS), encoding="utf-8")
    return path

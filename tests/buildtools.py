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

"""Helpers shared by the interop tests (ours: test_interop.py; the peers' own code: test_interop_peers.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.reader import iter_torch, open_dataset
from hs_dataset.shard_writer import build
from tests.buildtools import DEMO

LAYERS = (0, 1, 2)  # three aux layers of the 4-layer tiny model (SpecForge needs exactly 3)
PRE_LAYERS = (0, 1, 3)  # two aux layers + layer 3 = L-1, the last layer before the final norm


def build_tiny(model: str, out: Path, layers: tuple[int, ...] = LAYERS, **kw) -> Path:
    """12 demo conversations on the tiny model (CPU, transformers backend)."""
    cfg = dict(model=model, layers=layers, source=str(DEMO), max_length=256, part_size=8, max_samples=12,
               backend_options={"device": "cpu", "batch_tokens": 4096})
    cfg.update(kw)
    build(HiddenStatesConfig(**cfg), out, progress=False)
    return out


def rows(d: Path) -> list[dict]:
    """Every row of a build, decoded to torch (cloned: safe to keep)."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in r.items()}
            for r in iter_torch(open_dataset(d))]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def assert_same_rows(a: list[dict], b: list[dict], *, ids: bool = True) -> None:
    """The same columns with bit-identical values (and the same ids unless ``ids=False``)."""
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert set(x) == set(y)
        if ids:
            assert x["id"] == y["id"]
        for k in x:
            if k != "id":
                assert x[k].dtype == y[k].dtype, k
                assert torch.equal(bits(x[k]), bits(y[k])), (x["id"], k)


def rms_norm_reference(x: torch.Tensor, model_dir: str) -> torch.Tensor:
    """The model's own final norm (HF transformers' module, loaded from the checkpoint) applied to ``x``."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        return m.model.norm(x)

"""A layer pilot: per-layer statistics of a build that captured many layers, to pick the aux layers of a drafter.

EAGLE-3 feeds the drafter a few aux layers (low, middle, high). Which ones move the accept length, and a
ranking on small pilot data predicts the large-data one, so: build a pilot with many layers
(``--set layers=0,4,8,...``), look at this view, pick a few candidate sets, train a small drafter on each
and compare (docs/choosing-data.md, "Picking aux layers").

Per captured layer, over the loss-masked positions of up to ``rows`` rows (spread over the build):

* ``norm``: the mean token norm (residual streams grow with depth);
* ``cos_final``: the mean cosine similarity of a token's state with its ``hidden_final`` (how close the layer
  already is to what the ``lm_head`` reads);
* ``cos_prev``: with the previous captured layer (near 1: the two say nearly the same; a set of aux layers
  gains little from both).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from hs_dataset.integrity.build_rows import build_meta, iter_batches
from hs_dataset.layout import FINAL_COLUMN, layer_of
from hs_dataset.read.decode import decode_state  # the read stage's own decoding (bf16 or fp8)

__all__ = ["LayerStats", "layer_pilot"]


@dataclass
class LayerStats:
    """One captured layer's statistics (module docstring)."""

    layer: int
    norm: float
    cos_final: float | None
    cos_prev: float | None


def _state(batch: Any, i: int, column: str) -> torch.Tensor:

    return decode_state(pa.Table.from_batches([batch.slice(i, 1)]), column).float()


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def layer_pilot(root: str | Path, *, rows: int = 32) -> list[LayerStats]:
    """The statistics of every captured layer of ``root``, in layer order, over up to ``rows`` rows.

    Raises:
        NotABuildError: ``root`` is not a finished build.
    """
    root = Path(root)
    meta = build_meta(root)
    total = int((meta.get("counts") or {}).get("rows_written") or (meta.get("counts") or {}).get("written", 0))
    picked = set(np.linspace(0, max(total - 1, 0), num=min(rows, total), dtype=int).tolist())
    sums: dict[int, list[float]] = {}
    for b in iter_batches(root, meta):
        layers = sorted((k, c) for c in b.batch.schema.names if (k := layer_of(c)) is not None)
        for i in range(b.batch.num_rows):
            if b.start + i not in picked:
                continue
            mask = torch.from_numpy(np.asarray(
                b.batch.column("loss_mask").slice(i, 1).flatten().to_numpy(zero_copy_only=False), dtype=bool))
            final = _state(b.batch, i, FINAL_COLUMN)[mask] if FINAL_COLUMN in b.batch.schema.names else None
            prev = None
            for k, c in layers:
                x = _state(b.batch, i, c)[mask]
                s = sums.setdefault(k, [0.0, 0.0, 0.0, 0.0])  # norm, cos_final, cos_prev, positions
                s[0] += float(x.norm(dim=-1).sum())
                s[1] += float(_cos(x, final).sum()) if final is not None else 0.0
                s[2] += float(_cos(x, prev).sum()) if prev is not None else 0.0
                s[3] += int(mask.sum())
                prev = x
    out, first = [], True
    has_final = meta.get("store_final", True) is not False
    for k in sorted(sums):
        norm, cf, cp, n = sums[k]
        n = max(n, 1)
        out.append(LayerStats(k, norm / n, cf / n if has_final else None, None if first else cp / n))
        first = False
    return out

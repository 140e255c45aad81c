"""What a finished build holds, in numbers and one figure (``hs-dataset inspect [--plot FILE.png]``).

* lengths (``num_tokens`` of every row, one small column) and loss-mask coverage (the masked tokens the
  build recorded in ``hs_dataset.json``'s ``statistics``; counted from the ``loss_mask`` column only for a
  build that recorded none);
* per state column (each captured layer and the final state): mean, std, absmax and non-finite values as the
  build recorded them over every value (over a sample of rows spread evenly over the build, for a build that
  recorded none), and the L2 norm of each token's state over that sample (the figure);
* rejects grouped by reason: :mod:`hs_dataset.write.rejects`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from hs_dataset.errors import ConfigError
from hs_dataset.integrity.verify import read_meta
from hs_dataset.read.decode import decode_row
from hs_dataset.read.open import open_dataset

__all__ = ["BuildStats", "StateStats", "build_stats", "plot_stats"]


@dataclass
class StateStats:
    """One state column over the sampled rows (statistics of the finite values)."""

    column: str
    mean: float
    std: float
    absmax: float
    nonfinite: int
    values: int
    token_norms: np.ndarray  # L2 norm of each sampled token's state (float32)


@dataclass
class BuildStats:
    """See the module docstring."""

    rows: int
    lengths: np.ndarray  # num_tokens of every row
    masked_tokens: int
    sampled_rows: list[int]
    states: list[StateStats] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def mask_coverage(self) -> float:
        return self.masked_tokens / self.tokens if self.tokens else 0.0


def _sample_rows(n: int, k: int) -> list[int]:
    """``k`` row indices spread evenly over ``n`` rows (all of them when ``k >= n``)."""
    if k >= n:
        return list(range(n))
    return sorted({int(round(i * (n - 1) / max(k - 1, 1))) for i in range(k)})


class _Running:
    """Mean, std, absmax and non-finite count of the finite values, and each token's L2 norm, added a row at a time."""

    def __init__(self) -> None:
        self.n = self.nonfinite = self.total = 0
        self.sum = self.sumsq = 0.0
        self.absmax = float("-inf")
        self.norms: list[np.ndarray] = []

    def add(self, t) -> None:

        x = t.float()
        finite = torch.isfinite(x)
        bad = int(x.numel() - int(finite.sum()))
        if bad:
            x = torch.where(finite, x, 0)
        self.nonfinite += bad
        self.total += x.numel()
        self.n += x.numel() - bad
        self.sum += float(x.sum(dtype=torch.float64))
        self.sumsq += float(x.square().sum(dtype=torch.float64))
        if x.numel():
            self.absmax = max(self.absmax, float(x.abs().max()))
        self.norms.append(x.norm(dim=1).numpy().astype(np.float32))

    def result(self, column: str) -> StateStats:
        mean = self.sum / self.n if self.n else float("nan")
        var = (self.sumsq - self.sum * mean) / (self.n - 1) if self.n > 1 else 0.0
        return StateStats(column, mean, float(np.sqrt(max(var, 0.0))), self.absmax if self.n else float("nan"),
                          self.nonfinite, self.total, np.concatenate(self.norms) if self.norms else np.zeros(0, np.float32))


def build_stats(out: str | Path, *, sample_rows: int = 32) -> BuildStats:
    """Statistics of the finished build in ``out`` (see the module docstring).

    Raises:
        NotABuildError, IntegrityError: as :func:`hs_dataset.read.open_dataset`.
    """

    ds = open_dataset(out)
    recorded = read_meta(Path(out)).get("statistics") or {}
    table: pa.Table = ds.data.table  # the memory-mapped shards; only the columns read are paged in
    lengths = np.asarray(table.column("num_tokens").to_numpy(), dtype=np.int64)
    if "masked_tokens" in recorded:
        masked = int(recorded["masked_tokens"])
    else:  # a build that recorded no statistics
        masked = sum(int(pc.sum(chunk.flatten()).as_py() or 0) for chunk in table.column("loss_mask").chunks)
    picked = _sample_rows(len(ds), sample_rows)
    arrow = ds.with_format("arrow")
    acc: dict[str, _Running] = {}  # running totals, one row's states at a time (Kimi rows are ~100 MB each)
    for i in picked:
        row_table: pa.Table = arrow[i]
        for col, t in decode_row(row_table, 0).items():
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                acc.setdefault(col, _Running()).add(t)
    stats = BuildStats(len(ds), lengths, masked, picked)
    columns = recorded.get("columns") or {}
    for col, r in acc.items():
        got, rec = r.result(col), columns.get(col)
        if rec:  # every value, as the build counted it: the sample gives only the token norms
            got = StateStats(col, float(rec["mean"]), float(rec["std"]), float(rec["absmax"]),
                             int(rec.get("nan", 0)) + int(rec.get("inf", 0)), int(rec.get("values", got.values)),
                             got.token_norms)
        stats.states.append(got)
    return stats


def plot_stats(stats: BuildStats, path: str | Path, title: str = "") -> Path:
    """Draw the per-state token-norm histograms and the length histogram into the PNG ``path``.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib  # optional: only inspect --plot draws
    except ImportError:

        raise ConfigError("drawing a plot needs matplotlib: pip install matplotlib") from None

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt  # optional: only inspect --plot draws

    panels = len(stats.states) + 1
    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    flat = list(axes.flat)
    ax = flat[0]
    ax.hist(stats.lengths, bins=min(40, max(len(stats.lengths), 1)), color="#4c72b0")
    ax.set_title(f"tokens per sample ({stats.rows} rows)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("samples")
    for ax, s in zip(flat[1:], stats.states):
        ax.hist(s.token_norms, bins=40, color="#dd8452")
        ax.set_title(f"{s.column}: token L2 norm")
        ax.set_xlabel(f"norm (absmax {s.absmax:.3g}, {s.nonfinite} non-finite)")
    for ax in flat[panels:]:
        ax.axis("off")
    if title:
        fig.suptitle(f"{title} (states: {len(stats.sampled_rows)} sampled rows)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png", dpi=90)
    plt.close(fig)
    return out

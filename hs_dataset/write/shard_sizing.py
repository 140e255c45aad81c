"""How to size a version's shards for training on many nodes, for ``hs-dataset plan`` and the card.

The rank-aware reader (:mod:`hs_dataset.read.ranked`) gives each rank a consecutive stretch of the epoch's
order, whose rows come from whole shards except where two ranks' stretches meet: such a shard is fetched
by both. With ``S`` shards of about equal size and ``W`` ranks, at most ``W - 1`` shards are cut, so an
epoch fetches at most ``1 + (W - 1) / S`` times the version over all nodes: ``S >= 20 (W - 1)`` keeps it
within 5% (``benchmarks/many_nodes.py`` measures it). Each rank holds the shard it reads and the next one
it fetches: a node's cache needs two of the largest shard per rank, and a shard of 64 MiB or more keeps
a fetch from being dominated by a request's latency.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["EXTRA_TARGET", "MIN_SHARD_BYTES", "WORLD_SIZES", "fetch_factor", "many_nodes_section", "shards_for",
           "sizing_rows"]

EXTRA_TARGET = 0.05  # bytes fetched per epoch over all nodes, beyond the version's size
MIN_SHARD_BYTES = 64 * 2**20  # below this, a fetch is mostly a request's latency
WORLD_SIZES = (8, 16, 64, 256)  # ranks: one 8-GPU node, two, eight, 32


def fetch_factor(shards: int, world_size: int) -> float:
    """The most bytes an epoch fetches over all nodes, as a multiple of the version (``shards`` of one size)."""
    return 1.0 + min(world_size - 1, shards) / max(shards, 1)


def shards_for(world_size: int, extra: float = EXTRA_TARGET) -> int:
    """The fewest shards for which ``world_size`` ranks fetch at most ``1 + extra`` times the version per epoch."""
    return max(1, math.ceil((world_size - 1) / extra))


def sizing_rows(total_bytes: int, shard_bytes: int, world_sizes: tuple[int, ...] = WORLD_SIZES,
                ranks_per_node: int = 8) -> list[tuple[str, str, str, str]]:
    """``(ranks, fetched per epoch, largest shard for <= 5%, cache per node)`` for each world size."""
    shards = max(1, math.ceil(total_bytes / max(shard_bytes, 1)))
    rows = []
    for w in world_sizes:
        fit = total_bytes // shards_for(w)
        rows.append((f"{w:,}", f"<= {fetch_factor(shards, w):.3f}x the version",
                     _size(fit) + (" (below 64 MiB: fetches pay latency)" if fit < MIN_SHARD_BYTES else ""),
                     _size(2 * min(w, ranks_per_node) * shard_bytes)))
    return rows


def many_nodes_section(metadata: dict[str, Any], repo_id: str | None, version: str) -> str:
    """The card's "Training on many nodes": what this version's shards cost at several world sizes, and how to read it."""
    shards = [s for s in metadata.get("shards") or [] if isinstance(s, dict)]
    if not shards:
        return "n/a: this build records no shards."
    total = sum(int(s.get("bytes") or 0) for s in shards)
    largest = max(int(s.get("bytes") or 0) for s in shards)
    lines = ["| ranks | fetched per epoch, all nodes | largest shard for <= 5% | cache per 8-rank node |",
             "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in sizing_rows(total, largest)]
    source = repo_id or "s3://bucket/prefix"
    return (f"{len(shards)} shards, the largest {_size(largest)}. `hs_dataset.read.ranked.open_ranked` gives each rank "
            "its share of one seeded order, fetching only the shards its ranks read (each checked against its hash) "
            "into a bounded cache; a shard cut between two ranks is fetched by both:\n\n" + "\n".join(lines) +
            f"\n\n```python\nfrom hs_dataset.read.ranked import open_ranked\n\nreader = open_ranked(\"{source}\", "
            f"revision=\"{version}\", cache_dir=\"/local/cache\",\n                     cache_bytes={2 * largest * 8}, "
            "batch_size=8, seed=0)  # rank and world size: torchrun's\n```")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"

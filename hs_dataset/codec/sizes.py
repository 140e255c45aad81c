"""Bytes per token of each way to store a build: what ``plan``, ``inspect`` and the card show.

For ``n_states`` states of width ``hidden`` (the captured layers and the final state), plus input_ids
(int32) and loss_mask (uint8): bf16 (``2 H`` per state), fp8 (``H + 4``: one byte per value and a float32
scale), and fp8 with the teacher's top-k in place of the final state (``k * 8 + 4`` bytes at each
loss-masked position: :mod:`hs_dataset.codec.teacher`). Lossless coding (``compression=zstd`` or Parquet
shards, :mod:`hs_dataset.codec.coding`) shrinks each by what the states' bytes compress to, which depends
on the model: only a build says (``hs_dataset.json``'s ``bytes``; on the stand-in's random-weight states
zstd gave 0.78 of bf16 and 0.83 of fp8).
"""

from __future__ import annotations

__all__ = ["ROW_BYTES_PER_TOKEN", "storage_options"]

ROW_BYTES_PER_TOKEN = 5  # input_ids (int32) + loss_mask (uint8), besides the states


def storage_options(n_states: int, hidden: int, *, masked_fraction: float, k: int = 64) -> list[tuple[str, float]]:
    """``[(option, bytes per token)]``: bf16, fp8, and fp8 + the teacher's top-``k`` without ``hidden_final``."""
    teacher = masked_fraction * (k * 8 + 4)
    return [("bfloat16", n_states * hidden * 2 + ROW_BYTES_PER_TOKEN),
            ("fp8_e4m3", n_states * (hidden + 4) + ROW_BYTES_PER_TOKEN),
            (f"fp8_e4m3 + teacher topk:{k}, store_final=false",
             (n_states - 1) * (hidden + 4) + teacher + ROW_BYTES_PER_TOKEN)]

"""The target's distribution at each row's loss-masked positions, summarised per row (``sample_stats.parquet``).

What a selection by the teacher needs: how sure the target is where the drafter is trained. At each masked
position ``t`` with probabilities ``p`` of the next token:

* ``entropy`` ``H_t = -sum p log p`` (nats), ``top1`` ``max p`` and the flatness ``1 - top1``.

Where they come from:

* ``hidden_final`` (and the model's output embedding, ``lm_head.weight``, or the tied input embedding):
  ``log_softmax(hidden_final @ W.T)`` in float32 over the full vocabulary: exact;
* the stored teacher (``teacher=topk:K``, when the build has no ``hidden_final`` or ``source="teacher"``):
  ``top1`` is exact (the first stored log-prob); the entropy is over the ``K`` stored probabilities with the
  rest of the mass as one outcome, a lower bound of the full one (equal when the top-K hold all the mass).

Per row, ``sample_stats.parquet`` holds ``row``, ``id``, ``stat_positions`` (masked positions), ``stat_entropy_mean``,
``stat_entropy_max``, ``stat_top1_mean`` and ``stat_flatness_mean`` (``1 - stat_top1_mean``), and the file's
metadata says where they came from. It is written by a build with ``sample_stats=true`` and by
``hs-dataset verify --stats`` (for versions built before, or without it); ``derive`` reads it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import xxhash
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from hs_dataset.atomic import fsync_dir
from hs_dataset.codec.fp8 import fp8_dequantize
from hs_dataset.integrity.build_rows import build_meta, iter_batches
from hs_dataset.errors import ConfigError, IntegrityError, MissingPathError
from hs_dataset.layout import FINAL_COLUMN, SAMPLE_STATS_FILE, TEACHER_LOGPROBS_COLUMN, scale_column

__all__ = ["STAT_COLUMNS", "StatsSource", "load_output_embedding", "position_stats", "read_sample_stats",
           "stats_source", "topk_stats", "write_sample_stats", "write_stats_table"]

StatsSource = Literal["hidden_final", "teacher"]
STAT_COLUMNS = ("stat_positions", "stat_entropy_mean", "stat_entropy_max", "stat_top1_mean", "stat_flatness_mean")
_CHUNK = 1024  # positions per matrix product: [1024, vocab] float32 logits


def load_output_embedding(model: str | Path) -> torch.Tensor:
    """The model's output embedding ``[vocab, H]`` as float32: ``*lm_head.weight`` from its safetensors files, or
    the input embedding (``*embed_tokens.weight``) of a model with tied embeddings.

    Raises:
        MissingPathError: no safetensors file, or neither tensor in them (name the model directory to use).
    """
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise MissingPathError(f"{model}: no *.safetensors weights; the statistics from hidden_final need the model's "
                               "lm_head (pass --model DIR)")
    found: dict[str, tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                for want in ("lm_head.weight", "embed_tokens.weight"):
                    if key.endswith(want) and want not in found:
                        found[want] = (f, key)
    for want in ("lm_head.weight", "embed_tokens.weight"):
        if want in found:
            f, key = found[want]
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor(key).float()
    raise MissingPathError(f"{model}: no lm_head.weight (nor tied embed_tokens.weight) in its safetensors files")


def position_stats(logprobs: torch.Tensor, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, top1)`` float32 ``[M]`` from log-probabilities ``[M, V]`` (``full``) or the top-K ``[M, K]``
    (sorted, highest first; the rest of the mass one more outcome)."""
    lp = logprobs.float()
    p = lp.exp()
    h = -(p * lp).sum(dim=1)
    if not full:
        rest = (1.0 - p.sum(dim=1)).clamp(min=0.0)
        h = h - torch.where(rest > 0, rest * torch.log(rest.clamp(min=1e-30)), torch.zeros_like(rest))
    top1 = lp.max(dim=1).values.exp() if full else p[:, 0]
    return h, top1


def final_stats(final: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, top1)`` of ``log_softmax(final @ weight.T)`` (float32) for the rows of ``final`` ``[M, H]``."""
    hs, tops = [], []
    for lo in range(0, final.shape[0], _CHUNK):
        lp = torch.log_softmax(final[lo:lo + _CHUNK].float() @ weight.T, dim=-1)
        h, t = position_stats(lp, True)
        hs.append(h)
        tops.append(t)
    if not hs:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(hs), torch.cat(tops)


def topk_stats(logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, top1)`` from a row's stored teacher log-probs ``[M, K]``."""
    return position_stats(logprobs, False)


def stats_source(meta: dict[str, Any], source: str | None = None) -> StatsSource:
    """Where a version's statistics come from: ``source`` when given, else ``hidden_final`` when stored, else
    the teacher.

    Raises:
        ConfigError: the version stores neither (or not the one asked for).
    """
    has_final = meta.get("store_final", True) is not False
    has_teacher = bool(meta.get("teacher"))
    pick = source or ("hidden_final" if has_final else "teacher")
    if (pick == "hidden_final" and not has_final) or (pick == "teacher" and not has_teacher) or \
            pick not in ("hidden_final", "teacher"):
        raise ConfigError(f"statistics from {pick!r}: this version stores "
                          f"{'hidden_final' if has_final else 'no hidden_final'} and "
                          f"{'a teacher' if has_teacher else 'no teacher'}; use hidden_final or teacher")
    return pick  # type: ignore[return-value]


def _row_values(batch: pa.RecordBatch, i: int, column: str) -> np.ndarray:
    """Row ``i`` of a list (``[n]``) or ``Array2D`` (``[n, w]``) column, as a numpy view of the stored values."""
    col = batch.column(column)
    if isinstance(col, pa.ExtensionArray):
        col = col.storage
    one = col.slice(i, 1)
    inner = one.flatten()
    if pa.types.is_list(inner.type):
        n, flat = len(inner), inner.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape(n, -1) if n else flat.reshape(0, 0)
    return inner.to_numpy(zero_copy_only=False)


def row_position_stats(batch: pa.RecordBatch, i: int, source: StatsSource,
                       weight: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(masked positions, entropy, top1)`` of row ``i`` (positions within the row, ascending)."""
    mask = _row_values(batch, i, "loss_mask").astype(bool)
    where = np.flatnonzero(mask)
    if source == "teacher":
        h, t = topk_stats(torch.from_numpy(np.ascontiguousarray(_row_values(batch, i, TEACHER_LOGPROBS_COLUMN))))
    else:
        bits = _row_values(batch, i, FINAL_COLUMN)[where]  # the masked positions only (a copy: writable)
        if bits.dtype != np.uint16:
            scale = torch.from_numpy(_row_values(batch, i, scale_column(FINAL_COLUMN))[where])
            final = fp8_dequantize(torch.from_numpy(bits), scale)
        else:
            final = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        assert weight is not None
        h, t = final_stats(final, weight)
    return where, h.numpy(), t.numpy()


def iter_position_stats(root: Path, meta: dict[str, Any], source: StatsSource,
                        weight: torch.Tensor | None) -> Iterator[tuple[int, str, np.ndarray, np.ndarray, np.ndarray]]:
    """``(row, id, masked positions, entropy, top1)`` for every row of a build, in row order."""
    for b in iter_batches(root, meta):
        ids = b.batch.column("id").to_pylist()
        for i in range(b.batch.num_rows):
            yield (b.start + i, ids[i], *row_position_stats(b.batch, i, source, weight))


def write_sample_stats(root: str | Path, *, source: str | None = None, model: str | None = None) -> Path:
    """Compute every row's statistics (module docstring) and write ``root/sample_stats.parquet``.

    Args:
        root: a finished build (or a downloaded version).
        source: ``hidden_final`` or ``teacher`` (default: ``hidden_final`` when stored).
        model: the model directory whose ``lm_head`` applies to ``hidden_final`` (default: the one recorded).

    Raises:
        ConfigError: the version stores neither source; MissingPathError: no weights for ``hidden_final``.
    """
    root = Path(root)
    meta = build_meta(root)
    src = stats_source(meta, source)
    weight = None
    if src == "hidden_final":
        weight = load_output_embedding(model or (meta.get("model") or {}).get("path") or meta["config"]["model"])
    cols: dict[str, list] = {"row": [], "id": [], **{c: [] for c in STAT_COLUMNS}}
    for row, rid, where, h, t in iter_position_stats(root, meta, src, weight):
        n = len(where)
        cols["row"].append(row)
        cols["id"].append(rid)
        cols["stat_positions"].append(n)
        cols["stat_entropy_mean"].append(float(h.mean()) if n else 0.0)
        cols["stat_entropy_max"].append(float(h.max()) if n else 0.0)
        cols["stat_top1_mean"].append(float(t.mean()) if n else 1.0)
        cols["stat_flatness_mean"].append(1.0 - cols["stat_top1_mean"][-1])
    types = {"row": pa.int64(), "id": pa.string(), "stat_positions": pa.int32()}
    return write_stats_table(root, pa.table({k: pa.array(v, types.get(k, pa.float64())) for k, v in cols.items()}),
                             src)


def write_stats_table(root: Path, table: pa.Table, source: str) -> Path:
    """``table`` (the columns of :func:`write_sample_stats`) as ``root/sample_stats.parquet``, atomically."""
    record = {"source": source, "rows": table.num_rows, "xxh3_128": _table_digest(table)}
    table = table.replace_schema_metadata({"hs_dataset": json.dumps(record)})
    path = root / SAMPLE_STATS_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # as atomic_write: readers see a whole file or none
    try:
        pq.write_table(table, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(root)
    return path


def read_sample_stats(root: str | Path, ids: list[str] | None = None) -> pa.Table:
    """``root``'s ``sample_stats.parquet``, its values checked against the digest written with them, and against
    the rows' ids when given.

    Raises:
        MissingPathError: there is none (``hs-dataset verify DIR --stats`` writes it).
        IntegrityError: its values differ from their recorded digest (damaged: write it again).
        ConfigError: it does not match the rows (a stale file: write it again).
    """
    path = Path(root) / SAMPLE_STATS_FILE
    if not path.is_file():
        raise MissingPathError(f"{path}: no per-sample statistics; run `hs-dataset verify {root} --stats` first")
    table = pq.read_table(str(path))
    recorded = json.loads((table.schema.metadata or {}).get(b"hs_dataset", b"{}")).get("xxh3_128")
    if recorded is not None and recorded != _table_digest(table):
        raise IntegrityError(f"{path}: its values differ from the digest recorded when it was written (damaged); "
                             f"run `hs-dataset verify {root} --stats` to write it again")
    if ids is not None and table.column("id").to_pylist() != ids:
        raise ConfigError(f"{path} does not match the rows of {root} (stale); run `hs-dataset verify {root} --stats`")
    return table


def _table_digest(table: pa.Table) -> str:
    """xxh3-128 of the statistics' values, column by column (a Parquet file has no checksum of its own)."""
    h = xxhash.xxh3_128()
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        h.update(name.encode("utf-8") + b"\0")
        if pa.types.is_string(col.type):
            h.update("\0".join(col.to_pylist()).encode("utf-8"))
        else:
            h.update(np.ascontiguousarray(col.to_numpy(zero_copy_only=False)).tobytes())
    return h.hexdigest()

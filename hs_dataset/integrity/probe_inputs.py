"""What the probe reads: which rows (seeded), their stored values from the shards holding them (a local
build, or only those shards of a published version), and each sample's tokens and loss mask as the
source gives them today."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hs_dataset.codec.rows import state_from_bits
from hs_dataset.config import GenerationOptions, HiddenStatesConfig, config_fields
from hs_dataset.errors import HsDatasetError, SampleError
from hs_dataset.integrity.scan import iter_shard_rows
from hs_dataset.layout import MESSAGES_COLUMN, SHARD_RE, scale_column, state_columns
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.loss_mask import tokenize_sample
from hs_dataset.prepare.sources import read_rows as read_source_rows
from hs_dataset.prepare.source_spec import resolve_source
from hs_dataset.prepare.thinking import tokenize_in_mode
from hs_dataset.records import Conversation, SourceRow, TokenizedSample

__all__ = ["Expected", "StoredRow", "expected_tokens", "pick_rows", "read_rows"]


def pick_rows(total: int, n: int, seed: int) -> list[int]:
    """``n`` distinct rows of ``total`` (all of them when ``n >= total``), drawn with ``seed``, ascending."""
    if n >= total:
        return list(range(total))
    return sorted(int(r) for r in np.random.default_rng(seed).choice(total, size=n, replace=False))


@dataclass
class StoredRow:
    """One probed row as stored: its place, tokens, mask and every state decoded to bf16 ``[T, H]``."""

    row: int
    shard: str
    part: int | None
    sample_id: str
    num_tokens: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    states: dict[str, torch.Tensor]
    messages: str | None = None


def _decode(row: dict[str, Any], column: str) -> torch.Tensor:
    bits = torch.from_numpy(np.array(row[column]))  # a copy: the shard's mapping may close
    if bits.dtype == torch.uint8:  # a row of inconsistent lengths is named, not decoded past its end
        bits = bits[:len(row.get(scale_column(column), ()))]
    return state_from_bits(bits, lambda: torch.from_numpy(np.array(row[scale_column(column)][:len(bits)],
                                                                   dtype=np.float32)), column=column)


def read_rows(meta: dict[str, Any], rows: list[int], shard_path: Callable[[dict[str, Any]], Path]) -> list[StoredRow]:
    """The stored ``rows`` (rows of the whole build, in ``shards`` order), reading only the shards that
    hold them (``shard_path(entry)`` gives a shard's local file, downloading it where needed)."""
    columns = list(meta.get("columns") or state_columns(meta["layers"]))  # store_final=false: no hidden_final
    out: list[StoredRow] = []
    first = 0
    wanted = sorted(rows)
    for s in meta["shards"]:
        n = int(s["rows"])
        local = {r - first: r for r in wanted if first <= r < first + n}
        if local:
            m = SHARD_RE.match(s["name"])
            for i, row in enumerate(iter_shard_rows(shard_path(s))):
                if i in local:
                    out.append(StoredRow(local[i], s["name"], int(m.group(1)) if m else None, row["id"],
                                         row["num_tokens"], np.array(row["input_ids"]), np.array(row["loss_mask"]),
                                         {c: _decode(row, c) for c in columns}, row.get(MESSAGES_COLUMN)))
        first += n
    return out


def probe_config(meta: dict[str, Any], model: str, source: str | None) -> HiddenStatesConfig:
    """The build's configuration (``hs_dataset.json``'s ``config``) with the model (and source) at hand."""
    known = {f.name for f in config_fields()}
    cfg = {k: v for k, v in (meta.get("config") or {}).items() if k in known}
    cfg.update(model=model, source=source or cfg.get("source") or "-")
    if cfg.get("tokenizer") and not Path(str(cfg["tokenizer"])).is_dir():
        cfg["tokenizer"] = None  # a tokenizer folder of another machine: the model directory's
    return HiddenStatesConfig(**cfg)


Expected = dict[str, "TokenizedSample | str"]  # sample id -> its tokens now, or why its source row gives none


def _tokens(parsed: Any, config: HiddenStatesConfig, tokenizer: Any, vocab_size: int) -> TokenizedSample | str:
    try:
        return tokenize_sample(parsed, tokenizer, max_length=config.max_length, mask=config.mask,
                               truncation=config.truncation, vocab_size=vocab_size)
    except SampleError as e:
        return f"{e.field}: {e.reason}"


def expected_tokens(config: HiddenStatesConfig, tokenizer: Any, vocab_size: int,
                    rows: list[StoredRow]) -> tuple[Expected | None, str]:
    """Each probed sample's tokens and loss mask as the build would make them now: from its source row
    (a regenerate build: from its stored ``messages``), reading the source once over the rows' range and
    tokenizing only theirs. -> ``({sample id: sample, or why none}, what was checked)``; None with the
    reason when the source cannot be read here."""
    found: Expected = {}
    if config.responses == "regenerate":
        gen = GenerationOptions.from_config(config.generation)
        for r in rows:
            try:
                conv = parse_row(SourceRow(r.sample_id, 0, {"messages": json.loads(r.messages or "[]")}))
            except (SampleError, ValueError) as e:
                found[r.sample_id] = f"its stored messages do not parse ({e})"
                continue
            if gen.thinking_set and isinstance(conv, Conversation):  # the last reply as generated, in the row's mode
                try:
                    found[r.sample_id] = tokenize_in_mode(conv, tokenizer, gen, max_length=config.max_length,
                                                          mask=config.mask, truncation=config.truncation,
                                                          vocab_size=vocab_size)
                except SampleError as e:
                    found[r.sample_id] = f"{e.field}: {e.reason}"
                continue
            found[r.sample_id] = _tokens(conv, config, tokenizer, vocab_size)
        return found, "tokens and loss mask retokenized from the stored messages"
    try:
        source = resolve_source(config.source)
        # each probed row's source rows, read in one pass with seeks
        ranges: list[tuple[int, int | None]] = sorted({_source_range(config, r) for r in rows})
        wanted = {r.sample_id for r in rows}
        for row in read_source_rows(source, ranges, sample_id=config.sample_id):
            if row.sample_id in wanted:  # only the probed rows are parsed and tokenized
                try:
                    parsed = parse_row(row)
                except SampleError as e:
                    found[row.sample_id] = f"{e.field}: {e.reason}"
                    continue
                found[row.sample_id] = _tokens(parsed, config, tokenizer, vocab_size)
    except (HsDatasetError, OSError) as e:
        return None, f"tokens and loss mask not checked: the source cannot be read here " \
                     f"({' '.join(str(e).split())[:160]}; pass --source PATH)"
    return found, f"tokens and loss mask retokenized from the source ({config.source})"


def _source_range(config: HiddenStatesConfig, row: StoredRow) -> tuple[int, int]:
    """The source rows holding ``row``: its own (ids ``<name>:<index>``) or its part's (content-hash ids)."""
    index = row.sample_id.rpartition(":")[2]
    if config.sample_id == "row" and index.isdigit():
        return int(index), int(index) + 1
    part = row.part or 0
    return part * config.part_size, (part + 1) * config.part_size

"""The final step of a build: the part records become ``rejects.jsonl``, ``hs_dataset.json`` and the card.

``hs_dataset.json`` is written last, so it exists only for a finished build; everything in it is
redacted (:mod:`hs_dataset.redact`). A build made by many workers is finalized the same
way by :mod:`hs_dataset.scale.merge`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import datasets
import torch

from hs_dataset._version import __version__
from hs_dataset.atomic import atomic_write
from hs_dataset.write.card import render_readme
from hs_dataset.write.resolve import ResolvedBuild
from hs_dataset.write.resume import part_record
from hs_dataset.capture.base import CaptureBackend
from hs_dataset.errors import EmptyBuildError
from hs_dataset.integrity.metadata import REJECTS_HASH_KEY, rejects_digest
from hs_dataset.redact import redact
from hs_dataset.codec.encode import stored_state_columns
from hs_dataset.integrity.stats import PartStatistics
from hs_dataset.integrity.summary import build_statistics
from hs_dataset.layout import DATA_DIR, DUPLICATE_STAGE, META_FILE, README_FILE, REJECTS_FILE
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.model_info import LAYER_CONVENTION
from hs_dataset.prepare.source_spec import Source
from hs_dataset.records import Counts

__all__ = ['FORMAT_VERSION', 'check_outputs', 'finalize', 'versions']


FORMAT_VERSION = 2  # 2: per-block hashes of every shard (integrity.checksums), checked by the readers


def versions(backend: CaptureBackend | None) -> dict[str, str]:
    """The package versions a build records (with the backend's own, when one ran)."""
    v = {"hs_dataset": __version__, "datasets": datasets.__version__, "torch": torch.__version__,
         "python": sys.version.split()[0]}
    if backend is not None:
        v.update(backend.versions())
    return v


def finalize(resolved: ResolvedBuild, out: Path, state: Path, parts: list[tuple[int, int, int]],
             backend: CaptureBackend | None, build_command: str | None) -> Counts:
    """Aggregate the records of ``parts`` into rejects.jsonl, hs_dataset.json and README.md.

    ``backend``: the backend that built parts in this run (its versions are recorded), or None.

    Raises:
        EmptyBuildError: no sample was written (the build is not marked finished).
    """
    config, info, layers = resolved.config, resolved.info, resolved.layers
    counts = Counts()
    rejects: list[dict] = []
    files: list[dict] = []
    record_versions: dict[str, str] = {}
    quality: list[dict | None] = []
    for i, _, _ in parts:
        r = json.loads(part_record(state, i).read_text(encoding="utf-8"))
        quality.append(r.get("quality"))
        counts.add(Counts(**r["counts"]))
        rejects.extend(r["rejects"])
        files.extend(r["files"])
        record_versions = r.get("backend_versions") or record_versions
    counts.check()
    check_outputs(out, files)
    rejects_text = "".join(json.dumps(r) + "\n" for r in rejects)
    atomic_write(out / REJECTS_FILE, rejects_text)
    if not counts.written:  # nothing to load: not marked finished (no hs_dataset.json)
        why = (f"all {counts.samples_in} samples were rejected ({out / REJECTS_FILE} says why)" if counts.samples_in
               else f"the source {config.source} has no rows (max_samples: {config.max_samples})")
        raise EmptyBuildError(f"{out}: no sample was written: {why}. Fix the source or the configuration")
    meta_path = out / META_FILE
    previous: dict[str, Any] = {}
    for p in (meta_path, state / META_FILE):
        if p.exists():
            try:
                previous = json.loads(p.read_text(encoding="utf-8"))
                break
            except ValueError:
                pass
    nbytes = sum(f["bytes"] for f in files)
    assert resolved.source is not None, "resolved with its source (resolve_build)"
    sample_ids = _sample_ids(config, resolved.source)
    statistics = _statistics(out, files, quality, config, info.hidden_size, counts)
    backend_versions = versions(backend) if backend is not None else \
        previous.get("backend", {}).get("versions") or {**versions(None), **record_versions}
    meta = {
        "format_version": FORMAT_VERSION,
        "model": info.to_dict(),
        "model_fingerprint": _fingerprint(state),  # hs_dataset.capture.fingerprint: what a resume or merge compares
        "layers": list(layers),
        "layer_convention": LAYER_CONVENTION,
        "columns": stored_state_columns(layers, config.store_final),
        "storage_dtype": config.storage_dtype,
        "stored_as": "uint16 bit patterns of bfloat16" if config.storage_dtype == "bfloat16"
        else "uint8 bit patterns of float8_e4m3fn + per-token float32 scale (amax/448) in <column>_scale",
        "decode": "hs_dataset.read.decode_row(ds.with_format('arrow')[i]) -> dict of torch tensors",
        "tokenizer": resolved.tokenizer_record,
        "max_length": config.max_length,
        # a sample is one row, or (long_rows) rows of at most row_tokens positions: token_start, sample_tokens
        "row_tokens": resolved.row_tokens,
        "long_rows": resolved.long_rows,
        # teacher="topk:K": teacher_ids/_logprobs/_lse at each row's loss-masked positions (hs_dataset.codec.teacher)
        "teacher": {"k": resolved.teacher_k, "positions": "loss-masked", "logprobs": "log_softmax(lm_head(final)), fp32",
                    "argmax": "teacher_ids[:, 0]"} if resolved.teacher_k else None,
        "store_final": config.store_final,
        "mask": config.mask,
        "truncation": config.truncation,
        "source": config.source,
        "sample_ids": sample_ids,
        "counts": dataclasses.asdict(counts),
        "bytes": nbytes,
        "files": len(files),
        "backend": {"name": config.backend,
                    "options": config.backend_options,
                    "versions": backend_versions},
        "build_command": build_command or previous.get("build_command"),
        "config": config.to_dict(),
        REJECTS_HASH_KEY: rejects_digest(rejects_text),
        "statistics": statistics,
        **({"probe": previous["probe"]} if previous.get("probe") and previous.get("shards") == files else {}),
        "shards": files,  # name, bytes, rows, xxh3_128, edges_xxh3_128 (hs_dataset.integrity.checksums)
    }
    meta, _ = redact(meta)  # credentials at any depth, URL user-info: '***' (hs_dataset.redact)
    text = json.dumps(meta, indent=1)
    atomic_write(state / META_FILE, text)
    atomic_write(out / README_FILE, render_readme(meta, str(out)))
    atomic_write(meta_path, text)  # last: hs_dataset.json exists only for a finished build
    return counts


def _statistics(out: Path, files: list[dict], quality: list[dict | None], config: HiddenStatesConfig, hidden: int,
                counts: Counts) -> dict[str, Any] | None:
    """The build's statistics from its parts' (None when a part was built by an hs_dataset without them)."""
    if not quality or any(q is None for q in quality):
        return None
    return build_statistics(out, files, [PartStatistics.from_dict(q) for q in quality if q is not None],
                            duplicates=config.duplicates, skipped=counts.rejects_by_stage.get(DUPLICATE_STAGE, 0),
                            hidden=hidden)


def _fingerprint(state: Path) -> dict[str, Any] | None:
    try:
        key = json.loads((state / "build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    probe = key.get("model_probe")
    return {"weights": key.get("model_weights"), "probe": probe.get("digest") if isinstance(probe, dict) else None}


def _sample_ids(config: HiddenStatesConfig, source: Source) -> str:
    """How the build's sample ids were made (recorded: a reader can tell where a row came from)."""
    if config.sample_id == "hash":
        return "the first 16 hex digits of the sha256 of each source row"
    why = " (the source's file name looks like it holds a credential, so it is not used)" if source.name_redacted else ""
    return f"{source.name}:<row index>{why}"


def check_outputs(out: Path, files: list[dict]) -> None:
    """``data/`` holds exactly the recorded shards with their recorded sizes (else: a bug)."""
    listed = {f["name"]: int(f["bytes"]) for f in files}
    present = {f.name: f.stat().st_size for f in (out / DATA_DIR).iterdir()}
    if listed != present:
        missing = sorted(set(listed) - set(present))
        extra = sorted(set(present) - set(listed))
        sized = sorted(k for k in set(listed) & set(present) if listed[k] != present[k])
        raise RuntimeError(f"{out / 'data'} does not match the part records (missing {missing}, unlisted {extra}, "
                           f"wrong size {sized}); this is a bug in hs_dataset: run the build again to repair it")

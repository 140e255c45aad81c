"""Everything a push uploads besides the shards must agree with ``hs_dataset.json``: the card's front
matter (what ``load_dataset`` reads: ``configs``, ``dataset_info`` with the features) and its quality
section (the statistics and the probe, :mod:`hs_dataset.write.card_quality`), ``rejects.jsonl``
(its lines and content hash), and ``hs_dataset.json`` itself (its columns, dtype and counts); and a
push uploads nothing else (:func:`stray_files`: a file the build did not write is named, not uploaded
unchecked).

A changed feature in the card (``uint16`` turned into ``int32``) makes ``load_dataset`` hand out numbers
that are not the stored bits; a changed ``rejects.jsonl`` misreports what was left out. Each is a
:class:`~hs_dataset.integrity.verify.Problem` of ``verify`` (and so of ``push``, which verifies first);
running the build command again rewrites them from the part records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash
import yaml

from hs_dataset.write.card import readme_header, split_readme
from hs_dataset.write.card_quality import QUALITY_HEADING, quality_section
from hs_dataset.write.output import OUT_FILES
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, REJECTS_FILE, STATE_DIR, STORAGE_DTYPES, state_columns
from hs_dataset.records import Counts

__all__ = ["HUB_ATTRIBUTES", "REJECTS_HASH_KEY", "UNPUBLISHED_DIRS", "check_metadata", "rejects_digest", "stray_files"]

REJECTS_HASH_KEY = "rejects_xxh3_128"  # in hs_dataset.json: rejects.jsonl's content hash
UNPUBLISHED_DIRS = (STATE_DIR, ".git", ".cache")  # top-level folders a push never uploads
HUB_ATTRIBUTES = ".gitattributes"  # the Hub's own, in every downloaded version; never uploaded


def stray_files(root: Path) -> list[str]:
    """The files under ``root`` that a push would upload and the build did not write: anything outside
    ``data/`` (whose listing ``verify`` checks against the shards) but the build's own files and the
    folders a push skips. Sorted, relative to ``root``."""
    out = []
    for p in sorted(root.iterdir()):
        if p.name in UNPUBLISHED_DIRS or p.name == DATA_DIR or (p.name in (*OUT_FILES, HUB_ATTRIBUTES) and p.is_file()):
            continue
        out += [q.relative_to(root).as_posix() for q in sorted(p.rglob("*")) if q.is_file()] if p.is_dir() else \
            [p.name]
    return out


def rejects_digest(text: str) -> str:
    """The xxh3-128 of ``rejects.jsonl``'s text, as recorded in ``hs_dataset.json``."""
    return xxhash.xxh3_128(text.encode("utf-8")).hexdigest()


def _front_matter(readme: str) -> dict[str, Any] | None:
    header, _ = split_readme(readme)
    if not header:
        return None
    try:
        parsed = yaml.safe_load(header.strip().strip("-"))
    except yaml.YAMLError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _accepted_forms(found: Any, want: Any, meta: dict[str, Any]) -> None:
    """Fold into ``want`` the forms of a right card that differ from what a build writes: a card written before the
    ``configs:`` entry carried the build's content id (hs_dataset.write.card.content_id) does not carry it, and
    ``datasets-cli test DIR --save_info`` rewrites ``dataset_info`` with the split's in-memory ``num_bytes`` and
    ``download_size`` (the shards' bytes: checked) / ``dataset_size`` (that ``num_bytes``: checked)."""
    try:
        if "description" not in found["configs"][0]:
            want["configs"][0].pop("description", None)
    except (TypeError, KeyError, IndexError):
        pass
    try:
        info, mine = found["dataset_info"], want["dataset_info"]
        split = info["splits"][0]
        if "download_size" in info and info["download_size"] == int(meta.get("bytes", -1)) \
                and info.get("dataset_size") == split["num_bytes"] and isinstance(split["num_bytes"], int):
            mine["splits"][0]["num_bytes"] = split["num_bytes"]
            mine["download_size"], mine["dataset_size"] = info["download_size"], info["dataset_size"]
    except (TypeError, KeyError, IndexError):
        pass


def _differences(found: Any, want: Any, where: str = "") -> list[str]:
    """Where two parsed YAML documents differ: ``dataset_info.features[3].dtype: 'int32' instead of 'uint16'``."""
    if isinstance(found, dict) and isinstance(want, dict):
        out = []
        for k in sorted(set(found) | set(want), key=str):
            out += _differences(found.get(k), want.get(k), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(found, list) and isinstance(want, list) and len(found) == len(want):
        return [d for i, (a, b) in enumerate(zip(found, want)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if found == want else [f"{where}: {found!r} instead of {want!r}"]


def _quality_problem(readme: str, meta: dict[str, Any]) -> str | None:
    """Why the card's quality section is not the one ``meta`` implies (its statistics and probe), or None."""
    if not meta.get("statistics") and not meta.get("probe"):
        return None
    if quality_section(meta) in split_readme(readme)[1]:
        return None
    if QUALITY_HEADING not in readme:
        return f"has no quality section ({QUALITY_HEADING}: the statistics and probe {META_FILE} records)"
    return f"its quality section differs from the statistics and probe {META_FILE} records"


def check_metadata(root: Path, meta: dict[str, Any]) -> list[tuple[str, str]]:
    """``(file, what is wrong)`` for each of the card, ``rejects.jsonl`` and ``hs_dataset.json`` that does not
    agree with ``hs_dataset.json``, and for each :func:`stray_files` (empty: they all do)."""
    problems: list[tuple[str, str]] = []
    layers = meta.get("layers")
    columns = state_columns(layers) if isinstance(layers, list) else None
    if columns is not None and meta.get("store_final") is False:  # a teacher build without hidden_final
        columns = columns[:-1]
    if columns is not None and meta.get("columns") not in (None, columns):
        problems.append((META_FILE, f"lists columns {meta.get('columns')} for layers {layers}"))
    if meta.get("storage_dtype", "bfloat16") not in STORAGE_DTYPES:
        problems.append((META_FILE, f"has storage_dtype {meta.get('storage_dtype')!r}"))
    counts = meta.get("counts") or {}
    readme = root / README_FILE
    if readme.is_file():
        found = _front_matter(readme.read_text(encoding="utf-8"))
        want = _front_matter(readme_header(meta, Counts.rows_of(counts), int(meta.get("bytes", 0)),
                                           (meta.get("config") or {}).get("file_format", "arrow")))
        _accepted_forms(found, want, meta)
        quality = _quality_problem(readme.read_text(encoding="utf-8"), meta)
        if quality:
            problems.append((README_FILE, quality))
        if found is None:
            problems.append((README_FILE, "has no YAML front matter (load_dataset reads configs: and dataset_info:)"))
        else:
            diff = _differences(found, want)
            if diff:
                shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
                problems.append((README_FILE, f"front matter differs from what {META_FILE} implies ({shown})"))
    rejects = root / REJECTS_FILE
    if REJECTS_HASH_KEY in meta or rejects.exists():
        text = rejects.read_text(encoding="utf-8") if rejects.is_file() else None
        lines = None if text is None else sum(1 for line in text.splitlines() if line.strip())
        if text is None:
            problems.append((REJECTS_FILE, "is missing"))
        elif "rejected" in counts and lines != int(counts["rejected"]):
            problems.append((REJECTS_FILE, f"holds {lines} rejects, {META_FILE} counts {counts['rejected']}"))
        elif REJECTS_HASH_KEY in meta and rejects_digest(text) != meta[REJECTS_HASH_KEY]:
            problems.append((REJECTS_FILE, f"its content hash differs from the recorded {REJECTS_HASH_KEY}"))
    problems += [(rel, f"is not a file of this build (a push would upload it unchecked): move it out of {root}")
                 for rel in stray_files(root)]
    return problems

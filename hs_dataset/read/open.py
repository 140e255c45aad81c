"""Opening a build for reading, checked first: a local build mapped in place, or a published version.

A local build directory is best opened with :func:`open_dataset`: it memory-maps the shards
where they are, whereas ``load_dataset(dir)`` first copies every shard into the ``datasets`` cache.
Both :func:`open_dataset` and :func:`load_verified` (a published version or a local build, map-style
or ``streaming=True``) refuse a build whose shards do not add up to what its ``hs_dataset.json``
records: a missing or extra shard, a shard of another size or other rows (:class:`IntegrityError`).
Plain ``load_dataset(..., streaming=True)`` cannot check that; ``hs-dataset verify`` checks the
content hashes too. Rows are decoded by :mod:`hs_dataset.read.decode` and iterated by
:mod:`hs_dataset.read.iterate`; batches are made by :mod:`hs_dataset.read.collate`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets

from hs_dataset.errors import IntegrityError
from hs_dataset.integrity.verify import (Problem, VerifyReport, check_listing, data_files, read_meta, recorded_shards,
                                         verify_repo)
from hs_dataset.layout import DATA_DIR

__all__ = ["load_verified", "open_dataset"]


def open_dataset(path: str | os.PathLike) -> datasets.Dataset:
    """A finished build directory (``OUT`` of ``hs-dataset build``) as a map-style ``datasets.Dataset``.

    Arrow shards are memory-mapped in place (``Dataset.from_file``): nothing is copied or converted,
    so opening a 1 TB dataset takes milliseconds and its pages are read on first access. Parquet
    shards have no zero-copy form and go through ``load_dataset`` (which converts them into the
    ``datasets`` cache).

    Args:
        path: the build directory.

    Raises:
        NotABuildError: ``path`` is not a finished build (no ``hs_dataset.json``).
        IntegrityError: a recorded shard is missing or of another size or row count, or ``data/``
            holds a file that is not recorded (run ``hs-dataset verify`` for the full check).
    """
    root = Path(path)
    meta, shards = _checked_listing(root)
    if not shards:
        raise IntegrityError(f"{root} records no shards (no data/train-*.arrow or data/train-*.parquet): rebuild it")
    if not shards[0]["name"].endswith(".arrow"):
        return datasets.load_dataset(str(root), split="train")
    parts = [datasets.Dataset.from_file(str(root / DATA_DIR / s["name"])) for s in shards]
    wrong = [Problem(f"{DATA_DIR}/{s['name']}", f"holds {len(d)} rows, {s['rows']} recorded")
             for s, d in zip(shards, parts) if len(d) != int(s["rows"])]
    if wrong:
        raise IntegrityError(f"{root}: {'; '.join(map(str, wrong))}. Run `hs-dataset verify {root}`", wrong)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _checked_listing(root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A local build's metadata and shards, once ``data/`` is checked to hold exactly them."""
    meta = read_meta(root)
    problems, rows = check_listing(meta, data_files(root), str(root))
    shards = recorded_shards(meta, str(root))
    VerifyReport(str(root), True, len(shards), rows, problems,
                 repair=f"Refusing to read it: run `hs-dataset verify {root}`, then the build again to repair it."
                 ).raise_if_bad()
    return meta, shards


def load_verified(path_or_repo: str | os.PathLike, *, revision: str | None = None, split: str = "train",
                  streaming: bool = False, token: str | None = None,
                  **kwargs: Any) -> datasets.Dataset | datasets.IterableDataset:
    """``load_dataset`` of a published version (or a local build), after checking that its shards are
    exactly the ones its ``hs_dataset.json`` records (names, sizes, rows add up): the check that
    ``streaming=True`` cannot make itself. A local build, map-style, is :func:`open_dataset`.

    Args:
        path_or_repo: a build directory, or a dataset repo id (``org/name``).
        revision: the version (tag) of a repo; the check and the load read the same commit.
        split, streaming, kwargs: passed to ``datasets.load_dataset``.
        token: for the Hub. The Hub is ``HF_ENDPOINT``'s (``datasets.load_dataset`` reads no other), so the
            check and the load reach the same one.

    Raises:
        IntegrityError: a shard is missing, extra or of another size (names them).
        NotABuildError: no ``hs_dataset.json``.
    """
    root = Path(path_or_repo)
    if root.is_dir():
        if not streaming:
            return open_dataset(root)
        _checked_listing(root)
        return datasets.load_dataset(str(root), split=split, streaming=True, **kwargs)
    report = verify_repo(str(path_or_repo), revision=revision, quick=True, token=token)
    report.raise_if_bad()
    return datasets.load_dataset(str(path_or_repo), revision=report.commit, split=split, streaming=streaming,
                                 token=token, **kwargs)

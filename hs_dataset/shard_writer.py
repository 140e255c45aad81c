"""The shard-writer stage: runs the builder part by part into a resumable, loadable directory
(the layout is in :mod:`hs_dataset.layout`, the resume state in :mod:`hs_dataset.resume`).

A *part* is a fixed range of ``part_size`` source rows. Each part is built by
``HiddenStatesBuilder.download_and_prepare`` into a staging folder; its finished shards are then
moved into ``data/`` and only after that is the part's record written (atomically): the record
is the commit point. A build killed at any moment (SIGKILL included) and run again with the
same command ends with the same rows as an uninterrupted build:

* each shard's size, rows and content hash are recorded with its part (:mod:`hs_dataset.checksums`)
  and, for the finished build, in ``hs_dataset.json`` (``shards``);
* on start it checks every part record: each listed shard must pass the quick check (size, first
  and last MiB, rows) and not be marked damaged by a full ``hs-dataset verify``, else the part is
  redone; files in ``data/`` that no valid record lists (a part killed between its moves and its
  record, a stray copy) are deleted; staging folders (with datasets' ``.incomplete`` dirs) and
  ``.tmp`` files of killed atomic writes are removed;
* credentials in the configuration and the build command are redacted in everything written
  (:mod:`hs_dataset.redact`);
* ``hs_dataset.json`` is written last by the final step, so it exists only for a finished build;
  a build that is about to change ``data/`` removes it (and README.md / rejects.jsonl) first, so
  a half-built directory is never mistaken for a finished one (``hs-dataset push`` refuses it);
* one build at a time per output directory (a lock in ``.hs_build/lock``, released by the kernel
  when the process dies);
* a full disk or an unwritable output raises :class:`OutputWriteError` naming the path and what to
  do; backend and source errors are raised as themselves (not wrapped by ``datasets``); in every
  case the unfinished part is discarded and a rerun resumes.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import glob
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from . import __version__
from .backends import LAYER_CONVENTION, CaptureBackend, check_layers, make_backend, read_model_info
from .card import render_readme
from .checksums import shard_entry
from .config import HiddenStatesConfig
from .dataset_builder import CaptureStream, HiddenStatesBuilder
from .errors import BuildInterrupted, BuildLockedError, ConfigMismatchError, EmptyBuildError, OutputWriteError
from .layout import DATA_DIR, META_FILE, README_FILE, REJECTS_FILE, STATE_DIR, shard_name, state_columns
from .progress import BuildProgress
from .records import Counts
from .redact import record_redacted, redact, redact_command
from .resume import (atomic_write, check_output, check_resume, check_shrink, fsync_dir, fsync_file, invalidate_finished,
                     lock_output, output_error, part_files, part_ranges, part_record, recover)
from .scaleout import ShardSpec, begin_shard, finish_shard
from .sources import rows_to_build, source_fingerprint

__all__ = ["BuildLockedError", "BuildSummary", "ConfigMismatchError", "OutputWriteError", "build"]

FORMAT_VERSION = 1


@dataclass
class BuildSummary:
    output_dir: str
    counts: Counts
    parts_built: int
    parts_skipped: int
    bytes_written: int
    seconds: float


def build(config: HiddenStatesConfig, output_dir: str | os.PathLike, *, backend: CaptureBackend | None = None,
          progress: bool = True, build_command: str | None = None, allow_shrink: bool = False,
          shard: ShardSpec | None = None) -> BuildSummary:
    """Build (or resume building) the dataset of ``config`` into ``output_dir``.

    ``allow_shrink``: a ``max_samples`` below the rows the directory holds deletes the rows beyond it
    (refused otherwise, with :class:`ConfigMismatchError`). With ``shard``, only that shard's parts, into
    a shard build that :mod:`hs_dataset.merge` joins with the others (use
    :func:`hs_dataset.scaleout.build_shard`).

    Raises :class:`ConfigMismatchError` (the directory holds another configuration's build, or more
    rows than ``max_samples``), :class:`EmptyBuildError` (every sample was rejected),
    :class:`BuildInterrupted` (Ctrl-C, a ``KeyboardInterrupt`` saying how many parts are done),
    :class:`BuildLockedError` (another build is writing it), :class:`OutputWriteError` (disk full,
    unwritable output), :class:`~hs_dataset.backends.BackendError` (the backend died or hangs;
    :class:`~hs_dataset.dataset_builder.NonFiniteError` for NaN/Inf with ``on_nonfinite="fail"``). After
    any of them, or a kill, running the same build again resumes it.
    """
    out = Path(output_dir)
    try:
        return _build(config, out, backend, progress, build_command, allow_shrink, shard)
    except OSError as e:
        err = output_error(e, out)
        if err is None or err is e:
            raise
        raise err from e


def _build(config: HiddenStatesConfig, out: Path, backend: CaptureBackend | None, progress: bool,
           build_command: str | None, allow_shrink: bool, shard: ShardSpec | None) -> BuildSummary:
    t0 = time.time()
    state = out / STATE_DIR
    check_output(out, config.source)  # an output that is not ours is refused before anything is touched
    (state / "parts").mkdir(parents=True, exist_ok=True)
    (out / DATA_DIR).mkdir(exist_ok=True)
    lock = lock_output(out, state)
    parts: list[tuple[int, int, int]] = []
    try:
        _, secrets = redact(config.to_dict())
        if build_command is not None:
            build_command, more = redact_command(build_command)
            secrets += more
        info = backend.info if backend is not None else read_model_info(config.model, config.model_revision)
        layers = check_layers(config.layers, info)
        key = dict(config.content_key(), source_fingerprint=source_fingerprint(config.source),
                   hidden_size=info.hidden_size, num_layers=info.num_layers)
        check_resume(state, key)
        record_redacted(state, secrets)  # salted digests only: push scans its uploads for them

        n = rows_to_build(config.source, config.max_samples)
        ext = config.file_format
        parts = part_ranges(n, config.part_size)
        check_shrink(out, state, n, allow_shrink)  # before recover, which would drop the rows beyond n
        if shard is not None:  # one worker's share of the parts (hs_dataset.scaleout)
            parts = begin_shard(state, shard, parts, n, config, info, layers, build_command)
        done = recover(out, state, parts)
        todo = [p for p in parts if p[0] not in done]
        bar = BuildProgress(sum(p[2] - p[1] for p in parts), sum(p[2] - p[1] for p in parts if p[0] in done), progress,
                            parts_total=len(parts), parts_done=len(done))
        own_backend = False
        built = 0
        datasets.disable_progress_bars()
        committer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hs_dataset-commit")
        committing: cf.Future | None = None
        stream: CaptureStream | None = None
        try:
            for i, start, stop in todo:
                if backend is None:
                    backend = make_backend(config.backend, config.model, layers, revision=config.model_revision,
                                           options=config.backend_options, trust_remote_code=config.trust_remote_code)
                    own_backend = True
                if stream is None and getattr(backend, "continuous", False):
                    # one capture over all remaining parts: the engine never drains at a part boundary
                    stream = CaptureStream(config, backend, [(s, e) for _, s, e in todo])
                if i == todo[0][0]:
                    invalidate_finished(out, state)  # data/ is about to change
                generated = _generate_part(config, out, state, i, start, stop, backend, bar, stream)
                if committing is not None:  # at most one part committing while the next one is captured
                    committing.result()
                    built += 1
                    bar.part_done()
                committing = committer.submit(_commit_part, out, state, generated, ext)
            if committing is not None:
                committing.result()
                built += 1
                bar.part_done()
                committing = None
        finally:
            if stream is not None:
                stream.close()
            committer.shutdown(wait=True)  # a part being committed finishes (or is discarded) before we return
            shutil.rmtree(state / "staging", ignore_errors=True)
            bar.close()
            if own_backend and backend is not None:
                backend.close()
        if shard is None:
            counts = _finalize(config, out, state, parts, info, layers, backend if built else None, build_command)
        else:
            counts = finish_shard(state, parts)  # hs_dataset.merge finalizes the merged build
        shutil.rmtree(state / "staging", ignore_errors=True)
        shutil.rmtree(state / "cache", ignore_errors=True)  # datasets' per-part lock files
        nbytes = sum(f.stat().st_size for f in (out / DATA_DIR).glob(f"*.{ext}"))
        return BuildSummary(str(out), counts, built, len(done), nbytes, time.time() - t0)
    except KeyboardInterrupt:  # after the committer finished: the parts recorded now are kept
        raise BuildInterrupted(sum(part_record(state, i).exists() for i, _, _ in parts), len(parts)) from None
    finally:
        os.close(lock)


def _generate(builder: HiddenStatesBuilder, staging: Path, config: HiddenStatesConfig) -> None:
    """``download_and_prepare`` into ``staging``; an error is raised as itself, not wrapped by datasets."""
    err: BaseException | None = None
    try:
        builder.download_and_prepare(str(staging), file_format=config.file_format,
                                     max_shard_size=config.max_shard_bytes,
                                     download_mode=datasets.DownloadMode.FORCE_REDOWNLOAD)
    except datasets.exceptions.DatasetGenerationError as e:
        if not isinstance(e.__cause__, Exception):
            raise
        err = e.__cause__  # e.g. BackendError, NonFiniteError, OSError(ENOSPC), a source error
    if err is not None:
        raise err


@dataclass
class _Generated:
    """A part whose shards are written and closed in its staging folder, not yet committed."""

    i: int
    start: int
    stop: int
    staging: Path
    counts: Counts
    rejects: list[dict]
    backend_versions: dict[str, str]


def _staging(state: Path, i: int) -> Path:
    return state / "staging" / f"part-{i:05d}"


def _clear_staging(state: Path, i: int) -> None:
    # datasets keeps a killed run's shards in '<staging>.incomplete' and reuses that folder
    for d in (state / "staging").glob(f"part-{i:05d}*"):
        shutil.rmtree(d, ignore_errors=True)


def _discard_part(out: Path, state: Path, i: int, ext: str) -> None:
    """Remove what an unrecorded part left: no shard of an unrecorded part stays visible."""
    if not part_record(state, i).exists():
        try:
            for f in part_files(out, i, ext):
                f.unlink()
        except OSError:
            pass  # the next build removes them
    _clear_staging(state, i)


def _generate_part(config: HiddenStatesConfig, out: Path, state: Path, i: int, start: int, stop: int,
                   backend: CaptureBackend, bar: BuildProgress, stream: CaptureStream | None) -> _Generated:
    """Capture and write part ``i`` into its staging folder (the main thread's work)."""
    staging = _staging(state, i)
    try:
        for f in part_files(out, i, config.file_format):  # whole shards of a part that was not recorded: redo it
            f.unlink()
        _clear_staging(state, i)
        staging.parent.mkdir(parents=True, exist_ok=True)
        builder = HiddenStatesBuilder(config=config, part=(start, stop), backend=backend, on_row=bar.row, stream=stream,
                                      cache_dir=str(state / "cache"))
        _generate(builder, staging, config)
        counts = builder.counts
        if counts.samples_in != stop - start:
            raise RuntimeError(f"part {i}: read {counts.samples_in} source rows, expected {stop - start}")
    except BaseException:
        _discard_part(out, state, i, config.file_format)
        raise
    return _Generated(i, start, stop, staging, counts, [r.to_dict() for r in builder.rejects], backend.versions())


def _commit_part(out: Path, state: Path, g: _Generated, ext: str) -> None:
    """fsync the part's shards, move them into data/, then write its record (the commit point).

    Runs on a committer thread while the next part is captured: the fsync (seconds per GB) then
    costs no capture time. Only a recorded part counts; a kill before the record redoes the part.
    """
    record_path = part_record(state, g.i)
    try:
        shards = sorted(glob.glob(str(g.staging / f"*-train*.{ext}")))
        files = []
        for k, src in enumerate(shards):  # size, rows and content hash, read back while in the page cache
            files.append(dict(shard_entry(src), name=shard_name(g.i, k, ext)))
            fsync_file(Path(src))  # on disk before the record can point at it
        if sum(f["rows"] for f in files) != g.counts.written:
            raise RuntimeError(f"part {g.i}: its shards hold {sum(f['rows'] for f in files)} rows, "
                               f"{g.counts.written} were written; this is a bug in hs_dataset")
        for src, f in zip(shards, files):
            os.replace(src, out / DATA_DIR / f["name"])
        fsync_dir(out / DATA_DIR)
        record = {"part": g.i, "start": g.start, "stop": g.stop, "files": files,
                  "counts": dataclasses.asdict(g.counts), "rejects": g.rejects, "backend_versions": g.backend_versions}
        atomic_write(record_path, json.dumps(record))  # the commit point of this part
    except BaseException:
        _discard_part(out, state, g.i, ext)
        raise
    _clear_staging(state, g.i)


def _versions(backend: CaptureBackend | None) -> dict[str, str]:
    import torch

    v = {"hs_dataset": __version__, "datasets": datasets.__version__, "torch": torch.__version__,
         "python": sys.version.split()[0]}
    if backend is not None:
        v.update(backend.versions())
    return v


def _finalize(config: HiddenStatesConfig, out: Path, state: Path, parts: list[tuple[int, int, int]], info,
              layers: tuple[int, ...], backend: CaptureBackend | None, build_command: str | None) -> Counts:
    """Aggregate part records into rejects.jsonl, hs_dataset.json and README.md."""
    from .tokenize_mask import tokenizer_record

    counts = Counts()
    rejects: list[dict] = []
    files: list[dict] = []
    record_versions: dict[str, str] = {}
    for i, _, _ in parts:
        r = json.loads(part_record(state, i).read_text(encoding="utf-8"))
        counts.add(Counts(**r["counts"]))
        rejects.extend(r["rejects"])
        files.extend(r["files"])
        record_versions = r.get("backend_versions") or record_versions
    counts.check()
    _check_outputs(out, files)
    atomic_write(out / REJECTS_FILE, "".join(json.dumps(r) + "\n" for r in rejects))
    if not counts.written:  # nothing to load: not marked finished (no hs_dataset.json)
        why = (f"all {counts.samples_in} samples were rejected ({out / REJECTS_FILE} says why)" if counts.samples_in
               else f"the source {config.source} has no rows (max_samples: {config.max_samples})")
        raise EmptyBuildError(f"{out}: no sample was written: {why}. Fix the source or the configuration")
    tok_path = config.tokenizer or config.model
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
    meta = {
        "format_version": FORMAT_VERSION,
        "model": info.to_dict(),
        "layers": list(layers),
        "layer_convention": LAYER_CONVENTION,
        "columns": state_columns(layers),
        "storage_dtype": config.storage_dtype,
        "stored_as": "uint16 bit patterns of bfloat16" if config.storage_dtype == "bfloat16"
        else "uint8 bit patterns of float8_e4m3fn + per-token float32 scale (amax/448) in <column>_scale",
        "decode": "hs_dataset.reader.decode_row(ds.with_format('arrow')[i]) -> dict of torch tensors",
        "tokenizer": tokenizer_record(tok_path, trust_remote_code=config.trust_remote_code),
        "max_length": config.max_length,
        "mask": config.mask,
        "truncation": config.truncation,
        "source": config.source,
        "counts": dataclasses.asdict(counts),
        "bytes": nbytes,
        "files": len(files),
        "backend": {"name": config.backend,
                    "options": config.backend_options,
                    "versions": _versions(backend) if backend is not None else
                    previous.get("backend", {}).get("versions") or {**_versions(None), **record_versions}},
        "build_command": build_command or previous.get("build_command"),
        "config": config.to_dict(),
        "shards": files,  # name, bytes, rows, xxh3_128, edges_xxh3_128 (hs_dataset.checksums)
    }
    meta, _ = redact(meta)  # credentials at any depth, URL user-info: '***' (hs_dataset.redact)
    text = json.dumps(meta, indent=1)
    atomic_write(state / META_FILE, text)
    atomic_write(out / README_FILE, render_readme(meta, str(out)))
    atomic_write(meta_path, text)  # last: hs_dataset.json exists only for a finished build
    return counts


def _check_outputs(out: Path, files: list[dict]) -> None:
    """``data/`` holds exactly the recorded shards with their recorded sizes (else: a bug)."""
    listed = {f["name"]: int(f["bytes"]) for f in files}
    present = {f.name: f.stat().st_size for f in (out / DATA_DIR).iterdir()}
    if listed != present:
        missing = sorted(set(listed) - set(present))
        extra = sorted(set(present) - set(listed))
        sized = sorted(k for k in set(listed) & set(present) if listed[k] != present[k])
        raise RuntimeError(f"{out / 'data'} does not match the part records (missing {missing}, unlisted {extra}, "
                           f"wrong size {sized}); this is a bug in hs_dataset: run the build again to repair it")

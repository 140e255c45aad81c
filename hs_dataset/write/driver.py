"""The build driver: :func:`build` runs the builder part by part into a resumable, loadable directory
(the layout is in :mod:`hs_dataset.layout`, one part's generate and commit in
:mod:`hs_dataset.write.parts`, the resume state in :mod:`hs_dataset.write.resume`, the final step
in :mod:`hs_dataset.write.finalize`).

A *part* is a fixed range of ``part_size`` source rows. Each part is built by
``HiddenStatesBuilder.download_and_prepare`` into a staging folder; its finished shards are then
moved into ``data/`` and only after that is the part's record written (atomically): the record
is the commit point. A build killed at any moment (SIGKILL included) and run again with the
same command ends with the same rows as an uninterrupted build:

* each shard's size, rows and content hash are recorded with its part (:mod:`hs_dataset.integrity.checksums`)
  and, for the finished build, in ``hs_dataset.json`` (``shards``);
* on start it checks every part record: each listed shard must pass the quick check (size, first
  and last MiB, rows) and not be marked damaged by a full ``hs-dataset verify``, else the part is
  redone; shards in ``data/`` that no valid record lists are deleted when a record or a move note of
  the build names them (a part killed between its moves and its record), refused otherwise (a copy put
  there by hand: :func:`hs_dataset.write.resume.recover`); staging folders (with datasets' ``.incomplete`` dirs) and
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
import logging
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import datasets

from hs_dataset.write.capture_stream import CaptureStream
from hs_dataset.write.finalize import finalize
from hs_dataset.write.output import check_output, lock_output, output_error
from hs_dataset.write.native_files import abandon
from hs_dataset.write.parts import commit_part, generate_part
from hs_dataset.write.progress import BuildProgress
from hs_dataset.write.resolve import resolve_build, start_tokenize_workers
from hs_dataset.write.resume import (check_resume, check_shrink, full_check, invalidate_finished, part_ranges, part_record,
                                     recover)
from hs_dataset.write.shares import WorkerShare, begin_share, finish_share
from hs_dataset.write.sink import RowSink
from hs_dataset.capture.backends import make_backend
from hs_dataset.capture.base import CaptureBackend
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import BuildInterrupted
from hs_dataset.interrupts import check_interrupt, interrupts_deferred
from hs_dataset.integrity.damage import mark_damaged
from hs_dataset.redact import record_redacted, redact, redact_command
from hs_dataset.layout import DATA_DIR, STATE_DIR
from hs_dataset.model_info import read_model_info
from hs_dataset.prepare.source_spec import resolve_source
from hs_dataset.records import Counts

__all__ = ["BuildSummary", "build"]

logger = logging.getLogger(__name__)

# Parts committed at once while the next one is generated: one file is written slower than Kimi-width capture
# produces states, several side by side are not (benchmarks/file_writes.py), so a part's writes overlap the next
# ones'. What is queued stays bounded by native_files.QUEUE_BYTES.
COMMITS_IN_FLIGHT = 3
# Python's GIL switch interval while a build runs (5 ms by default): the statistics threads release the GIL in each
# torch call, and taking it back waits up to another thread's interval (benchmarks/stats_overhead.py --threads).
SWITCH_INTERVAL_S = 0.0005


@dataclass
class BuildSummary:
    """What one run of :func:`build` did.

    Attributes:
        output_dir: the build directory.
        counts: the whole build's samples in, written, rejected, tokens.
        parts_built: parts built by this run; parts_skipped: parts found done.
        bytes_written: the shards' bytes. seconds: this run's time.
    """

    output_dir: str
    counts: Counts
    parts_built: int
    parts_skipped: int
    bytes_written: int
    seconds: float


def build(config: HiddenStatesConfig, output_dir: str | os.PathLike, *, backend: CaptureBackend | None = None,
          progress: bool = True, build_command: str | None = None, allow_shrink: bool = False,
          share: WorkerShare | None = None, sink: RowSink | None = None) -> BuildSummary:
    """Build (or resume building) the dataset of ``config`` into ``output_dir``.

    Args:
        config: what to build.
        output_dir: a new or empty directory, or a build of this configuration (it resumes).
        backend: a started capture backend to use (not closed); default: one is started and closed.
        progress: show progress (a bar on a terminal, a line per part in a log).
        build_command: the command line, recorded (redacted) in ``hs_dataset.json`` and the card.
        allow_shrink: a ``max_samples`` below the rows the directory holds deletes the rows beyond it
            (refused otherwise).
        share: only this worker's share of the parts, into a share build that
            :func:`hs_dataset.scale.merge.merge_shares` joins with the others (use
            :func:`hs_dataset.scale.worker.build_share`).
        sink: gets every row as it is generated and each part's commit (:mod:`hs_dataset.write.sink`), e.g.
            a :class:`hs_dataset.stream.StreamPublisher` that trainers read while the build runs.

    Raises:
        ForeignFilesError: the output holds files hs_dataset did not write (nothing is touched).
        ConfigMismatchError: the directory holds another configuration's build, or more rows than
            ``max_samples``.
        EmptyBuildError: every sample was rejected.
        BuildInterrupted: Ctrl-C (a ``KeyboardInterrupt`` saying how many parts are done).
        BuildLockedError: another build is writing it.
        OutputWriteError: disk full, unwritable output.
        BackendError: the backend died or hangs (:class:`~hs_dataset.errors.NonFiniteError` for NaN/Inf
            with ``on_nonfinite="fail"``).

    After any of them, or a kill, running the same build again resumes it.
    """
    out = Path(output_dir)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, SWITCH_INTERVAL_S))
    try:
        return _build(config, out, backend, progress, build_command, allow_shrink, share, sink)
    except OSError as e:
        err = output_error(e, out)
        if err is None or err is e:
            raise
        raise err from e
    finally:
        sys.setswitchinterval(switch)


def _build(config: HiddenStatesConfig, out: Path, backend: CaptureBackend | None, progress: bool,
           build_command: str | None, allow_shrink: bool, share: WorkerShare | None,
           sink: RowSink | None) -> BuildSummary:
    t0 = time.time()
    state = out / STATE_DIR
    source = resolve_source(config.source)  # the source string parsed once: kind, name, path (rows: on first use)
    check_output(out, source.local)  # an output that is not ours is refused before anything is touched
    (state / "parts").mkdir(parents=True, exist_ok=True)
    (out / DATA_DIR).mkdir(exist_ok=True)
    lock = lock_output(out, state)
    parts: list[tuple[int, int, int]] = []
    finished = False
    try:
        _, secrets = redact(config.to_dict())
        if build_command is not None:
            build_command, more = redact_command(build_command)
            secrets += more
        info = backend.info if backend is not None else read_model_info(config.model, config.model_revision)
        key = dict(config.content_key(), source_fingerprint=source.fingerprint, hidden_size=info.hidden_size,
                   num_layers=info.num_layers)
        check_resume(state, redact(key)[0])  # local records hold no credential either; before state/ is written
        resolved = resolve_build(config, info=info, source=source, state=state)  # the duplicates skipped: kept in state/
        layers = resolved.layers
        if source.name_redacted:
            logger.warning("hs_dataset: the source's name looks like it holds a credential: its sample ids use %s "
                           "instead (hs_dataset.json says so)", source.name)
        record_redacted(state, secrets)  # salted digests only: push scans its uploads for them

        n = source.rows_to_build(config.max_samples)
        ext = config.file_format
        parts = part_ranges(n, config.part_size)
        check_shrink(out, state, n, allow_shrink)  # before recover, which would drop the rows beyond n
        if share is not None:  # one worker's share of the parts (hs_dataset.scale)
            parts = begin_share(state, share, parts, n, config, info, layers, build_command)
        done = recover(out, state, parts)
        if done and len(done) == len(parts):  # nothing left to build: trust no part unhashed before saying done
            damaged = full_check(out, state, parts)
            if damaged:
                mark_damaged(out, damaged)
                done = recover(out, state, parts)
        todo = [p for p in parts if p[0] not in done]
        if sink is not None:
            sink.start(out, parts, done)
        bar = BuildProgress(sum(p[2] - p[1] for p in parts), sum(p[2] - p[1] for p in parts if p[0] in done), progress,
                            parts_total=len(parts), parts_done=len(done))
        own_backend = False
        built = 0
        datasets.disable_progress_bars()
        committer = cf.ThreadPoolExecutor(max_workers=COMMITS_IN_FLIGHT, thread_name_prefix="hs_dataset-commit")
        committing: deque[tuple[int, cf.Future]] = deque()  # parts committing, oldest first
        stream: CaptureStream | None = None
        workers = start_tokenize_workers(resolved, sum(stop - start for _, start, stop in todo)) if todo else None

        def committed(wait: bool) -> None:  # the oldest commits (all that are done, or one); in part order
            nonlocal built
            while committing and (wait or committing[0][1].done()):
                i, future = committing.popleft()
                future.result()
                built += 1
                bar.part_done()
                if sink is not None:
                    sink.committed(i)
                wait = False

        try:
            for i, start, stop in todo:
                if backend is None:
                    backend = make_backend(config.backend, info, layers, options=config.backend_options,
                                           trust_remote_code=config.trust_remote_code)
                    own_backend = True
                if stream is None and getattr(backend, "continuous", False):
                    # one capture over all remaining parts: the engine never drains at a part boundary
                    stream = CaptureStream(resolved, backend, [(s, e) for _, s, e in todo], workers=workers)
                if i == todo[0][0]:
                    invalidate_finished(out, state)  # data/ is about to change
                with interrupts_deferred():  # a signal inside native code is acted on at the next row, never lost
                    generated = generate_part(resolved, out, state, i, start, stop, backend, bar, stream, workers,
                                              sink)
                check_interrupt()  # one noted after the part's last row (outside the block a signal raises at once)
                if sink is not None:
                    sink.generated(i, generated.counts.rows_written)
                committed(wait=len(committing) >= COMMITS_IN_FLIGHT)
                committing.append((i, committer.submit(commit_part, out, state, generated, ext)))
                committed(wait=False)
            while committing:
                committed(wait=True)
        finally:
            if stream is not None:
                stream.close()
            if workers is not None:
                workers.close()
            committer.shutdown(wait=True)  # the parts being committed finish (or are discarded) before we return
            abandon(state / "staging")  # a part generated but not committed (the commit before it failed)
            shutil.rmtree(state / "staging", ignore_errors=True)
            bar.close()
            if own_backend and backend is not None:
                backend.close()
        if share is None:
            counts = finalize(resolved, out, state, parts, backend if built else None, build_command)
        else:
            counts = finish_share(state, parts)  # hs_dataset.scale.merge finalizes the merged build
        finished = True
        shutil.rmtree(state / "staging", ignore_errors=True)
        shutil.rmtree(state / "cache", ignore_errors=True)  # datasets' per-part lock files
        nbytes = sum(f.stat().st_size for f in (out / DATA_DIR).glob(f"*.{ext}"))
        return BuildSummary(str(out), counts, built, len(done), nbytes, time.time() - t0)
    except KeyboardInterrupt:  # after the committer finished: the parts recorded now are kept
        raise BuildInterrupted(sum(part_record(state, i).exists() for i, _, _ in parts), len(parts)) from None
    finally:
        if sink is not None:
            sink.end(finished)
        os.close(lock)


"""One part of a build: generated into its staging folder, then committed into ``data/``.

:func:`generate_part` writes the builder's rows of the part into shards in
``.hs_build/staging/part-PPPPP`` (the main thread's work); :func:`commit_part` fsyncs its shards,
moves them into ``data/`` and then writes the part's record, the commit point (on a committer
thread, while the next parts are captured). A part that fails or is killed before its record leaves
no shard visible.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from datasets.arrow_writer import ArrowWriter

from hs_dataset.atomic import atomic_write, fsync_dir, fsync_file, tmp_path
from hs_dataset.write.builder import HiddenStatesBuilder
from hs_dataset.write.drop_rows import drop_rows, recount
from hs_dataset.write.native_files import BackgroundFile, CodedShard, Written, abandon, code_file, drain, written
from hs_dataset.write.capture_stream import CaptureStream
from hs_dataset.write.progress import BuildProgress
from hs_dataset.write.resolve import ResolvedBuild
from hs_dataset.write.resume import note_moving, part_files, part_record
from hs_dataset.processes import check_interrupt
from hs_dataset.write.sink import RowSink
from hs_dataset.capture.base import CaptureBackend
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.codec.coding import CODED_SHARD_BYTES
from hs_dataset.integrity.checksums import shard_entry
from hs_dataset.layout import DATA_DIR, shard_name
from hs_dataset.prepare.workers import TokenizeWorkers
from hs_dataset.records import Counts

__all__ = ['GeneratedPart', 'commit_part', 'generate_part']

SHARD_PREFIX = "train-"  # a part's staging shards: train-00000.arrow, train-00001.arrow, ...


def _coding(config: HiddenStatesConfig) -> str | None:
    """How a build's Arrow shards are coded (hs_dataset.codec.coding): "parquet", "zstd", or None (as written)."""
    return "parquet" if config.file_format == "parquet" else None if config.compression == "none" else config.compression


def _write_shards(builder: HiddenStatesBuilder, staging: Path, start: int, stop: int, config: HiddenStatesConfig) -> None:
    """The builder's rows of ``[start, stop)`` into Arrow shards in ``staging``, as ``datasets``' own shard loop
    (``ArrowBasedBuilder._prepare_split_single``) writes them, each shard through a
    :class:`~hs_dataset.write.native_files.BackgroundFile`: written by a thread of its own while the next rows are
    captured, and coded by it once written in a coded build. Always Arrow first (zero-copy from the ring); a part
    without rows has no shard."""
    coding = _coding(config)
    max_bytes = min(config.max_shard_bytes, CODED_SHARD_BYTES) if coding else config.max_shard_bytes
    writer: ArrowWriter | None = None
    k = -1
    tables = builder._generate_tables(start, stop)
    try:
        for _, table in tables:
            if writer is None or writer._num_bytes > max_bytes:
                if writer is not None:
                    writer.finalize()  # and closes its file: its thread writes what is queued
                k += 1
                stream = BackgroundFile(str(staging / f"{SHARD_PREFIX}{k:05d}.arrow"), coding, builder.state_columns)
                writer = ArrowWriter(features=builder.info.features, stream=stream,
                                     writer_batch_size=builder._writer_batch_size)
            if len(table) == 1:  # a row: batched by the writer (writer_batch_size), as datasets does
                writer.write_row(table)
            else:
                writer.write_table(table)
            del table  # a row's states may be ring memory, reused once nothing holds it
    except BaseException:
        tables.close()  # the capture ends now (its statistics threads too), not when the generator is collected
        if writer is not None:
            writer.stream.close()  # what it has queued is dropped with the part (_discard_part)
        raise
    if writer is not None:
        writer.finalize()


@dataclass
class GeneratedPart:
    """A part whose shards are written and closed in its staging folder, not yet committed."""

    i: int
    start: int
    stop: int
    staging: Path
    counts: Counts
    rejects: list[dict]
    backend_versions: dict[str, str]
    dropped: tuple[str, ...] = ()  # samples whose rows must leave the shards before the commit
    state_columns: tuple[str, ...] = ()  # the hidden-state columns (coded with byte planes in parquet builds)
    quality: dict | None = None  # the rows' statistics (hs_dataset.integrity.stats.PartStatistics)
    coding: str | None = None  # how its shards are coded ("zstd", "parquet": by their writers, as they are written)


def _staging(state: Path, i: int) -> Path:
    return state / "staging" / f"part-{i:05d}"


def _clear_staging(state: Path, i: int) -> None:
    for d in (state / "staging").glob(f"part-{i:05d}*"):  # also a '.incomplete' folder of an older version's run
        shutil.rmtree(d, ignore_errors=True)


def _discard_part(out: Path, state: Path, i: int, ext: str) -> None:
    """Remove what an unrecorded part left: no shard of an unrecorded part stays visible."""
    abandon(_staging(state, i))  # what its shards still had queued is not written
    if not part_record(state, i).exists():
        try:
            for f in part_files(out, i, ext):
                f.unlink()
        except OSError:
            pass  # the next build removes them
    _clear_staging(state, i)


def generate_part(resolved: ResolvedBuild, out: Path, state: Path, i: int, start: int, stop: int,
                  backend: CaptureBackend, bar: BuildProgress, stream: CaptureStream | None,
                  workers: TokenizeWorkers | None = None, sink: RowSink | None = None) -> GeneratedPart:
    """Capture and write part ``i`` (source rows ``[start, stop)``) into its staging folder (the main thread's
    work; ``workers``: the build's tokenize workers, when ``stream`` does not serve the part; ``sink`` gets each
    row as it is written: :mod:`hs_dataset.write.sink`)."""
    config = resolved.config
    staging = _staging(state, i)
    try:
        for f in part_files(out, i, config.file_format):  # whole shards of a part that was not recorded: redo it
            f.unlink()
        _clear_staging(state, i)
        staging.parent.mkdir(parents=True, exist_ok=True)
        on_table = None if sink is None else lambda k, sample_id, table: sink.row(i, k, sample_id, table)

        def on_row(tokens: int, nbytes: int) -> None:
            bar.row(tokens, nbytes)
            check_interrupt()  # a Ctrl-C or SIGTERM noted while the part is generated (hs_dataset.processes)

        builder = HiddenStatesBuilder(resolved=resolved, part=(start, stop), backend=backend, on_row=on_row,
                                      stream=stream, workers=workers, on_table=on_table,
                                      cache_dir=str(state / "cache"))  # datasets' builder keeps its lock files there
        staging.mkdir()
        _write_shards(builder, staging, start, stop, config)
        counts = builder.counts
        if counts.samples_in != stop - start:
            raise RuntimeError(f"part {i}: read {counts.samples_in} source rows, expected {stop - start}")
    except BaseException:
        _discard_part(out, state, i, config.file_format)
        raise
    quality = builder.statistics.to_dict() if builder.statistics is not None else None
    return GeneratedPart(i, start, stop, staging, counts, [r.to_dict() for r in builder.rejects], backend.versions(),
                         tuple(sorted(builder.dropped)), builder.state_columns, quality, _coding(config))


def _coded(src: str, drained: Mapping[tuple[int, int, int], Written], coding: str, state_columns: tuple[str, ...]) -> CodedShard:
    """The staging shard ``src`` coded: as its writer coded it, or here when it was rewritten since (rows dropped)."""
    done = written(drained, src)
    if done is not None and done.coded is not None:
        return done.coded
    return code_file(coding, src, str(tmp_path(Path(src))), state_columns)


def commit_part(out: Path, state: Path, g: GeneratedPart, ext: str) -> None:
    """fsync the part's shards, move them into data/, then write its record (the commit point).

    Runs on a committer thread while the next parts are captured (several parts may be committing at
    once, each its own): the writes still queued and the fsync (seconds per GB) then cost no capture
    time. Only a recorded part counts; a kill before the record redoes the part.
    """
    record_path = part_record(state, g.i)
    try:
        # its shards whole (their writes ran behind the capture), hashed and coded by their writers; a failure raises
        drained = drain(g.staging)
        shards = sorted(glob.glob(str(g.staging / f"{SHARD_PREFIX}*.arrow")))
        if g.dropped:  # rejected after some of their rows were written: no partial sample is committed
            for src in shards:
                drop_rows(src, set(g.dropped))
            if g.quality is not None:
                g.quality = recount(shards, list(g.state_columns), g.quality)
        coded: list[tuple[str, int | None, str | None]]  # path, rows, content hash (None: taken from the file)
        if g.coding:  # lossless coding (codec.coding): the rows counted and the hash taken by the coding thread
            coded = [(c.path, c.rows, c.digest) for c in (_coded(src, drained, g.coding, g.state_columns)
                                                         for src in shards)]
        else:  # rows from the stream's framing, content hash from the writer (read back only if rewritten since)
            coded = [(src, None, None if (w := written(drained, src)) is None else w.digest) for src in shards]
        files = []
        for k, (src, rows, digest) in enumerate(coded):
            files.append(dict(shard_entry(src, digest, rows=rows), name=shard_name(g.i, k, ext)))
            fsync_file(Path(src))  # on disk before the record can point at it
        if sum(f["rows"] for f in files) != Counts.rows_of(dataclasses.asdict(g.counts)):
            raise RuntimeError(f"part {g.i}: its shards hold {sum(f['rows'] for f in files)} rows, "
                               f"{g.counts.rows_written} were written; this is a bug in hs_dataset")
        note = note_moving(state, g.i, [f["name"] for f in files])  # recover's proof that these are ours
        for (src, _, _), f in zip(coded, files):
            os.replace(src, out / DATA_DIR / f["name"])
        fsync_dir(out / DATA_DIR)
        record = {"part": g.i, "start": g.start, "stop": g.stop, "files": files,
                  "counts": dataclasses.asdict(g.counts), "rejects": g.rejects, "backend_versions": g.backend_versions,
                  "quality": g.quality}
        atomic_write(record_path, json.dumps(record))  # the commit point of this part
        note.unlink()
    except BaseException:
        _discard_part(out, state, g.i, ext)
        raise
    _clear_staging(state, g.i)

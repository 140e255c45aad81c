"""The crash-safe state of a build: part records and recovery after a kill (the content key a resume checks is
:mod:`hs_dataset.write.build_key`).

A *part* is a fixed range of ``part_size`` source rows. A part's record
(``.hs_build/parts/part-PPPPP.json``, written atomically after its shards are in ``data/``) is the
commit point of the part; it lists each shard with its size, rows and content hash
(:mod:`hs_dataset.integrity.checksums`). :func:`recover` runs when a build starts: it keeps exactly
the parts whose record reads, matches the plan, whose listed shards all pass the quick check (size,
first and last MiB, row count) and that no full verification marked damaged; everything else
(shard files no kept record lists, staging folders, ``.tmp`` files of killed atomic writes) is
removed, so a rerun of the same command ends with the rows of an uninterrupted build.

Recovery deletes only what it can prove a build wrote: a shard in ``data/`` that its part records
list, or that a *move note* names (``.hs_build/parts/moving-PPPPP.json``, written by
:func:`note_moving` before a part's shards are moved into ``data/``: a kill between the move and the
record leaves them listed there), a shard of a part whose record exists but cannot be read (the build
committed that part; the record was damaged since), the ``.tmp`` files of its own atomic writes, and its own
``.hs_build/`` state. Any other entry of ``data/`` is refused, a file named like a shard included (a
copy put there by hand): :func:`hs_dataset.write.output.check_output` has refused foreign outputs
before.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from hs_dataset.atomic import atomic_write, fsync_dir
from hs_dataset.write.output import OUT_FILES, foreign, ours_tmp
from hs_dataset.errors import ForeignFilesError
from hs_dataset.integrity.checksums import check_shard
from hs_dataset.integrity.damage import damaged_parts
from hs_dataset.records import Counts
from hs_dataset.layout import DAMAGED_FILE, DATA_DIR, META_FILE, README_FILE, REJECTS_FILE, SHARD_RE

__all__ = ["full_check", "invalidate_finished", "note_moving", "part_files", "part_record",
           "recorded_rows", "recover"]

logger = logging.getLogger(__name__)


def part_record(state: Path, i: int) -> Path:
    return state / "parts" / f"part-{i:05d}.json"


def _moving_note(state: Path, i: int) -> Path:
    return state / "parts" / f"moving-{i:05d}.json"


def note_moving(state: Path, i: int, names: list[str]) -> Path:
    """Record, before part ``i``'s shards are moved into ``data/``, the names they get there: the proof
    :func:`recover` needs to delete them if the move is killed before the part's record. -> the note
    (remove it once the record is written)."""
    note = _moving_note(state, i)
    atomic_write(note, json.dumps({"part": i, "files": names}))
    return note


def part_files(out: Path, i: int, ext: str) -> list[Path]:
    return sorted((out / DATA_DIR).glob(f"train-{i:05d}-*.{ext}"))


def _read_record(path: Path) -> dict[str, Any] | None:
    """A part record, or None when it is unreadable (it is then redone)."""
    try:
        r = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(r, dict) and path.name == f"part-{int(r['part']):05d}.json"
                and isinstance(r["files"], list) and isinstance(r["counts"], dict)):
            return None
        for f in r["files"]:
            if not (isinstance(f, dict) and SHARD_RE.match(str(f["name"])) and int(f["bytes"]) >= 0):
                return None
        return r
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _invalid(r: dict[str, Any] | None, plan: dict[int, tuple[int, int]], data: Path, damaged: dict[int, str]) -> str | None:
    """Why a part record cannot be trusted (None: it can). ``plan``: part -> (start, stop)."""
    if r is None:
        return "its record is unreadable"
    if (r["start"], r["stop"]) != plan[r["part"]]:
        return "its row range changed"
    if r["part"] in damaged:
        return f"a full verification found it damaged ({damaged[r['part']]})"
    for f in r["files"]:
        why = check_shard(data / f["name"], f, quick=True)
        if why is not None:
            return f"its shard {data / f['name']} {why}"
    rows = sum(int(f.get("rows", -1)) for f in r["files"])
    if rows != Counts.rows_of(r["counts"]) or "written" not in r["counts"]:
        return f"its shards hold {rows} rows, its record counts {Counts.rows_of(r['counts'])}"
    return None


def recover(out: Path, state: Path, parts: list[tuple[int, int, int]]) -> set[int]:
    """Bring the output directory back to a consistent state after any interruption.

    ``parts`` (index, start, stop) are the parts this build makes: all of the source's, or a shard's
    subset of them (:mod:`hs_dataset.scale.worker`); a record of any other part is dropped.
    Returns the parts whose record is valid: the record reads, its row range matches the current
    plan, every shard it lists passes the quick check (:func:`hs_dataset.integrity.checksums.check_shard`:
    size, first and last MiB, rows) and no full verification marked the part damaged. Every other
    record is removed (its part is redone), and so is every shard in ``data/`` that no valid record
    lists but that the build provably wrote (named by a record or a move note, or of a part whose
    record is torn: a part killed between moving its shards and writing its record, a part redone);
    any other file there is refused (:class:`ForeignFilesError`: a copy named like a shard too).
    Staging folders and the ``.tmp`` files of interrupted atomic writes are removed.
    """
    shutil.rmtree(state / "staging", ignore_errors=True)
    data = out / DATA_DIR
    for folder, names in ((out, OUT_FILES), (state, None), (state / "parts", None), (data, ())):
        for f in folder.iterdir():
            if ours_tmp(names, f.name) and f.is_file() and not f.is_symlink():
                f.unlink()
    done: set[int] = set()
    keep: set[str] = set()
    ours: set[str] = set()  # named by a record or a move note of this build: provably its own files
    notes = sorted((state / "parts").glob("moving-*.json"))
    for note in notes:
        try:
            listed = json.loads(note.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            listed = []  # a note is written atomically: unreadable only if damaged; its files are then refused
        ours.update(f for f in listed if isinstance(f, str) and SHARD_RE.match(f))
    damaged = damaged_parts(state)
    plan = {i: (start, stop) for i, start, stop in parts}
    torn: set[int] = set()  # parts whose record exists but does not read: the build committed them
    drop: list[tuple[Path, str | None]] = []  # records to remove (their parts are redone), with why
    for rec in sorted((state / "parts").glob("part-*.json")):
        r = _read_record(rec)
        if r is not None:
            ours.update(f["name"] for f in r["files"])
        elif rec.stem[len("part-"):].isdigit():
            torn.add(int(rec.stem[len("part-"):]))
        if r is not None and r["part"] not in plan:
            drop.append((rec, None))  # not a part of this build (max_samples shrank): dropped; its shards go below
            continue
        why = _invalid(r, plan, data, damaged)
        if why is not None or r is None:
            drop.append((rec, why))
            continue
        done.add(r["part"])
        keep.update(f["name"] for f in r["files"])
    orphans = []  # every file of data/ judged before anything is removed: a refusal leaves the proofs in place
    for f in sorted(data.iterdir()):
        if f.name in keep:
            continue
        m = SHARD_RE.match(f.name)
        if m is None or f.is_symlink() or not f.is_file():
            raise ForeignFilesError(f"{foreign(f)} was not written by hs_dataset: move it out of {data}/, then run "
                                    "the same command again")
        if f.name not in ours and int(m.group(1)) not in torn:
            raise ForeignFilesError(f"{foreign(f)} is named like a shard, but no record of this build lists it (a "
                                    f"copy?): a build deletes only what it wrote; move it out of {data}/, then run "
                                    "the same command again")
        orphans.append(f)
    for rec, why in drop:
        if why is not None:
            logger.warning("hs_dataset: redoing %s: %s", rec.stem, why)
        rec.unlink()
    fsync_dir(state / "parts")
    (state / DAMAGED_FILE).unlink(missing_ok=True)  # its parts' records are gone: they are redone
    for f in orphans:
        logger.warning("hs_dataset: removing %s: no kept part record lists it", f)
        f.unlink()  # a part killed between moving its shards and writing its record, or one redone
    for note in notes:
        note.unlink()  # its part has a record now, or is redone
    fsync_dir(data)
    return done


def invalidate_finished(out: Path, state: Path) -> None:
    """Before ``data/`` changes, remove the files that mark a finished build (hs_dataset.json first).

    The old metadata is kept in ``.hs_build/meta.json`` (its build command and versions are reused).
    """
    meta = out / META_FILE
    if meta.exists():
        atomic_write(state / META_FILE, meta.read_text(encoding="utf-8"))
    for name in (META_FILE, README_FILE, REJECTS_FILE):
        (out / name).unlink(missing_ok=True)
    fsync_dir(out)


def recorded_rows(state: Path) -> int:
    """The source rows the readable part records of ``state`` reach (0: none): a build of fewer rows would have
    :func:`recover` delete the parts beyond them."""
    return max((int(r["stop"]) for r in map(_read_record, sorted((state / "parts").glob("part-*.json")))
                if r is not None), default=0)


def full_check(out: Path, state: Path, parts: list[tuple[int, int, int]]) -> dict[int, str]:
    """The whole content hash of every shard of the recorded ``parts`` -> ``{part: what}`` of the damaged ones.

    What a rerun with nothing left to build runs before it says done (a flipped bit in the middle of a
    shard is beyond the quick check): one read of the build, at disk speed.
    """
    damaged: dict[int, str] = {}
    for i, _, _ in parts:
        r = _read_record(part_record(state, i))
        for f in (r or {}).get("files", []):
            why = check_shard(out / DATA_DIR / f["name"], f, quick=False)
            if why is not None:
                logger.warning("hs_dataset: redoing part %d: its shard %s %s", i, f["name"], why)
                damaged[i] = f"{DATA_DIR}/{f['name']} {why}"
                break
    return damaged

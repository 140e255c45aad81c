"""The crash-safe state of a build: part records, recovery after a kill, the lock, atomic writes,
and the errors of a disk that cannot be written.

A *part* is a fixed range of ``part_size`` source rows. A part's record
(``.hs_build/parts/part-PPPPP.json``, written atomically after its shards are in ``data/``) is the
commit point of the part; it lists each shard with its size, rows and content hash
(:mod:`hs_dataset.checksums`). :func:`recover` runs when a build starts: it keeps exactly the parts
whose record reads, matches the plan, whose listed shards all pass the quick check (size, first and
last MiB, row count) and that no full verification marked damaged; everything else (shards no kept
record lists, any other file in ``data/``, staging folders, ``.tmp`` files of killed atomic writes)
is removed, so a rerun of the same command ends with the rows of an uninterrupted build.

Recovery deletes only what a build writes: shard files named ``train-PPPPP-SSS.<format>`` in
``data/``, the ``.tmp`` files of its own atomic writes, and its own ``.hs_build/`` state. Before any
of that, :func:`check_output` refuses an output that is not empty and not a build (no
``hs_dataset.json``, no ``.hs_build/``), a ``data/`` or ``.hs_build/`` that is a link, a ``data/``
holding anything else (another file, a folder, a link), and a source inside the output: nothing is
deleted that the build cannot prove it wrote.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from .checksums import check_shard
from .errors import BuildLockedError, ConfigMismatchError, ForeignFilesError, OutputWriteError
from .layout import DAMAGED_FILE, DATA_DIR, META_FILE, README_FILE, REJECTS_FILE, SHARD_RE, STATE_DIR
from .redact import redact_text

__all__ = ["RESUMABLE_CHANGES", "atomic_write", "check_output", "check_resume", "check_shrink", "damaged_parts",
           "fsync_dir",
           "fsync_file", "invalidate_finished", "lock_output", "output_error", "part_files", "part_ranges", "part_record",
           "recover"]

logger = logging.getLogger(__name__)

# The temporary names of this package's atomic writes (atomic_write, the merge's links): .<name>.tmp-<pid>
TMP_RE = re.compile(r"^\..+\.tmp-\d+$")
_OUT_FILES = (META_FILE, README_FILE, REJECTS_FILE)  # the files a build writes at the top of its output


def _ours_tmp(folder_files: tuple[str, ...] | None, name: str) -> bool:
    """A leftover of one of our atomic writes: of a file in ``folder_files`` or of a shard (None: of any file)."""
    if not TMP_RE.match(name):
        return False
    base = name[1:name.rindex(".tmp-")]
    return folder_files is None or base in folder_files or SHARD_RE.match(base) is not None


def _foreign(path: Path) -> str:
    """``path`` and what it is, for a refusal."""
    kind = "a link" if path.is_symlink() else "a folder" if path.is_dir() else "a file"
    return f"{path} ({kind})"


def check_output(out: Path, source: str | os.PathLike | None = None) -> None:
    """Refuse, before anything is touched, an output directory that is not ours to write.

    ``out`` may be missing, empty, or a build of hs_dataset (its ``hs_dataset.json`` or its
    ``.hs_build/`` folder); its ``data/`` and ``.hs_build/`` must be real folders, and ``data/`` may hold
    only shards of the names a build writes (``train-PPPPP-SSS.<format>``, and the ``.tmp`` files of their
    writes). ``source``, when a local path, must not lie inside ``out`` (a rebuild would delete it).

    Raises:
        ForeignFilesError: naming the folder or file and what to do.
    """
    if source is not None:
        from .sources import source_path

        src = source_path(source)
        if src is not None:
            a, b = src.resolve(), out.resolve()
            if a == b or b in a.parents:
                raise ForeignFilesError(f"the source {src} lies inside the output directory {out}: a build owns its "
                                        "output and removes what it did not write; move the source out, or pass "
                                        "another --output")
    if not out.is_dir():
        return  # made by the build (a file in its way is an OutputWriteError)
    entries = sorted(out.iterdir())
    if not entries:
        return
    if not ((out / META_FILE).is_file() or (out / STATE_DIR).is_dir()):
        shown = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ForeignFilesError(f"--output {out} is not empty and not an hs_dataset build (it holds {shown}): "
                                "refusing to write there, nothing was touched; pass a new or empty directory")
    for name in (DATA_DIR, STATE_DIR):
        if (out / name).is_symlink():
            raise ForeignFilesError(f"{out / name} is a link: a build writes and removes files in its own "
                                    f"{name}/ only; replace the link with a folder, or pass another --output")
    data = out / DATA_DIR
    if data.exists() and not data.is_dir():
        raise ForeignFilesError(f"{data} is not a folder: a build keeps its shards in {data}/; move it away, "
                                "or pass another --output")
    if data.is_dir():
        for p in sorted(data.iterdir()):
            if not (SHARD_RE.match(p.name) or _ours_tmp((), p.name)) or p.is_symlink() or not p.is_file():
                raise ForeignFilesError(
                    f"{_foreign(p)} was not written by hs_dataset, and {data}/ is the build's (every file there is "
                    "loaded as a shard): move it out of that folder, then run the same command again")


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that readers see the old or the new content, never a part.

    The text goes to ``.<name>.tmp-<pid>`` (removed if writing fails; a killed writer's leftover
    is removed by the next build), is fsynced, then renamed over ``path``; the folder is fsynced.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def part_record(state: Path, i: int) -> Path:
    return state / "parts" / f"part-{i:05d}.json"


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
    if rows != int(r["counts"].get("written", -1)):
        return f"its shards hold {rows} rows, its record counts {r['counts'].get('written')} written"
    return None


def damaged_parts(state: Path) -> dict[int, str]:
    """Parts a full verification (``hs-dataset verify``, ``push``) found damaged: {part: what}.

    Written by :func:`hs_dataset.verify.mark_damaged`; the next build redoes them, then drops the file.
    """
    try:
        d = json.loads((state / DAMAGED_FILE).read_text(encoding="utf-8"))
        return {int(k): str(v) for k, v in d.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def recover(out: Path, state: Path, parts: list[tuple[int, int, int]]) -> set[int]:
    """Bring the output directory back to a consistent state after any interruption.

    ``parts`` (index, start, stop) are the parts this build makes: all of the source's, or a shard's
    subset of them (:mod:`hs_dataset.scaleout`); a record of any other part is dropped.
    Returns the parts whose record is valid: the record reads, its row range matches the current
    plan, every shard it lists passes the quick check (:func:`hs_dataset.checksums.check_shard`:
    size, first and last MiB, rows) and no full verification marked the part damaged. Every other
    record is removed (its part is redone), and so is every file in ``data/`` that no valid record
    lists and that bears a shard's name (a part killed between moving its shards and writing its
    record, a copy named like a shard) is removed; :func:`check_output` has refused any other entry
    before. Staging folders and the ``.tmp`` files of interrupted atomic writes are removed.
    """
    shutil.rmtree(state / "staging", ignore_errors=True)
    data = out / DATA_DIR
    for folder, names in ((out, _OUT_FILES), (state, None), (state / "parts", None), (data, ())):
        for f in folder.iterdir():
            if _ours_tmp(names, f.name) and f.is_file() and not f.is_symlink():
                f.unlink()
    done: set[int] = set()
    keep: set[str] = set()
    damaged = damaged_parts(state)
    plan = {i: (start, stop) for i, start, stop in parts}
    for rec in sorted((state / "parts").glob("part-*.json")):
        r = _read_record(rec)
        if r is not None and r["part"] not in plan:
            rec.unlink()  # not a part of this build (max_samples shrank): dropped; its shards go below
            continue
        why = _invalid(r, plan, data, damaged)
        if why is not None:
            logger.warning("hs_dataset: redoing %s: %s", rec.stem, why)
            rec.unlink()
            continue
        done.add(r["part"])
        keep.update(f["name"] for f in r["files"])
    fsync_dir(state / "parts")
    (state / DAMAGED_FILE).unlink(missing_ok=True)  # its parts' records are gone: they are redone
    for f in sorted(data.iterdir()):
        if f.name in keep:
            continue
        if not SHARD_RE.match(f.name) or f.is_symlink() or not f.is_file():
            raise ForeignFilesError(f"{_foreign(f)} was not written by hs_dataset: move it out of {data}/, then run "
                                    "the same command again")
        logger.warning("hs_dataset: removing %s: no part record lists it", f)
        f.unlink()  # e.g. a part killed between moving its shards and writing its record
    fsync_dir(data)
    return done


def lock_output(out: Path, state: Path) -> int:
    """Hold ``.hs_build/lock`` for the whole build (the kernel releases it when the process dies)."""
    fd = os.open(state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise BuildLockedError(
            f"another hs-dataset build (pid {other}) is writing {out}: wait for it to end or stop it. Two "
            "builds must never share an output directory.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_WRITE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.EISDIR}
_ERRNO_TEXT = {"no space left": errno.ENOSPC, "not enough disk space": errno.ENOSPC,  # datasets' own check
               "file too large": errno.EFBIG, "disk quota": errno.EDQUOT,
               "read-only file system": errno.EROFS, "permission denied": errno.EACCES}


def output_error(e: OSError, out: Path) -> OutputWriteError | None:
    """An :class:`OutputWriteError` for a write failure under ``out`` (None: not an output problem)."""
    if isinstance(e, OutputWriteError):
        return e
    code = e.errno
    if code is None:  # pyarrow's IO errors carry the errno only in their text
        text = str(e).lower()
        m = re.search(r"errno[ =:]*(\d+)", text)
        code = int(m.group(1)) if m else next((c for t, c in _ERRNO_TEXT.items() if t in text), None)
    if code not in _NO_SPACE | _NO_WRITE:
        return None
    out_abs = out.absolute()
    path = os.fsdecode(e.filename) if e.filename is not None else None
    if path is not None:
        p = Path(path).absolute()
        if not (p == out_abs or out_abs in p.parents or p in out_abs.parents):
            return None  # e.g. the model or the source cannot be read: not about the output
    where = path or str(out)
    if path is None:
        where += f" ({str(e).strip()[:300]})"
    if code in _NO_SPACE:
        msg = (f"cannot write {where}: {os.strerror(code)}. The disk of the output directory {out_abs} is full "
               "(or over quota, or over the file size limit). Free space there or pass another --output on a "
               "larger disk, then run the same command again: finished parts are kept and the build resumes "
               "(the unfinished part was discarded; nothing half-written is kept).")
    else:
        blocker = next((a for a in [out_abs, *out_abs.parents] if a.exists() and not a.is_dir()), None)
        reason = (f"{blocker} is a file, not a directory" if blocker is not None else os.strerror(code))
        msg = (f"cannot write {where}: {reason}. Make {out_abs} a writable directory or pass another "
               "--output, then run the same command again to resume.")
    return OutputWriteError(code, msg, path or str(out))


# Content fields that may still change on resume, (from, to): rows already written stay right.
# on_nonfinite fail -> reject: a part written under "fail" holds no non-finite state (it would have
# stopped the build), so it is what "reject" would have written.
RESUMABLE_CHANGES: dict[str, set[tuple[Any, Any]]] = {"on_nonfinite": {("fail", "reject")}}


def check_resume(state: Path, key: dict[str, Any]) -> None:
    """Refuse to resume a build whose content key (``build.json``) differs from ``key``, except for
    the changes in :data:`RESUMABLE_CHANGES`, which are recorded and allowed."""
    path = state / "build.json"
    if not path.exists():
        atomic_write(path, json.dumps(key, indent=1, sort_keys=True))
        return
    old = json.loads(path.read_text())
    if old != key:
        diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
        if all((old.get(k), key.get(k)) in RESUMABLE_CHANGES.get(k, ()) for k in diff):
            logger.warning("hs_dataset: resuming %s with %s", state.parent,
                           ", ".join(f"{k} {old.get(k)!r} -> {key.get(k)!r}" for k in diff))
            atomic_write(path, json.dumps(key, indent=1, sort_keys=True))
            return
        details = redact_text("; ".join(f"{k}: {old.get(k)!r} -> {key.get(k)!r}" for k in diff))[0]
        raise ConfigMismatchError(
            f"{state.parent} holds a build made with another configuration ({details}). Refusing to mix "
            "rows: use a new --output directory, or delete this one to start over.")


def part_ranges(rows: int, part_size: int) -> list[tuple[int, int, int]]:
    """The parts of a build of ``rows`` source rows: ``(index, first row, end row)``, ``part_size`` rows each
    (the last one shorter): the unit of resume, of a shard's share and of the plan."""
    return [(i, s, min(s + part_size, rows)) for i, s in enumerate(range(0, rows, part_size))]


def check_shrink(out: Path, state: Path, rows: int, allow: bool) -> None:
    """Refuse a build of ``rows`` source rows where the directory holds rows beyond them (``max_samples``
    lowered): :func:`recover` would delete those parts. ``allow`` lets it (the rows beyond go).

    Raises:
        ConfigMismatchError: a part record ends after ``rows`` and ``allow`` is False.
    """
    if allow:
        return
    ends = [int(r["stop"]) for r in map(_read_record, sorted((state / "parts").glob("part-*.json"))) if r is not None]
    if ends and max(ends) > rows:
        raise ConfigMismatchError(
            f"{out} holds {max(ends)} source rows, this build {rows} (max_samples lowered?): refusing to delete the "
            f"rows beyond {rows}. Raise max_samples back, use a new --output, or pass --allow-shrink to delete them.")

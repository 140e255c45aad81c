"""The output directory of a build: is it ours to write, who holds it, and what a failed write means.

* :func:`check_output` refuses, before anything is touched, an output that is not empty and not a
  build of ours, a ``data/`` or ``.hs_build/`` that is a link, a ``data/`` holding files a build does
  not write;
* :func:`lock_output`: one build at a time per output (``.hs_build/lock``, released by the kernel
  when the process dies);
* :func:`output_error`: a full disk or an unwritable output as one :class:`OutputWriteError` naming
  the path and what to do.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from pathlib import Path

from hs_dataset.errors import BuildLockedError, ForeignFilesError, OutputWriteError
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, REJECTS_FILE, SAMPLE_STATS_FILE, SHARD_RE, STATE_DIR

__all__ = ['OUT_FILES', 'check_output', 'foreign', 'lock_output', 'ours_tmp', 'output_error']


# The temporary names of this package's atomic writes (atomic_write, the merge's links): .<name>.tmp-<pid>
TMP_RE = re.compile(r"^\..+\.tmp-\d+$")


# the files a build writes at the top of its output (sample_stats.parquet: with sample_stats, or verify --stats)
OUT_FILES = (META_FILE, README_FILE, REJECTS_FILE, SAMPLE_STATS_FILE)


def ours_tmp(folder_files: tuple[str, ...] | None, name: str) -> bool:
    """A leftover of one of our atomic writes: of a file in ``folder_files`` or of a shard (None: of any file)."""
    if not TMP_RE.match(name):
        return False
    base = name[1:name.rindex(".tmp-")]
    return folder_files is None or base in folder_files or SHARD_RE.match(base) is not None


def foreign(path: Path) -> str:
    """``path`` and what it is, for a refusal."""
    kind = "a link" if path.is_symlink() else "a folder" if path.is_dir() else "a file"
    return f"{path} ({kind})"


def check_output(out: Path) -> None:
    """Refuse, before anything is touched, an output directory that is not ours to write.

    ``out`` may be missing, empty, or a build of hs_dataset (its ``hs_dataset.json`` or its
    ``.hs_build/`` folder); its ``data/`` and ``.hs_build/`` must be real folders, and ``data/`` may hold
    only shards of the names a build writes (``train-PPPPP-SSS.<format>``, and the ``.tmp`` files of their
    writes). (A source inside ``out`` is refused by :meth:`hs_dataset.prepare.source_spec.Source.check_outside`.)

    Raises:
        ForeignFilesError: naming the folder or file and what to do.
    """
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
            if not (SHARD_RE.match(p.name) or ours_tmp((), p.name)) or p.is_symlink() or not p.is_file():
                raise ForeignFilesError(
                    f"{foreign(p)} was not written by hs_dataset, and {data}/ is the build's (every file there is "
                    "loaded as a shard): move it out of that folder, then run the same command again")


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

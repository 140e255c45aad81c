"""The shard-writer stage: runs the builder part by part into a resumable, loadable directory.

Output layout::

    OUT/README.md               YAML `configs:` + `dataset_info:` (plain load_dataset(OUT) works), card
    OUT/hs_dataset.json         model, layers + convention, storage dtype, counts, versions, command
    OUT/rejects.jsonl           one line per rejected sample: id, field, reason, stage
    OUT/data/train-PPPPP-SSS.arrow   whole shards only (P = part, S = shard within the part)
    OUT/.hs_build/              resume state (never published)

A *part* is a fixed range of ``part_size`` source rows. Each part is built by
``HiddenStatesBuilder.download_and_prepare`` into a staging folder; its finished shards are then
moved into ``data/`` and only after that is the part's record written (atomically): the record
is the commit point. A build killed at any moment (SIGKILL included) and run again with the
same command ends with the same rows as an uninterrupted build:

* on start it checks every part record: each listed shard must exist with its recorded size,
  else the part is redone; shards in ``data/`` that no valid record lists (a part killed between
  its moves and its record) are deleted; staging folders (with datasets' ``.incomplete`` dirs)
  and ``.tmp`` files of killed atomic writes are removed;
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
import errno
import fcntl
import glob
import json
import logging
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import yaml

from . import __version__
from .backends import LAYER_CONVENTION, CaptureBackend, check_layers, make_backend, read_model_info
from .builder import CaptureStream, HiddenStatesBuilder, HiddenStatesConfig
from .encode import make_features, state_columns
from .records import Counts
from .sources import count_rows, source_fingerprint

STATE_DIR = ".hs_build"
META_FILE = "hs_dataset.json"
REJECTS_FILE = "rejects.jsonl"
FORMAT_VERSION = 1


logger = logging.getLogger(__name__)

SHARD_RE = re.compile(r"^train-(\d{5,})-(\d{3,})\.(arrow|parquet)$")
TMP_RE = re.compile(r"^\..+\.tmp-\d+$")


class ConfigMismatchError(RuntimeError):
    """The output directory holds a build made with a different configuration."""


class BuildLockedError(RuntimeError):
    """Another build is writing the same output directory."""


class OutputWriteError(OSError):
    """The output could not be written: disk full, over quota, read-only, not a directory...

    ``errno`` is the underlying error number; the message names the path and what to do.
    Nothing half-written is kept; rerunning the same command resumes.
    """

    def __init__(self, code: int, message: str, path: str | None = None):
        super().__init__(code, message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return self.message


@dataclass
class BuildSummary:
    output_dir: str
    counts: Counts
    parts_built: int
    parts_skipped: int
    bytes_written: int
    seconds: float


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
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _part_record(state: Path, i: int) -> Path:
    return state / "parts" / f"part-{i:05d}.json"


def _part_files(out: Path, i: int, ext: str) -> list[Path]:
    return sorted((out / "data").glob(f"train-{i:05d}-*.{ext}"))


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


def _invalid(r: dict[str, Any] | None, parts: list[tuple[int, int, int]], data: Path) -> str | None:
    """Why a part record cannot be trusted (None: it can)."""
    if r is None:
        return "its record is unreadable"
    if (r["start"], r["stop"]) != parts[r["part"]][1:]:
        return "its row range changed"
    for f in r["files"]:
        p = data / f["name"]
        if not p.is_file():
            return f"its shard {p} is missing"
        if p.stat().st_size != int(f["bytes"]):
            return f"its shard {p} has {p.stat().st_size} bytes, the record says {f['bytes']}"
    return None


def _recover(out: Path, state: Path, parts: list[tuple[int, int, int]]) -> set[int]:
    """Bring the output directory back to a consistent state after any interruption.

    Returns the parts whose record is valid: the record reads, its row range matches the current
    plan, and every shard it lists is in ``data/`` with the recorded size. Every other record is
    removed (its part is redone), and so is every shard in ``data/`` that no valid record lists.
    Staging folders and the ``.tmp`` files of interrupted atomic writes are removed.
    """
    shutil.rmtree(state / "staging", ignore_errors=True)
    for folder in (out, state, state / "parts"):
        for f in folder.iterdir():
            if TMP_RE.match(f.name) and f.is_file():
                f.unlink()
    data = out / "data"
    done: set[int] = set()
    keep: set[str] = set()
    for rec in sorted((state / "parts").glob("part-*.json")):
        r = _read_record(rec)
        if r is not None and r["part"] >= len(parts):
            rec.unlink()  # beyond the end of the source (max_samples shrank): dropped; its shards go below
            continue
        why = _invalid(r, parts, data)
        if why is not None:
            logger.warning("hs_dataset: redoing %s: %s", rec.stem, why)
            rec.unlink()
            continue
        done.add(r["part"])
        keep.update(f["name"] for f in r["files"])
    for f in sorted(data.iterdir()):
        if SHARD_RE.match(f.name) and f.name not in keep:
            f.unlink()  # a part killed between moving its shards and writing its record
    _fsync_dir(data)
    return done


def _lock(out: Path, state: Path) -> int:
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


def _invalidate_finished(out: Path, state: Path) -> None:
    """Before ``data/`` changes, remove the files that mark a finished build (hs_dataset.json first).

    The old metadata is kept in ``.hs_build/meta.json`` (its build command and versions are reused).
    """
    meta = out / META_FILE
    if meta.exists():
        atomic_write(state / META_FILE, meta.read_text(encoding="utf-8"))
    for name in (META_FILE, "README.md", REJECTS_FILE):
        (out / name).unlink(missing_ok=True)
    _fsync_dir(out)


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_WRITE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.EISDIR}
_ERRNO_TEXT = {"no space left": errno.ENOSPC, "file too large": errno.EFBIG, "disk quota": errno.EDQUOT,
               "read-only file system": errno.EROFS, "permission denied": errno.EACCES}


def _output_error(e: OSError, out: Path) -> OutputWriteError | None:
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


def _check_resume(state: Path, key: dict[str, Any]) -> None:
    path = state / "build.json"
    if not path.exists():
        atomic_write(path, json.dumps(key, indent=1, sort_keys=True))
        return
    old = json.loads(path.read_text())
    if old != key:
        diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
        details = "; ".join(f"{k}: {old.get(k)!r} -> {key.get(k)!r}" for k in diff)
        raise ConfigMismatchError(
            f"{state.parent} holds a build made with another configuration ({details}). Refusing to mix "
            "rows: use a new --output directory, or delete this one to start over.")


class _Progress:
    """Samples, tokens/s, bytes written and ETA on one line."""

    def __init__(self, total: int, done: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=done, unit="sample", disable=not enabled, dynamic_ncols=True,
                        desc="hs-dataset build")
        self.t0 = time.time()
        self.tokens = 0
        self.bytes = 0

    def row(self, tokens: int, nbytes: int) -> None:
        self.tokens += tokens
        self.bytes += nbytes
        dt = max(time.time() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / dt:,.0f} tok/s, {self.bytes / 2**30:.2f} GiB written", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def build(config: HiddenStatesConfig, output_dir: str | os.PathLike, *, backend: CaptureBackend | None = None,
          progress: bool = True, build_command: str | None = None) -> BuildSummary:
    """Build (or resume building) the dataset of ``config`` into ``output_dir``.

    Raises :class:`ConfigMismatchError` (the directory holds another configuration's build),
    :class:`BuildLockedError` (another build is writing it), :class:`OutputWriteError` (disk full,
    unwritable output), :class:`~hs_dataset.backends.BackendError` (the backend died or hangs;
    :class:`~hs_dataset.builder.NonFiniteError` for NaN/Inf with ``on_nonfinite="fail"``). After
    any of them, or a kill, running the same build again resumes it.
    """
    out = Path(output_dir)
    try:
        return _build(config, out, backend, progress, build_command)
    except OSError as e:
        err = _output_error(e, out)
        if err is None or err is e:
            raise
        raise err from e


def _build(config: HiddenStatesConfig, out: Path, backend: CaptureBackend | None, progress: bool,
           build_command: str | None) -> BuildSummary:
    t0 = time.time()
    state = out / STATE_DIR
    (state / "parts").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    lock = _lock(out, state)
    try:
        info = backend.info if backend is not None else read_model_info(config.model, config.model_revision)
        layers = check_layers(config.layers, info)
        key = dict(config.content_key(), source_fingerprint=source_fingerprint(config.source),
                   hidden_size=info.hidden_size, num_layers=info.num_layers)
        _check_resume(state, key)

        n = count_rows(config.source)
        if config.max_samples is not None:
            n = min(n, config.max_samples)
        ext = config.file_format
        parts = [(i, s, min(s + config.part_size, n)) for i, s in enumerate(range(0, n, config.part_size))]
        done = _recover(out, state, parts)
        todo = [p for p in parts if p[0] not in done]
        bar = _Progress(n, sum(p[2] - p[1] for p in parts if p[0] in done), progress)
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
                                           options=config.backend_options)
                    own_backend = True
                if stream is None and getattr(backend, "continuous", False):
                    # one capture over all remaining parts: the engine never drains at a part boundary
                    stream = CaptureStream(config, backend, [(s, e) for _, s, e in todo])
                if i == todo[0][0]:
                    _invalidate_finished(out, state)  # data/ is about to change
                generated = _generate_part(config, out, state, i, start, stop, backend, bar, stream)
                if committing is not None:  # at most one part committing while the next one is captured
                    committing.result()
                    built += 1
                committing = committer.submit(_commit_part, out, state, generated, ext)
            if committing is not None:
                committing.result()
                built += 1
                committing = None
        finally:
            if stream is not None:
                stream.close()
            committer.shutdown(wait=True)  # a part being committed finishes (or is discarded) before we return
            shutil.rmtree(state / "staging", ignore_errors=True)
            bar.close()
            if own_backend and backend is not None:
                backend.close()
        counts = _finalize(config, out, state, parts, info, layers, backend if built else None, build_command)
        shutil.rmtree(state / "staging", ignore_errors=True)
        shutil.rmtree(state / "cache", ignore_errors=True)  # datasets' per-part lock files
        nbytes = sum(f.stat().st_size for f in (out / "data").glob(f"*.{ext}"))
        return BuildSummary(str(out), counts, built, len(done), nbytes, time.time() - t0)
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
    if not _part_record(state, i).exists():
        try:
            for f in _part_files(out, i, ext):
                f.unlink()
        except OSError:
            pass  # the next build removes them
    _clear_staging(state, i)


def _generate_part(config: HiddenStatesConfig, out: Path, state: Path, i: int, start: int, stop: int,
                   backend: CaptureBackend, bar: _Progress, stream: CaptureStream | None) -> _Generated:
    """Capture and write part ``i`` into its staging folder (the main thread's work)."""
    staging = _staging(state, i)
    try:
        for f in _part_files(out, i, config.file_format):  # whole shards of a part that was not recorded: redo it
            f.unlink()
        _clear_staging(state, i)
        staging.parent.mkdir(parents=True, exist_ok=True)
        part_cfg = dataclasses.replace(config, part=(start, stop), name="default")
        builder = HiddenStatesBuilder(config=part_cfg, backend=backend, on_row=bar.row, stream=stream,
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
    record_path = _part_record(state, g.i)
    try:
        shards = sorted(glob.glob(str(g.staging / f"*-train*.{ext}")))
        for src in shards:  # on disk before the record can point at them
            _fsync_file(Path(src))
        files = []
        for k, src in enumerate(shards):
            dst = out / "data" / f"train-{g.i:05d}-{k:03d}.{ext}"
            os.replace(src, dst)
            files.append({"name": dst.name, "bytes": dst.stat().st_size})
        _fsync_dir(out / "data")
        record = {"part": g.i, "start": g.start, "stop": g.stop, "files": files,
                  "counts": dataclasses.asdict(g.counts), "rejects": g.rejects, "backend_versions": g.backend_versions}
        atomic_write(record_path, json.dumps(record))  # the commit point of this part
    except BaseException:
        _discard_part(out, state, g.i, ext)
        raise
    _clear_staging(state, g.i)


def _secret_key(key: str) -> bool:
    """Backend options never recorded: credentials (api_key, hf_token, ...), not e.g. batch_tokens."""
    k = key.lower()
    return any(w in k for w in ("secret", "password", "api_key", "apikey", "auth")) or k.endswith("token")


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
    from .chat import chat_template_sha256, load_tokenizer

    counts = Counts()
    rejects: list[dict] = []
    files: list[dict] = []
    record_versions: dict[str, str] = {}
    for i, _, _ in parts:
        r = json.loads(_part_record(state, i).read_text(encoding="utf-8"))
        counts.add(Counts(**r["counts"]))
        rejects.extend(r["rejects"])
        files.extend(r["files"])
        record_versions = r.get("backend_versions") or record_versions
    counts.check()
    _check_outputs(out, files)
    atomic_write(out / REJECTS_FILE, "".join(json.dumps(r) + "\n" for r in rejects))
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
        "tokenizer": {"path": os.path.abspath(tok_path),
                      "chat_template_sha256": chat_template_sha256(load_tokenizer(tok_path))},
        "max_length": config.max_length,
        "mask": config.mask,
        "truncation": config.truncation,
        "source": config.source,
        "counts": dataclasses.asdict(counts),
        "bytes": nbytes,
        "files": len(files),
        "backend": {"name": config.backend,
                    "options": {k: v for k, v in config.backend_options.items() if not _secret_key(k)},
                    "versions": _versions(backend) if backend is not None else
                    previous.get("backend", {}).get("versions") or {**_versions(None), **record_versions}},
        "build_command": build_command or previous.get("build_command"),
        "config": config.to_dict(),
    }
    text = json.dumps(meta, indent=1)
    atomic_write(state / META_FILE, text)
    atomic_write(out / "README.md", render_readme(meta, make_features(layers, info.hidden_size, config.storage_dtype),
                                                  counts.written, nbytes, config.file_format))
    atomic_write(meta_path, text)  # last: hs_dataset.json exists only for a finished build
    return counts


def _check_outputs(out: Path, files: list[dict]) -> None:
    """``data/`` holds exactly the recorded shards with their recorded sizes (else: a bug)."""
    listed = {f["name"]: int(f["bytes"]) for f in files}
    present = {f.name: f.stat().st_size for f in (out / "data").iterdir() if SHARD_RE.match(f.name)}
    if listed != present:
        missing = sorted(set(listed) - set(present))
        extra = sorted(set(present) - set(listed))
        sized = sorted(k for k in set(listed) & set(present) if listed[k] != present[k])
        raise RuntimeError(f"{out / 'data'} does not match the part records (missing {missing}, unlisted {extra}, "
                           f"wrong size {sized}); this is a bug in hs_dataset: run the build again to repair it")


def readme_yaml(features: datasets.Features, num_examples: int, num_bytes: int, file_format: str) -> dict[str, Any]:
    """The README front matter that lets plain ``load_dataset(dir_or_repo)`` load the shards."""
    info = datasets.DatasetInfo(features=features)
    info.splits = datasets.SplitDict()
    info.splits.add(datasets.SplitInfo(name="train", num_bytes=num_bytes, num_examples=num_examples))
    return {
        "configs": [{"config_name": "default",
                     "data_files": [{"split": "train", "path": f"data/train-*.{file_format}"}]}],
        "dataset_info": info._to_yaml_dict(),
        "tags": ["hidden-states", "eagle3", "speculative-decoding"],
    }


def render_readme(meta: dict[str, Any], features: datasets.Features, num_examples: int, num_bytes: int,
                  file_format: str) -> str:
    """README.md = YAML front matter + the dataset card body."""
    header = yaml.safe_dump(readme_yaml(features, num_examples, num_bytes, file_format), sort_keys=False)
    return f"---\n{header}---\n\n" + card_body(meta)


def card_body(meta: dict[str, Any]) -> str:
    """A short card body; ``hs-dataset push`` renders the full provenance card."""
    c = meta["counts"]
    return (f"# Hidden states of {meta['model']['architecture']}\n\n"
            f"Layers {meta['layers']} + final post-norm state, stored as {meta['stored_as']}.\n"
            f"{c['written']} samples, {c['tokens_written']} tokens, {c['rejected']} rejected.\n\n"
            f"Layer convention: {meta['layer_convention']}.\n\n"
            "Decode: `from hs_dataset.reader import decode_row; decode_row(ds.with_format('arrow')[i])`.\n")

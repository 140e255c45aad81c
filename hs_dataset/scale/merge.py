"""``hs-dataset merge OUT [SHARE_DIR ...]``: the shares of a build made by many workers
(:mod:`hs_dataset.scale.worker`) become one finished build, as if one worker had built it.

Refused, naming the share and what to do (:class:`~hs_dataset.errors.ShareError`): a folder that is
not a share build, a share still being built (its lock is held), one built with another
configuration (its ``.hs_build/build.json`` content key differs from the others') or another plan
(parts, rows, number of shares), a share given twice, a missing share, an unfinished one, and share
files that fail their check (:func:`hs_dataset.integrity.verify.check_files`: size, first and last MiB, rows;
``full``: the whole content hash, and damaged parts are then marked for the share's next build).

Then, holding every share's lock and the output's: each part's files are hard-linked into
``OUT/data/`` (no share data is copied; across file systems they are copied, and the summary says
so), each part's record is copied (the commit point, as in a build), the output is recovered like
any resumed build (:func:`hs_dataset.write.resume.recover`), and the normal final step of a build
(:func:`hs_dataset.write.finalize.finalize`) writes ``rejects.jsonl``, ``hs_dataset.json`` and the card.
The rows, metadata (but the build command) and card equal those of a single-worker build of the same
source; ``OUT`` is an ordinary build: the single-worker command (recorded as its build command)
resumes or repairs it, ``hs-dataset push`` publishes it. Merging again is harmless.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hs_dataset.atomic import atomic_write, fsync_dir, fsync_file, tmp_path
from hs_dataset.write.finalize import finalize
from hs_dataset.write.output import check_output, lock_output
from hs_dataset.write.resolve import ResolvedBuild, resolve_build
from hs_dataset.capture.fingerprint import same_probe
from hs_dataset.write.build_key import check_resume
from hs_dataset.write.resume import invalidate_finished, note_moving, part_record, recover
from hs_dataset.write.shares import WorkerShare, read_share, share_dir, share_parts
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ShareError
from hs_dataset.redact import redact_text
from hs_dataset.integrity.damage import mark_damaged
from hs_dataset.integrity.verify import check_files, damage_of
from hs_dataset.layout import DATA_DIR, REDACTED_FILE, SHARE_FILE, SHARES_DIR, STATE_DIR, part_ranges
from hs_dataset.model_info import ModelInfo
from hs_dataset.records import Counts
from hs_dataset.scale.launchers import single_worker_command

__all__ = ["MergeSummary", "found_shares", "merge_shares"]

_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP}


@dataclass
class MergeSummary:
    """What a merge made: ``linked`` files hard-linked, ``copied`` (with ``copied_bytes``) copied."""

    output_dir: str
    counts: Counts
    shares: int
    parts: int
    linked: int
    copied: int
    copied_bytes: int
    seconds: float

    def message(self) -> str:
        c = self.counts
        how = f"{self.linked} files hard-linked"
        if self.copied:
            how += (f", {self.copied} copied ({self.copied_bytes / 2**20:.1f} MiB: the shares are on another file "
                    "system than the output; hard links need one)")
        return (f"merged {self.shares} shares ({self.parts} parts) into {self.output_dir}: {c.written} samples written, "
                f"{c.rejected} rejected (of {c.samples_in}), {c.tokens_written} tokens; {how}, in {self.seconds:.1f}s")


def found_shares(out: str | os.PathLike) -> list[Path]:
    """The share builds under ``OUT/.hs_build/shares/``, in name order."""
    root = Path(out) / STATE_DIR / SHARES_DIR
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def merge_shares(out: str | os.PathLike, share_dirs: Sequence[str | os.PathLike] | None = None, *, full: bool = False,
                 build_command: str | None = None) -> MergeSummary:
    """Merge share builds into the finished build ``out``.

    Args:
        out: the output directory (made if needed; it may hold an earlier merge of the same build).
        share_dirs: the share builds (default: every one under ``OUT/.hs_build/shares/``).
        full: check each shard file's whole content hash, not only its size, edges and rows.
        build_command: recorded in ``hs_dataset.json`` (default: the shares' own, without the share flags).

    Raises:
        ShareError: the set cannot be merged (the message names the share).
        BuildLockedError: a share is being built, or ``out`` is being merged or built.
        ConfigMismatchError: ``out`` holds a build of another configuration.
    """
    t0 = time.time()
    out = Path(out)
    dirs = [Path(d) for d in share_dirs] if share_dirs else found_shares(out)
    if not dirs:
        raise ShareError(f"{out}: no share builds to merge in {out / STATE_DIR / SHARES_DIR}: build them first "
                         "(hs-dataset build ... --workers N --worker-index I)")
    seen: dict[Path, Path] = {}
    for d in dirs:
        if read_share(d) is None or _content_key(d) is None:
            raise ShareError(f"{d} is not a share build, or its build has not started (no readable {STATE_DIR}/"
                             f"{SHARE_FILE} and build.json): run its build command, or pass the folders that "
                             f"hs-dataset build --workers made ({out / STATE_DIR / SHARES_DIR}/share-*)")
        if d.resolve() in seen:
            raise ShareError(f"share {d} is given twice (also as {seen[d.resolve()]}): pass each share once")
        seen[d.resolve()] = d
    locks: list[int] = []
    try:
        for d in dirs:  # no worker may write a share while it is checked and linked
            locks.append(lock_output(d, d / STATE_DIR))
        shares = [(d, read_share(d) or {}, _content_key(d)) for d in dirs]
        first = _check_set(out, shares)
        records = _check_files(shares, full)
        state = out / STATE_DIR
        # the shares' configuration resolved once (its source string parsed here, nowhere else), nothing touched
        resolved = resolve_build(HiddenStatesConfig(**first["config"]), info=ModelInfo(**first["model"]),
                                 build_command=build_command or None)
        check_output(out)  # an output that is not ours is refused untouched, and a source inside it
        assert resolved.source is not None, "resolved with its source (resolve_build)"
        resolved.source.check_outside(out)
        (state / "parts").mkdir(parents=True, exist_ok=True)
        (out / DATA_DIR).mkdir(exist_ok=True)
        lock = lock_output(out, state)
        try:
            # the shares recorded their command redacted already; one given here is redacted by resolve_build
            command = resolved.build_command or single_worker_command(first.get("build_command"))
            return _assemble(out, shares, resolved, first, records, command, t0)
        finally:
            os.close(lock)
    finally:
        for fd in locks:
            os.close(fd)


def _content_key(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / STATE_DIR / "build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _odd_one(shares: list[tuple[Path, dict, Any]], what: str, value) -> None:
    """Refuse the shares whose ``value(share)`` differs from the most common one, naming them."""
    votes = Counter(json.dumps(value(s), sort_keys=True) for s in shares)
    usual = votes.most_common(1)[0][0]
    for d, r, key in shares:
        mine = json.dumps(value((d, r, key)), sort_keys=True)
        if mine != usual:
            base, other = json.loads(usual), json.loads(mine)
            if isinstance(base, dict) and isinstance(other, dict):
                diff = "; ".join(f"{k}: {other.get(k)!r} instead of {base.get(k)!r}"
                                 for k in sorted(set(base) | set(other)) if base.get(k) != other.get(k))
            else:
                diff = f"{other!r} instead of {base!r}"
            raise ShareError(redact_text(
                f"share {d} was built with another {what} than the other shares ({diff}): rebuild it with the "
                "same builder script and options, or leave it out")[0])


def _check_set(out: Path, shares: list[tuple[Path, dict, Any]]) -> dict[str, Any]:
    """Same content key and plan; each share index exactly once; all present and done. -> a share's record."""
    _odd_one(shares, "configuration", lambda s: {k: v for k, v in s[2].items() if k != "model_probe"})
    probes = [(d, key.get("model_probe")) for d, _, key in shares if key.get("model_probe")]
    for d, probe in probes[1:]:
        if not same_probe(probes[0][1], probe):
            raise ShareError(f"share {d} holds rows of another model than share {probes[0][0]}: probe fingerprint "
                             f"{probe['digest']} there, {probes[0][1]['digest']} in {probes[0][0]} (the weights "
                             "changed between the workers' builds?): rebuild it with the same model, or leave it out")
    _odd_one(shares, "plan (parts, rows, number of shares)", lambda s: dict(s[1]["plan"], shares=s[1]["share"]["count"]))
    first = shares[0][1]
    count = int(first["share"]["count"])
    by_index: dict[int, Path] = {}
    for d, r, _ in shares:
        i = int(r["share"]["index"])
        if i in by_index:
            raise ShareError(f"share {i} of {count} is given twice: {by_index[i]} and {d}; pass one of them")
        by_index[i] = d
    expected = share_parts(int(first["plan"]["parts"]), count)
    for i in range(count):
        if i not in by_index:
            raise ShareError(f"share {i} of {count} (parts {expected[i]}) is missing: build it (--workers {count} "
                             f"--worker-index {i}, into {share_dir(out, WorkerShare(i, count))}) and merge again")
    for d, r, _ in shares:
        i = int(r["share"]["index"])
        recorded = sorted(int(p.stem.split("-")[1]) for p in (d / STATE_DIR / "parts").glob("part-*.json"))
        if r["parts"] != expected[i] or not r.get("done") or recorded != expected[i]:
            raise ShareError(f"share {i} of {count} ({d}) is not finished: {len(set(recorded) & set(expected[i]))} of "
                             f"{len(expected[i])} parts recorded; run its build command again (it resumes), "
                             "then merge")
    return first


def _check_files(shares: list[tuple[Path, dict, Any]], full: bool) -> dict[int, tuple[dict, Path]]:
    """Every share's files against its part records. -> {part: (record, share folder)}."""
    records: dict[int, tuple[dict, Path]] = {}
    for d, r, _ in shares:
        mine = [json.loads(part_record(d / STATE_DIR, p).read_text(encoding="utf-8")) for p in r["parts"]]
        meta = {"shards": [f for rec in mine for f in rec["files"]],
                "counts": {"written": sum(int(rec["counts"]["written"]) for rec in mine)}}
        problems, _ = check_files(d, meta, quick=not full)
        if problems:
            if full:
                mark_damaged(d, damage_of(problems))  # its next build redoes those parts
            parts = sorted({p.part for p in problems if p.part is not None})
            raise ShareError(f"share {d} does not match its part records: {'; '.join(map(str, problems))}. Run its "
                             f"build command again (it rebuilds part(s) {parts}; move a file no part lists out of its data/ "
                             "first), then merge")
        records.update((rec["part"], (rec, d)) for rec in mine)
    return records


def _place(src: Path, dst: Path) -> int:
    """Hard-link ``src`` as ``dst`` (-1: it already is; 0: linked), or copy it across file systems (-> its bytes)."""
    if dst.exists() and os.path.samefile(src, dst):
        return -1
    tmp = tmp_path(dst)
    tmp.unlink(missing_ok=True)
    copied = 0
    try:
        os.link(src, tmp)
    except OSError as e:
        if e.errno not in _NO_LINK:
            raise
        shutil.copyfile(src, tmp)
        fsync_file(tmp)
        copied = tmp.stat().st_size
    os.replace(tmp, dst)
    return copied


def _assemble(out: Path, shares: list[tuple[Path, dict, Any]], resolved: ResolvedBuild, first: dict[str, Any],
              records: dict[int, tuple[dict, Path]], build_command: str | None, t0: float) -> MergeSummary:
    state = out / STATE_DIR
    check_resume(state, shares[0][2])
    invalidate_finished(out, state)
    linked = copied = copied_bytes = 0
    for p in sorted(records):
        rec, d = records[p]
        note = note_moving(state, p, [f["name"] for f in rec["files"]])  # recover's proof that these are ours
        for f in rec["files"]:
            n = _place(d / DATA_DIR / f["name"], out / DATA_DIR / f["name"])
            copied, copied_bytes = copied + (n > 0), copied_bytes + max(n, 0)
            linked += n <= 0
        fsync_dir(out / DATA_DIR)
        atomic_write(part_record(state, p), json.dumps(rec))  # the commit point of the part, as in a build
        note.unlink()
    redacted = shares[0][0] / STATE_DIR / REDACTED_FILE  # the same configuration: the same credentials
    if redacted.is_file():
        atomic_write(state / REDACTED_FILE, redacted.read_text(encoding="utf-8"))
    rows, size = int(first["plan"]["rows"]), int(first["plan"]["part_size"])
    parts = part_ranges(rows, size)
    done = recover(out, state, parts)
    if done != set(range(len(parts))):
        raise RuntimeError(f"{out}: parts {sorted(set(range(len(parts))) - done)} did not survive the merge; "
                           "this is a bug in hs_dataset: run the merge again")
    counts = finalize(resolved, out, state, parts, None, build_command)
    return MergeSummary(str(out), counts, len(shares), len(parts), linked, copied, copied_bytes, time.time() - t0)

"""``hs-dataset verify``: does a build (local, or a published version) hold exactly what its
``hs_dataset.json`` records?

    hs-dataset verify kimi-hs                   # every shard: present, size, content hash, rows
    hs-dataset verify kimi-hs --quick           # size, first/last MiB, rows (what a resumed build checks)
    hs-dataset verify org/kimi-eagle3-hs --revision v1.0           # downloads the version, full check
    hs-dataset verify org/kimi-eagle3-hs --revision v1.0 --quick   # the Hub's file list and sizes only
    hs-dataset verify kimi-hs --probe 64        # and 64 random rows re-run through the reference backend
    hs-dataset verify org/kimi-eagle3-hs@v1.0 --probe 64   # the listing, then only the probed rows' shards
    hs-dataset verify kimi-hs --stats           # and the statistics recounted from every row

(a published version: :func:`hs_dataset.hub.verify_remote.verify_repo`, which downloads it once and runs
:func:`verify_build` on that copy).

Checked: every shard listed in ``hs_dataset.json`` (``shards``) exists with its size, rows and
xxh3-128 (:mod:`hs_dataset.integrity.checksums`), no other file is in ``data/`` (readers would load it too),
and the shards' rows add up to the recorded ``counts.written``; and everything else a push uploads
agrees with ``hs_dataset.json``: the card's front matter (the features ``load_dataset`` reads),
``rejects.jsonl`` (:mod:`hs_dataset.integrity.metadata`). Each problem names the file and the part to
rebuild. Beyond the bytes (:mod:`hs_dataset.integrity.quality`): ``probe`` re-runs rows through the
reference backend (:mod:`hs_dataset.integrity.probe`; a local build records the result), ``stats``
recounts the statistics from every row (:mod:`hs_dataset.integrity.scan`), and a recorded probe that
found rows wrong is a problem until they are rebuilt. For a local build a full check also marks the damaged parts in
``.hs_build/damaged.json``, so that running the same build command again rebuilds exactly them (a
flipped bit in the middle of a large shard is beyond the quick check a resumed build runs itself).
``push`` runs the full check first and refuses a build that fails it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hs_dataset.integrity.damage import mark_damaged
from hs_dataset.integrity.metadata import check_metadata
from hs_dataset.errors import IntegrityError, NotABuildError
from hs_dataset.integrity.checksums import BLOCKS_KEY, HASH_KEY, check_shard
from hs_dataset.records import Counts
from hs_dataset.integrity.probe import ProbeReport
from hs_dataset.integrity.quality import ProbeOptions, record_probe, recorded_probe_problems, run_checks
from hs_dataset.integrity.scan import ScanReport
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, SHARD_RE, STATE_DIR
from hs_dataset.write.build_key import COMMAND_DIR_FILE

__all__ = ["ProbeOptions", "Problem", "VerifyReport", "check_files", "check_records", "check_listing", "damage_of",
           "data_files", "read_meta",
           "recorded_shards", "repair_command", "verify_build"]

# how a build command names its output: --output and the prefixes argparse takes for it (--o is ambiguous), -o
_OUTPUT_FLAGS = ("--output", "--outpu", "--outp", "--out", "--ou")


@dataclass(frozen=True)
class Problem:
    """One thing wrong: ``path`` (relative to the build, e.g. ``data/train-00003-000.arrow``), what
    is wrong with it, and the part that must be rebuilt (None: nothing to rebuild, e.g. an unlisted file)."""

    path: str
    what: str
    part: int | None = None

    def __str__(self) -> str:
        return f"{self.path} {self.what}" + (f" (part {self.part})" if self.part is not None else "")


@dataclass
class VerifyReport:
    """The outcome of a verification; ``ok`` when ``problems`` is empty."""

    where: str
    quick: bool
    shards: int
    rows: int
    problems: list[Problem] = field(default_factory=list)
    repair: str = ""
    commit: str | None = None  # the commit verified, for a published version
    probe: ProbeReport | None = None  # with --probe
    scan: ScanReport | None = None  # with --stats

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def parts(self) -> list[int]:
        """The parts to rebuild."""
        return sorted({p.part for p in self.problems if p.part is not None})

    def message(self) -> str:
        """One paragraph: every problem, then what to do; then the probe's lines and the recount's."""
        kind = "quick check" if self.quick else "full check"
        if self.ok:
            text = f"{self.where}: {self.shards} shards, {self.rows} rows: all match {META_FILE} ({kind})"
        else:
            lines = "; ".join(str(p) for p in self.problems)
            text = f"{self.where} does not match its {META_FILE} ({kind}): {lines}. {self.repair}"
        if self.scan is not None:
            text += (f"\nstats: every row recounted in {self.scan.seconds:.1f}s: "
                     + ("they match the recorded statistics, no row flagged" if not self.scan.problems else
                        f"{len(self.scan.problems)} problem(s), above"))
        if self.probe is not None:
            text += "\n" + self.probe.message()
        return text

    def raise_if_bad(self) -> None:
        """Raise :class:`IntegrityError` with :meth:`message` unless ``ok``."""
        if not self.ok:
            raise IntegrityError(self.message(), self.problems)


def read_meta(root: Path) -> dict[str, Any]:
    """A finished build's ``hs_dataset.json`` (raises :class:`NotABuildError` when there is none)."""
    path = root / META_FILE
    if not path.is_file():
        raise NotABuildError(f"{root} is not a finished hs_dataset build (no {META_FILE}); run or resume the build "
                             "until it completes")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise NotABuildError(f"{path} is not valid JSON ({e}); run the build command again to rewrite it") from None
    if not isinstance(meta, dict):
        raise NotABuildError(f"{path} must hold a JSON object")
    return meta


def recorded_shards(meta: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The ``shards`` entries of a build's metadata (raises :class:`IntegrityError` when absent)."""
    shards = meta.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "name" in s and "bytes" in s and "rows" in s
                                               for s in shards):
        raise IntegrityError(f"{where}: {META_FILE} records no shard checksums (built by an hs_dataset without "
                             "them): nothing can be verified; rebuild it into a new directory")
    return shards


def _part(name: str) -> int | None:
    m = SHARD_RE.match(name)
    return int(m.group(1)) if m else None


def damage_of(problems: list[Problem]) -> dict[int, str]:
    """``{part: what}`` of the problems that name a part to rebuild (:func:`hs_dataset.integrity.damage.mark_damaged`)."""
    return {p.part: f"{p.path} {p.what}" for p in problems if p.part is not None}


def check_listing(meta: dict[str, Any], present: dict[str, int], where: str) -> tuple[list[Problem], int]:
    """Compare the files found in ``data/`` (``{name: bytes}``) with the recorded shards: missing,
    wrong size, unlisted; and the recorded rows with ``counts.written``. -> (problems, recorded rows)."""
    shards = recorded_shards(meta, where)
    problems: list[Problem] = []
    listed = {s["name"]: s for s in shards}
    for name, s in listed.items():
        if name not in present:
            problems.append(Problem(f"{DATA_DIR}/{name}", "is missing", _part(name)))
        elif present[name] != int(s["bytes"]):
            problems.append(Problem(f"{DATA_DIR}/{name}", f"has {present[name]} bytes, {s['bytes']} recorded",
                                    _part(name)))
    for name in sorted(set(present) - set(listed)):
        problems.append(Problem(f"{DATA_DIR}/{name}", "is not listed in hs_dataset.json (a copy or a leftover: "
                                "readers would load its rows too)"))
    rows = sum(int(s["rows"]) for s in shards)
    counts = meta.get("counts") or {}
    if counts.get("written") is not None and rows != Counts.rows_of(counts):
        problems.append(Problem(META_FILE, f"lists shards of {rows} rows but counts {Counts.rows_of(counts)} written"))
    return problems, rows


def data_files(root: Path) -> dict[str, int]:
    """Every file under ``root/data`` (its path there, subfolders included) with its size."""
    data = root / DATA_DIR
    if not data.is_dir():
        return {}
    return {p.relative_to(data).as_posix(): p.stat().st_size for p in sorted(data.rglob("*")) if not p.is_dir()}


def check_files(root: Path, meta: dict[str, Any], *, quick: bool,
                digests: dict[str, str] | None = None) -> tuple[list[Problem], int]:
    """The files in ``root/data`` against the shards ``meta`` records (``shards``, ``counts.written``):
    the listing (:func:`check_listing`), then each shard's size, rows and content hash (``quick``: first
    and last MiB instead of the hash). ``meta`` may be a shard's part records gathered
    (:mod:`hs_dataset.scale.merge`). -> (problems, recorded rows)."""
    problems, rows = check_listing(meta, data_files(root), str(root))
    named = {p.path for p in problems}
    for s in recorded_shards(meta, str(root)):
        rel = f"{DATA_DIR}/{s['name']}"
        if rel in named:
            continue  # missing or of the wrong size: said already
        if (root / STATE_DIR).is_dir() and (root / rel).is_symlink():  # the rule the build applies (write/output.py)
            problems.append(Problem(rel, "is a symbolic link, not a file of this build (a build refuses it too): "
                                         "replace it by the file it points to", _part(s["name"])))
            continue
        why = check_shard(root / rel, s, quick=quick, digest=(digests or {}).get(rel))
        if why is not None:
            problems.append(Problem(rel, why, _part(s["name"])))
    return problems, rows


_SHARD_KEYS = ("bytes", "rows", HASH_KEY, BLOCKS_KEY)  # what every record of a shard must agree on


def check_records(root: Path, meta: dict[str, Any]) -> list[Problem]:
    """Every other record of the shards against ``hs_dataset.json``'s: the part records and the copy in
    ``.hs_build/`` (a local build), and the card's checksum table. An edit of a shard together with its entry
    in ``hs_dataset.json`` and the card still disagrees with the part record the build wrote (and with the
    entry's block hashes: :func:`~hs_dataset.integrity.checksums.check_shard`); a rewrite of every record
    is beyond these checks (``verify --probe`` compares rows with the model's states)."""
    problems: list[Problem] = []
    listed = {s["name"]: s for s in recorded_shards(meta, str(root))}
    others: list[tuple[str, dict[str, dict[str, Any]]]] = []
    for rec in sorted((root / STATE_DIR / "parts").glob("part-*.json")):
        try:
            files = json.loads(rec.read_text(encoding="utf-8")).get("files") or []
            others.append((f"{STATE_DIR}/parts/{rec.name}", {f["name"]: f for f in files}))
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            problems.append(Problem(f"{STATE_DIR}/parts/{rec.name}", "cannot be read (damaged): rebuild its part",
                                    _part(rec.name.replace("part-", "train-"))))
    if others:
        owned = {name for _, files in others for name in files}
        problems += [Problem(f"{DATA_DIR}/{n}", f"is in {META_FILE} but in no part record ({STATE_DIR}/parts): "
                             f"{META_FILE} was edited", _part(n)) for n in sorted(set(listed) - owned)]
    copy = root / STATE_DIR / META_FILE
    if copy.is_file():
        try:
            others.append((f"{STATE_DIR}/{META_FILE}", {s["name"]: s for s in json.loads(copy.read_text("utf-8"))
                                                        .get("shards") or []}))
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            problems.append(Problem(f"{STATE_DIR}/{META_FILE}", "cannot be read: run the build command again"))
    card = root / README_FILE
    if card.is_file():
        text = card.read_text(encoding="utf-8")
        hashed = {n: {HASH_KEY: h} for n, h in re.findall(r"^\| `([^`]+)` \| [^|]* \| [^|]* \| `([0-9a-f]+)` \|$",
                                                           text, re.M)}
        if hashed:
            others.append((README_FILE, hashed))
    for where, files in others:
        for name, entry in files.items():
            mine = listed.get(name)
            wrong = [k for k in _SHARD_KEYS if mine is not None and k in entry and k in mine and entry[k] != mine[k]]
            if wrong:
                problems.append(Problem(f"{DATA_DIR}/{name}", f"its {', '.join(wrong)} in {META_FILE} differ from "
                                        f"{where}'s (one of the records was edited)", _part(name)))
    return problems


def repair_command(command: str, root: Path) -> str:
    """The recorded build ``command`` made to repair ``root``, the directory verified (a copy of a build
    keeps the command of the original): its ``--output``/``-o`` value (an import's OUT) replaced by
    ``root``, or ``--output ROOT`` appended when it names none."""
    here = str(root)
    try:
        words = shlex.split(command)
    except ValueError:  # not shell words: the last --output given wins
        return f"{command} --output {shlex.quote(here)}"
    if words[1:2] == ["import"] and len(words) >= 6 and words[3] == "--from":
        words[5] = here  # hs-dataset import SRC --from FORMAT OUT ... (as cli.interop records it)
        return shlex.join(words)
    found = False
    for i, word in enumerate(words):
        flag, eq, _ = word.partition("=")
        if eq and flag in _OUTPUT_FLAGS:
            words[i], found = f"{flag}={here}", True
        elif word in (*_OUTPUT_FLAGS, "-o") and i + 1 < len(words):
            words[i + 1], found = here, True
        elif word.startswith("-o") and len(word) > 2 and words[i - 1] not in (*_OUTPUT_FLAGS, "-o"):
            words[i], found = f"-o{here}", True  # -oDIR
    return shlex.join(words if found else [*words, "--output", here])


def _from_build_dir(command: str, root: Path) -> str:
    """:func:`repair_command`, run from the folder the build ran in (its relative paths), wherever verify runs."""
    try:
        cwd = json.loads((root / STATE_DIR / COMMAND_DIR_FILE).read_text(encoding="utf-8"))["cwd"]
    except (OSError, ValueError, KeyError, TypeError):
        return repair_command(command, root)
    fixed = repair_command(command, root.resolve())
    return fixed if cwd == os.getcwd() else f"cd {shlex.quote(str(cwd))} && {fixed}"


def verify_build(path: str | os.PathLike, *, quick: bool = False, digests: dict[str, str] | None = None,
                 mark: bool = True, probe: ProbeOptions | None = None, stats: bool = False) -> VerifyReport:
    """Verify a finished build directory against its ``hs_dataset.json``.

    Args:
        path: the build directory (or a downloaded version).
        quick: size + first/last MiB + rows per shard instead of the full content hash.
        digests: ``{"data/<name>": xxh3-128}`` already computed by the caller (push), not recomputed.
        mark: on a full check of a local build, record the damaged parts in ``.hs_build/damaged.json``
            so that the next build rebuilds them, and record a probe's result in its ``hs_dataset.json``.
        probe: re-run ``probe.rows`` random rows through the reference backend (once the shards pass).
        stats: recount the statistics from every row (once the shards pass).

    Raises:
        NotABuildError: no (readable) ``hs_dataset.json``.
        IntegrityError: it records no shard checksums.
        MissingPathError: a probe without the model's weights here.
    """
    root = Path(path)
    meta = read_meta(root)
    problems, rows = check_files(root, meta, quick=quick, digests=digests)
    local = (root / STATE_DIR / "parts").is_dir()
    probe = probe or ProbeOptions()
    probed = scan = None
    if not problems and (probe.rows or stats):
        probed, scan, found = run_checks(root, meta, str(root), lambda s: root / DATA_DIR / s["name"], probe=probe,
                                         stats=stats)
        problems += [Problem(*f) for f in found]
        if probed is not None and local and mark:
            record_probe(root, probed)
            meta = read_meta(root)
    if not probe.rows:
        problems += [Problem(*f) for f in recorded_probe_problems(meta)]
    problems += [Problem(name, what) for name, what in check_metadata(root, meta)]
    problems += [p for p in check_records(root, meta) if str(p) not in {str(q) for q in problems}]
    shards = recorded_shards(meta, str(root))
    report = VerifyReport(str(root), quick, len(shards), rows, problems, probe=probed, scan=scan)
    command = meta.get("build_command")
    again = f"the build command again (`{command}`)" if command else "the same build again (the same configuration)"
    if local:
        here = f"the build command again (`{_from_build_dir(str(command), root)}`)" if command else again
        # a finished build's data/ holds only listed shards: anything else is not provably the build's to delete
        foreign = [str(root / p.path) for p in problems if p.part is None and p.path.startswith(DATA_DIR + "/")
                   and (root / p.path).exists()]
        move = f" Move {', '.join(foreign)} out of {root / DATA_DIR} first (a build deletes only files it can prove " \
               "it wrote)." if foreign else ""
        report.repair = (f"Repair: run {here} on {root}: it rebuilds part(s) {report.parts} (then verify again)."
                         if report.parts else
                         f"Repair: run {here} on {root}: it rewrites the card, {META_FILE} and rejects.jsonl from the "
                         "part records.") + move
        if mark and (not quick or probed is not None or scan is not None):
            mark_damaged(root, damage_of(problems))
    else:
        report.repair = (f"This copy has no build state ({STATE_DIR}/): download it again; if the published files "
                         f"are damaged, rebuild part(s) {report.parts} where it was built ({again}) and push "
                         "again with --force.")
    return report

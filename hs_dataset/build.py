"""The shard-writer stage: runs the builder part by part into a resumable, loadable directory.

Output layout::

    OUT/README.md               YAML `configs:` + `dataset_info:` (plain load_dataset(OUT) works), card
    OUT/hs_dataset.json         model, layers + convention, storage dtype, counts, versions, command
    OUT/rejects.jsonl           one line per rejected sample: id, field, reason, stage
    OUT/data/train-PPPPP-SSS.arrow   whole shards only (P = part, S = shard within the part)
    OUT/.hs_build/              resume state (never published)

A *part* is a fixed range of ``part_size`` source rows. Each part is built by
``HiddenStatesBuilder.download_and_prepare`` into a staging folder; its finished shards are then
moved into ``data/`` and only after that is the part's record written (atomically). A build
killed at any moment and run again deletes the shards of unrecorded parts, redoes only those
parts, and ends with the same rows as an uninterrupted build.
"""

from __future__ import annotations

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
import yaml

from . import __version__
from .backends import LAYER_CONVENTION, CaptureBackend, check_layers, make_backend, read_model_info
from .builder import HiddenStatesBuilder, HiddenStatesConfig
from .encode import make_features, state_columns
from .records import Counts
from .sources import count_rows, source_fingerprint

STATE_DIR = ".hs_build"
META_FILE = "hs_dataset.json"
REJECTS_FILE = "rejects.jsonl"
FORMAT_VERSION = 1


class ConfigMismatchError(RuntimeError):
    """The output directory holds a build made with a different configuration."""


@dataclass
class BuildSummary:
    output_dir: str
    counts: Counts
    parts_built: int
    parts_skipped: int
    bytes_written: int
    seconds: float


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that readers see the old or the new content, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _part_record(state: Path, i: int) -> Path:
    return state / "parts" / f"part-{i:05d}.json"


def _part_files(out: Path, i: int, ext: str) -> list[Path]:
    return sorted((out / "data").glob(f"train-{i:05d}-*.{ext}"))


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

    def skip(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def build(config: HiddenStatesConfig, output_dir: str | os.PathLike, *, backend: CaptureBackend | None = None,
          progress: bool = True, build_command: str | None = None) -> BuildSummary:
    """Build (or resume building) the dataset of ``config`` into ``output_dir``."""
    t0 = time.time()
    out = Path(output_dir)
    state = out / STATE_DIR
    (state / "parts").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
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
    # Parts recorded by an earlier, smaller build whose range changed, or beyond the end, are redone / dropped.
    for rec in sorted((state / "parts").glob("part-*.json")):
        r = json.loads(rec.read_text())
        if r["part"] >= len(parts) or (r["start"], r["stop"]) != parts[r["part"]][1:]:
            for f in _part_files(out, r["part"], ext):
                f.unlink()
            rec.unlink()

    done = {i for i, _, _ in parts if _part_record(state, i).exists()}
    bar = _Progress(n, sum(p[2] - p[1] for p in parts if p[0] in done), progress)
    own_backend = False
    built = 0
    datasets.disable_progress_bars()
    try:
        for i, start, stop in parts:
            if i in done:
                continue
            if backend is None:
                backend = make_backend(config.backend, config.model, layers, revision=config.model_revision,
                                       options=config.backend_options)
                own_backend = True
            _build_part(config, out, state, i, start, stop, backend, bar)
            built += 1
    finally:
        bar.close()
        if own_backend and backend is not None:
            backend.close()
    counts = _finalize(config, out, state, parts, info, layers, backend, build_command)
    nbytes = sum(f.stat().st_size for f in (out / "data").glob(f"*.{ext}"))
    return BuildSummary(str(out), counts, built, len(done), nbytes, time.time() - t0)


def _build_part(config: HiddenStatesConfig, out: Path, state: Path, i: int, start: int, stop: int,
                backend: CaptureBackend, bar: _Progress) -> None:
    ext = config.file_format
    for f in _part_files(out, i, ext):  # whole shards of a part that was not recorded: redo it
        f.unlink()
    staging = state / "staging" / f"part-{i:05d}"
    shutil.rmtree(staging, ignore_errors=True)
    part_cfg = dataclasses.replace(config, part=(start, stop), name="default")
    builder = HiddenStatesBuilder(config=part_cfg, backend=backend, on_row=bar.row,
                                  cache_dir=str(state / "cache"))
    builder.download_and_prepare(str(staging), file_format=ext, max_shard_size=config.max_shard_bytes,
                                 download_mode=datasets.DownloadMode.FORCE_REDOWNLOAD)
    shards = sorted(glob.glob(str(staging / f"*-train*.{ext}")))
    files = []
    for k, src in enumerate(shards):
        dst = out / "data" / f"train-{i:05d}-{k:03d}.{ext}"
        os.replace(src, dst)
        files.append({"name": dst.name, "bytes": dst.stat().st_size})
    _fsync_dir(out / "data")
    counts = builder.counts
    if counts.samples_in != stop - start:
        raise RuntimeError(f"part {i}: read {counts.samples_in} source rows, expected {stop - start}")
    record = {"part": i, "start": start, "stop": stop, "files": files, "counts": dataclasses.asdict(counts),
              "rejects": [r.to_dict() for r in builder.rejects]}
    atomic_write(_part_record(state, i), json.dumps(record))
    shutil.rmtree(staging, ignore_errors=True)


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
    for i, _, _ in parts:
        r = json.loads(_part_record(state, i).read_text())
        counts.add(Counts(**r["counts"]))
        rejects.extend(r["rejects"])
        files.extend(r["files"])
    counts.check()
    atomic_write(out / REJECTS_FILE, "".join(json.dumps(r) + "\n" for r in rejects))
    tok_path = config.tokenizer or config.model
    meta_path = out / META_FILE
    previous = json.loads(meta_path.read_text()) if meta_path.exists() else {}
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
                    "options": {k: v for k, v in config.backend_options.items() if "token" not in k.lower()},
                    "versions": _versions(backend) if backend is not None else previous.get("backend", {}).get("versions", {})},
        "build_command": build_command or previous.get("build_command"),
        "config": config.to_dict(),
    }
    atomic_write(meta_path, json.dumps(meta, indent=1))
    atomic_write(out / "README.md", render_readme(meta, make_features(layers, info.hidden_size, config.storage_dtype),
                                                  counts.written, nbytes, config.file_format))
    return counts


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

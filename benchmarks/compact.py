#!/usr/bin/env python3
"""Compact versions at Kimi width through SGLang (issue 26; run on a GPU).

One engine (the Kimi-width stand-in of ``.gpu/make_kimi_width.py``: hidden 7168, layers 1, 3, 4 + final =
57,344 bytes of states per token), ``--samples`` samples of 2,048 tokens (loss mask on every reply token
of the source's conversations, tokenized before the builds, which read ids and masks: a build of >= 1,024
rows tokenizes in worker processes, one this short would tokenize on its own thread). Rows of the table,
each built with ``build()`` (the code of ``hs-dataset build``) into /dev/shm and onto the disk:

  bf16                     the exact bf16 states (Arrow shards)
  fp8                      fp8 e4m3 + per-token scales, quantized on the GPU
  fp8 + teacher            fp8, the teacher's top-64 at masked positions, no hidden_final
  fp8 + teacher + coding   the same with compression=zstd (Arrow shards, zstd buffers)
  (--parquet) the same as Parquet shards with byte planes + zstd (slow: hs_dataset.codec.coding)

with: capture + transport alone (states into the ring and handed out, nothing written; bf16, fp8, fp8 + teacher),
bytes per token on disk, build tok/s vs the engine's plain prefill of the same ids (request ids
not ours, measured before) and vs the disk's write rate over the row's bytes per token, and the reader's
decoded GB/s over the /dev/shm build (``iter_torch`` over ``open_dataset``, or over ``load_dataset(dir,
streaming=True)`` for Parquet). Random weights give near-Gaussian states: the coding ratio is reported as
measured on the stand-in. Each build also gives its head and tail, in seconds (``build_<where>_head_tail_s``):
from its start to the first row the capture handed out, and from the last to its end (the last shards written
or coded, the commits, the finalize), which a build of a few seconds feels most.

    python benchmarks/compact.py --json $OUT/compact.json     (or from benchmarks/long_context.py --compact)
    python benchmarks/compact.py --shm-only --builds 3 --json $OUT/compact.json   (each /dev/shm build best of 3)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
ROWS = [  # name, config fields
    ("bf16", {}),
    ("fp8", {"storage_dtype": "fp8_e4m3"}),
    ("fp8 + teacher", {"storage_dtype": "fp8_e4m3", "teacher": "topk:64", "store_final": False}),
    ("fp8 + teacher + coding", {"storage_dtype": "fp8_e4m3", "teacher": "topk:64", "store_final": False,
                                "compression": "zstd"}),
]
PARQUET_ROW = ("fp8 + teacher + parquet", {"storage_dtype": "fp8_e4m3", "teacher": "topk:64", "store_final": False,
                                           "file_format": "parquet"})


class Timed:
    """The backend, noting when its capture handed out its first and its last item: a build's head (before the first
    row) and tail (after the last: the last shards written or coded, the commits, the finalize) are then told apart
    from the capture in between."""

    def __init__(self, backend):
        self._backend = backend
        self.first: float | None = None
        self.last: float | None = None

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def capture(self, samples, **kw):
        self.first = self.last = None
        for item in self._backend.capture(samples, **kw):
            self.last = time.time()
            if self.first is None:
                self.first = self.last
            yield item


def read_rate(out: Path, coded: bool) -> float:
    """Decoded state bytes per second over every row of a build."""
    import datasets
    import torch

    from hs_dataset.read.iterate import iter_torch
    from hs_dataset.read.open import open_dataset

    ds = datasets.load_dataset(str(out), split="train", streaming=True) if coded else open_dataset(out)
    t, n = time.time(), 0
    for row in iter_torch(ds):
        n += sum(v.numel() * v.element_size() for k, v in row.items()
                 if isinstance(v, torch.Tensor) and k.startswith(("hidden_", "teacher_")))
    return n / (time.time() - t)


def run(be, model: Path, work: Path, samples: int, res: dict, dump, *, disk_rate: float | None = None,
        deadline: float | None = None, parquet: bool = False, profile: bool = False, builds: int = 1,
        shm_only: bool = False) -> None:
    """The table (see the module docstring) on a started SGLangBackend ``be``, into ``res["compact"]``: each row's
    /dev/shm build ``builds`` times (the best counts, every run listed); unless ``shm_only``, its reader's rate and
    its build onto the disk."""
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.prepare.samples import tokenized_samples
    from hs_dataset.write.driver import build
    from hs_dataset.write.resolve import resolve_build

    layers = tuple(be.layers)
    work.mkdir(parents=True, exist_ok=True)
    from kimi_width import source
    from stacks import StackSampler

    conversations = source(work / "src-2k.jsonl", samples, 2048, seed=7)
    r = resolve_build(HiddenStatesConfig(model=str(model), layers=layers, source=str(conversations), max_length=2048))
    tokenized = [s for _, s in tokenized_samples(r.source, r.config, r.tokenizer, r.vocab_size, [(0, samples)], lambda *_: None)]
    ids = [s.input_ids.tolist() for s in tokenized]
    tokens = sum(len(x) for x in ids)
    # The builds read the conversations tokenized already (ids + loss masks): a build of >= 1,024 rows tokenizes in
    # worker processes (tokenize_workers), a build this short would on its own thread, which no real build does.
    src = work / "src-2k-tokens.jsonl"
    with open(src, "w") as f:
        for s in tokenized:
            f.write(json.dumps({"id": s.sample_id, "input_ids": s.input_ids.tolist(),
                                "loss_mask": s.loss_mask.tolist()}) + "\n")
    base = dict(model=str(model), layers=layers, source=str(src), max_length=2048, part_size=16, backend="sglang")

    def plain() -> float:
        t = time.time()
        for f in [be._submit(f"plain-{time.time_ns()}-{i}", x) for i, x in enumerate(ids)]:
            f.result()
        return tokens / (time.time() - t)

    def capture(encoding: str, teacher_k: int) -> float:
        """Capture + transport alone: every sample's states in the ring, handed out, nothing written."""
        t = time.time()
        for _ in be.capture(tokenized, encoding=encoding, teacher_k=teacher_k):
            pass
        return tokens / (time.time() - t)

    out = res.setdefault("compact", {"samples": samples, "tokens": tokens})
    kinds = {"plain": None, "bf16": ("bfloat16", 0), "fp8": ("fp8_e4m3", 0), "fp8 + teacher": ("fp8_e4m3", 64)}
    for what in kinds.values():  # warm-up: the engine's kernels for each kind of pass
        plain() if what is None else capture(*what)
    runs: dict[str, list[float]] = {name: [] for name in kinds}
    order = list(kinds)
    for rep in range(3):  # interleaved, each first in turn: the engine's speed drifts between runs
        for name in order[rep:] + order[:rep]:
            what = kinds[name]
            runs[name].append(plain() if what is None else capture(*what))
    out["plain_tok_s"] = round(max(runs["plain"]))
    out["plain_runs_tok_s"] = [round(x) for x in runs["plain"]]
    for name in order[1:]:
        out.setdefault("capture", {})[name] = {"tok_s": round(max(runs[name])),
                                               "vs_plain": round(max(runs[name]) / out["plain_tok_s"], 3),
                                               "runs_tok_s": [round(x) for x in runs[name]]}
    dump()
    shm = Path("/dev/shm/hs-compact")
    for name, fields in ROWS + ([PARQUET_ROW] if parquet else []):
        row = out.setdefault("rows", {}).setdefault(name, {})
        for where, root in (("shm", shm), ("disk", work / "compact"))[:1 if shm_only else 2]:
            if deadline is not None and time.time() > deadline:
                row.setdefault("skipped", []).append(where)
                continue
            dst = root / name.replace(" ", "_").replace("+", "p")
            rates = []
            for _ in range(builds if where == "shm" else 1):
                shutil.rmtree(dst, ignore_errors=True)
                timed = Timed(be)
                t = time.time()
                sampler = StackSampler() if profile else None
                try:
                    with sampler or contextlib.nullcontext():
                        s = build(HiddenStatesConfig(**base, **fields), dst, backend=timed, progress=False)
                except Exception as e:  # recorded, and the next row runs
                    row[f"error_{where}"] = f"{type(e).__name__}: {e}"[:500]
                    break
                end = time.time()
                rates.append(s.counts.tokens_written / (end - t))
                if timed.first is not None and timed.last is not None:  # seconds: before the first row, after the last
                    row.setdefault(f"build_{where}_head_tail_s", []).append(
                        [round(timed.first - t, 3), round(end - timed.last, 3)])
                if sampler is not None:
                    row[f"stacks_{where}"] = sampler.report()
            if not rates:
                dump()
                continue
            if len(rates) > 1:
                row[f"build_{where}_runs_tok_s"] = [round(x) for x in rates]
            row[f"build_{where}_tok_s"] = round(max(rates))
            row[f"build_{where}/plain"] = round(row[f"build_{where}_tok_s"] / out["plain_tok_s"], 3)
            bpt = s.bytes_written / s.counts.tokens_written
            row["bytes_per_token"] = round(bpt, 1)
            row["vs_bf16_bytes"] = round(bpt / out["rows"]["bf16"]["bytes_per_token"], 3)
            if where == "disk" and disk_rate:
                row["build_disk/disk_allows"] = round(row["build_disk_tok_s"] / (disk_rate / bpt), 3)
            if where == "shm" and not shm_only:
                row["read_decoded_GBps"] = round(read_rate(dst, "file_format" in fields or "compression" in fields) / 1e9, 2)
            shutil.rmtree(dst, ignore_errors=True)
            dump()
    shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/kimi-width-lc")
    ap.add_argument("--work", default="/tmp/hs-compact")
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--json", default=None)
    ap.add_argument("--parquet", action="store_true", help="also the Parquet row (slow: hs_dataset.codec.coding)")
    ap.add_argument("--profile", action="store_true", help="sample the builder's thread stacks during each build")
    ap.add_argument("--builds", type=int, default=1, help="each row's /dev/shm build this many times (the best counts)")
    ap.add_argument("--shm-only", action="store_true", help="only the builds into /dev/shm (no reads, no disk builds)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kimi_width import ENGINE_ARGS, LAYERS
    from sglang_extraction import disk_write_rate

    from hs_dataset.capture.sglang.backend import SGLangBackend

    res: dict = {}

    def dump() -> None:
        print(json.dumps(res), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))

    work = Path(a.work)
    model = Path(a.model)
    if not (model / "config.json").exists():  # the stand-in
        import subprocess

        subprocess.run([sys.executable, str(ROOT / ".gpu" / "make_kimi_width.py"), str(model), "--long-context"],
                       check=True)
    if not (model / "tokenizer_config.json").exists():  # the tiny tokenizer the builder tokenizes with
        from hs_dataset.demo.tiny import make_tiny_tokenizer

        make_tiny_tokenizer(model, template="chatml")
    res["disk_write_MBps"] = round(disk_write_rate(work / "probe") / 1e6)
    be = SGLangBackend(a.model, LAYERS, max_inflight=64,
                       engine_args={k: v for k, v in ENGINE_ARGS.items() if k != "context_length"})
    try:
        run(be, Path(a.model), work, a.samples, res, dump, disk_rate=res["disk_write_MBps"] * 1e6, parquet=a.parquet,
            profile=a.profile, builds=a.builds, shm_only=a.shm_only)
    finally:
        be.close()


if __name__ == "__main__":
    main()

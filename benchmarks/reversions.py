#!/usr/bin/env python
"""Cheap re-versions (issue 26, item 3): what a new version of a build shares with the old one on the Hub.

    python benchmarks/reversions.py                 # 300 samples, parts of 64, 1 MiB shards: every layout
    python benchmarks/reversions.py --quick         # 120 samples, Arrow bf16 only (the smoke test)
    python benchmarks/reversions.py --recapture     # every build runs the model on every sample (slow)
    python benchmarks/reversions.py --shape llama8b --formats arrow --batches default --json $OUT/reversions.json
                                                    # on a GPU: SGLang at a real width, every build captured

The Hub stores files in Xet, in content-defined chunks of ~64 KiB, and uploads only the chunks it does
not hold (``benchmarks/xet_chunks.py``). Three versions of one source are built with the real builder
on the tiny random Llama (hidden 64, layers 0, 1, 2 + the final state, CPU):

* v1: ``--samples`` conversations;
* v2: the same source, 1% of the samples' replies edited (a sentence appended: the sample grows);
* v3: v1's source with 10% more conversations appended.

Each version is built into a fresh directory, and the published files (``data/`` shards, ``README.md``,
``hs_dataset.json``, ``rejects.jsonl``) of v2 and v3 are cut into chunks and compared with v1's: the
fraction of their bytes and of their chunks v1 holds, and the bytes an upload would send. The same
files go through the real Xet client too (``hf_xet``, into a local CAS folder, no network): its own
count of deduplicated bytes, beside ours (``--no-xet`` leaves it out).

For each layout: ``file_format`` arrow | parquet | zstd (Arrow shards with ``compression=zstd``),
``storage_dtype`` bfloat16 | fp8_e4m3, and record batches (Parquet row groups) of one row
(``writer_batch_bytes=1``: what the default budget of 64 MiB
gives rows of 2048 tokens at Kimi width, ~117 MB each, or at an 8B Llama's, 67 MB), of 4 rows (what it
gives a hidden-896 model's 2048-token rows, 14.7 MB each), or the default (at hidden 64, rows of 256
tokens: a whole part is one record batch).

The model's states are captured once per distinct token sequence and replayed to later builds
(:class:`ReplayBackend`): on the CPU a sample's states do not depend on its batch (``--recapture``
builds every version with the model and reports which rows of v2 differ from v1's). ``--shape llama8b``
(or ``kimi``) runs the same on a GPU through SGLang at a real width (random weights, made by
``benchmarks/sglang_extraction.py``), every build captured: whether an unchanged sample, batched
with other samples than in v1, gets the same bits again decides what a rebuilt version shares there.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from hs_dataset.capture.transformers import TransformersBackend  # noqa: E402
from hs_dataset.codec.encode import bytes_per_token  # noqa: E402
from hs_dataset.config import HiddenStatesConfig  # noqa: E402
from hs_dataset.demo.tiny import make_tiny_model_dir, tiny_corpus_path  # noqa: E402
from xet_chunks import SharedFraction, chunk_file, shared_fraction  # noqa: E402
from hs_dataset.layout import DATA_DIR, STATE_DIR  # noqa: E402
from hs_dataset.records import CaptureResult, Reject, TokenizedSample  # noqa: E402
from hs_dataset.write.driver import build  # noqa: E402

LAYERS = (0, 1, 2)
TARGET = 0.95  # of a 1%-changed version's chunks, held by the previous version
SOURCE_NAME = "chats.jsonl"  # the same file name in every version: the same sample ids


# ---------------------------------------------------------------------------------------------
# The three sources
# ---------------------------------------------------------------------------------------------


@dataclass
class Sources:
    """The three versions' source files, and which rows v2 changed."""

    v1: Path
    v2: Path
    v3: Path
    changed: list[int]


def _conversation(i: int, lines: list[str], rng: random.Random) -> dict[str, Any]:
    reply = " ".join(rng.sample(lines, 2))
    return {"conversations": [{"from": "human", "value": f"{i}. {rng.choice(lines)}"}, {"from": "gpt", "value": reply}]}


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make_sources(work: Path, samples: int, *, changed: float = 0.01, appended: float = 0.10, seed: int = 0) -> Sources:
    """v1: ``samples`` conversations made of the tiny corpus's lines; v2: ``changed`` of them with a sentence
    appended to the reply; v3: v1 plus ``appended`` more conversations at the end."""
    lines = [line for line in tiny_corpus_path().read_text(encoding="utf-8").splitlines() if line.strip()]
    rng = random.Random(seed)
    extra = max(1, round(samples * appended))
    rows = [_conversation(i, lines, rng) for i in range(samples + extra)]
    v1 = rows[:samples]
    edits = random.Random(seed + 1)
    picked = sorted(edits.sample(range(samples), max(1, round(samples * changed))))
    v2 = json.loads(json.dumps(v1))
    for i in picked:
        v2[i]["conversations"][1]["value"] += " " + edits.choice(lines)
    return Sources(_write(work / "src-v1" / SOURCE_NAME, v1), _write(work / "src-v2" / SOURCE_NAME, v2),
                   _write(work / "src-v3" / SOURCE_NAME, rows), picked)


# ---------------------------------------------------------------------------------------------
# Capture once, replay to every later build
# ---------------------------------------------------------------------------------------------


class ReplayBackend:
    """The transformers backend on the tiny model, each distinct token sequence captured once.

    A capture backend (:class:`hs_dataset.capture.base.CaptureBackend`): a sample seen before gets the
    states the model gave it then; the others go to the model, in one call per part, in order. Valid
    where a sample's states do not depend on its batch (the CPU backend: ``--recapture`` checks it).
    """

    name = "transformers"
    continuous = False
    encodings = ("bfloat16",)

    def __init__(self, model: str, layers: tuple[int, ...]):
        self.inner = TransformersBackend(model, layers, device="cpu", batch_tokens=2048)
        self.info = self.inner.info
        self.layers = self.inner.layers
        self.seen: dict[bytes, CaptureResult | Reject] = {}
        self.captured = 0

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CaptureResult | Reject]:
        todo = list(samples)
        new = [s for s in todo if s.input_ids.tobytes() not in self.seen]
        for s, item in zip(new, self.inner.capture(new)):
            self.seen[s.input_ids.tobytes()] = item
            self.captured += 1
        for s in todo:
            item = self.seen[s.input_ids.tobytes()]
            if isinstance(item, Reject):
                yield Reject(s.sample_id, item.field, item.reason, item.stage)
            else:
                yield CaptureResult(s, self.layers, item.states)

    def versions(self) -> dict[str, str]:
        return self.inner.versions()

    def close(self) -> None:
        pass  # closed by the benchmark, after every build


# ---------------------------------------------------------------------------------------------
# Layouts, builds, measures
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    file_format: str
    storage_dtype: str
    batch: str  # "row": one row per record batch / row group; "<n>": n rows; "default": the default byte budget

    @property
    def name(self) -> str:
        return f"{self.file_format}-{'bf16' if self.storage_dtype == 'bfloat16' else 'fp8'}-{self.batch}"

    def fields(self, args: argparse.Namespace, hidden: int) -> dict[str, Any]:
        """The config fields of this layout (``writer_batch_bytes`` for n rows of ``max_length`` tokens)."""
        # "zstd": Arrow shards with zstd buffers (compression=zstd)
        kw: dict[str, Any] = dict(file_format="arrow", compression="zstd") if self.file_format == "zstd" else \
            dict(file_format=self.file_format)
        kw["storage_dtype"] = self.storage_dtype
        if self.batch == "row":
            kw["writer_batch_bytes"] = 1
        elif self.batch != "default":
            row = args.max_length * bytes_per_token(len(args.layers) + 1, hidden, self.storage_dtype)  # as the builder sizes
            kw["writer_batch_bytes"] = int(self.batch) * row
        return kw


def published(out: Path) -> list[Path]:
    """The files a push uploads (everything but the build's own state)."""
    return sorted(p for p in out.rglob("*") if p.is_file() and STATE_DIR not in p.relative_to(out).parts)


def build_version(model: str, source: Path, out: Path, layout: Layout, args: argparse.Namespace, backend: Any) -> Path:
    """A fresh build of ``source`` in ``out``, on the started ``backend``."""
    shutil.rmtree(out, ignore_errors=True)
    config = HiddenStatesConfig(model=model, layers=args.layers, source=str(source), max_length=args.max_length,
                                part_size=args.part_size, max_shard_bytes=args.max_shard_bytes, backend=args.backend,
                                backend_options=args.backend_options,
                                **layout.fields(args, backend.info.hidden_size))
    build(config, out, backend=backend, progress=False)
    return out


def xet_dedup(old: list[Path], new: list[Path], cas: Path) -> dict[str, int] | None:
    """The real Xet client's deduplication of ``new`` after ``old`` was uploaded, into a local CAS folder
    (no network). None when ``hf_xet`` is not installed."""
    try:
        import hf_xet  # optional: the Hub's Xet client, a dependency of huggingface_hub on most platforms
    except ImportError:
        return None
    shutil.rmtree(cas, ignore_errors=True)
    session = hf_xet.XetSession()
    metrics: dict[str, int] = {}
    for files in (old, new):
        commit = session.new_upload_commit(endpoint=f"local://{cas}")
        for f in files:
            commit.start_upload_file(str(f))
        m = commit.wait_to_finish().dedup_metrics
        metrics = {k: int(getattr(m, k)) for k in ("total_bytes", "deduped_bytes", "new_bytes", "total_chunks",
                                                   "deduped_chunks", "new_chunks", "defrag_prevented_dedup_bytes")}
    shutil.rmtree(cas, ignore_errors=True)
    return metrics


def compare(v1: Path, vn: Path, work: Path, use_xet: bool) -> dict[str, Any]:
    """What ``vn``'s published files share with ``v1``'s: the shards, the metadata, all; and Xet's own count."""
    old, new = published(v1), published(vn)
    cut = {p: chunk_file(p) for p in old + new}

    def share(keep: Any) -> SharedFraction:
        return shared_fraction([cut[p] for p in old if keep(p.relative_to(v1))],
                               [cut[p] for p in new if keep(p.relative_to(vn))])

    r: dict[str, Any] = {"data": share(lambda p: p.parts[0] == DATA_DIR).to_dict(),
                         "metadata": share(lambda p: p.parts[0] != DATA_DIR).to_dict(),
                         "all": share(lambda p: True).to_dict()}
    if use_xet:
        x = xet_dedup(old, new, work / "xet-cas")
        if x is not None:
            r["xet"] = dict(x, by_bytes=round(x["deduped_bytes"] / max(x["total_bytes"], 1), 6),
                            by_chunks=round(x["deduped_chunks"] / max(x["total_chunks"], 1), 6))
    return r


def differing_rows(a: Path, b: Path) -> list[str]:
    """Ids of the rows whose values differ between two builds of the same ids (stored bytes compared)."""
    import pyarrow as pa  # deferred: only --recapture reads the rows back

    def rows(out: Path) -> dict[str, list[Any]]:
        got: dict[str, list[Any]] = {}
        for f in sorted((out / DATA_DIR).glob("*.arrow")):
            with pa.memory_map(str(f)) as m:
                t = pa.ipc.open_stream(m).read_all()
            for i, sid in enumerate(t.column("id").to_pylist()):
                got[sid] = [t.column(c)[i] for c in t.column_names if c != "id"]
        return got

    ra, rb = rows(a), rows(b)
    return sorted(k for k in ra if k in rb and any(not x.equals(y) for x, y in zip(ra[k], rb[k])))


def start_backend(args: argparse.Namespace, model: str) -> Any:
    """The tiny model's states replayed (the default), or a real backend started once for every build."""
    if args.backend == "transformers" and not args.recapture:
        return ReplayBackend(model, args.layers)
    from hs_dataset.capture.backends import make_backend  # deferred: only --recapture and the GPU shapes

    return make_backend(args.backend, model, args.layers, options=args.backend_options)


def make_model(args: argparse.Namespace, work: Path) -> str:
    """The tiny random Llama (CPU), or a random-weight model at a real width (``--shape``, made on the GPU)."""
    if args.shape == "tiny":
        return str(make_tiny_model_dir(work / "tiny-model", template="chatml", seed=0))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sglang_extraction as gpu  # deferred: the GPU shapes' makers (CUDA)

    path = Path(args.model or gpu.SHAPES[args.shape]["model"])
    return str(gpu.make_8b_llama(path) if args.shape == "llama8b" else gpu.make_kimi_width(path))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = make_model(args, work)
    sources = make_sources(work, args.samples)
    layouts = [Layout(f, d, b) for f in args.formats for d in args.dtypes for b in args.batches]
    backend = start_backend(args, model)
    results: dict[str, Any] = {}
    try:
        for layout in layouts:
            t0 = time.time()
            outs = {v: build_version(model, getattr(sources, v), work / f"{layout.name}-{v}", layout, args, backend)
                    for v in ("v1", "v2", "v3")}
            data_bytes = {v: sum(p.stat().st_size for p in (o / DATA_DIR).iterdir()) for v, o in outs.items()}
            r: dict[str, Any] = {
                "shards": {v: len(list((o / DATA_DIR).iterdir())) for v, o in outs.items()},
                "data_bytes": data_bytes,
                "v2": compare(outs["v1"], outs["v2"], work, args.xet),
                "v3": compare(outs["v1"], outs["v3"], work, args.xet)}
            # v3 holds v1's rows and 10% more: at best it shares v1's bytes, and uploads what it grew by
            r["v3"]["data"]["best_by_bytes"] = round(data_bytes["v1"] / data_bytes["v3"], 6)
            r["v3"]["data"]["upload_over_growth"] = round(r["v3"]["data"]["upload_bytes"] /
                                                          max(data_bytes["v3"] - data_bytes["v1"], 1), 3)
            if not isinstance(backend, ReplayBackend) and layout.file_format == "arrow":
                r["v2_rows_differing"] = differing_rows(outs["v1"], outs["v2"])
            r["seconds"] = round(time.time() - t0, 1)
            results[layout.name] = r
            print(_line(layout.name, r), flush=True)
            if not args.keep:
                for o in outs.values():
                    shutil.rmtree(o, ignore_errors=True)
    finally:
        (backend.inner if isinstance(backend, ReplayBackend) else backend).close()
    setup = dict(shape=args.shape, backend=args.backend, samples=args.samples, changed_rows=sources.changed,
                 appended=len(sources.v3.read_text(encoding="utf-8").splitlines()) - args.samples,
                 part_size=args.part_size, max_shard_bytes=args.max_shard_bytes, max_length=args.max_length,
                 layers=list(args.layers), replayed=isinstance(backend, ReplayBackend),
                 captured_sequences=getattr(backend, "captured", None))
    return {"setup": setup, "target": TARGET, "results": results}


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _line(name: str, r: dict[str, Any]) -> str:
    parts = [f"{name:22s}"]
    for v in ("v2", "v3"):
        d, a = r[v]["data"], r[v]["all"]
        x = r[v].get("xet")
        parts.append(f"{v}: data {_pct(d['by_bytes'])} bytes {_pct(d['by_chunks'])} chunks, all {_pct(a['by_chunks'])}"
                     f" chunks, upload {a['upload_bytes'] / 2**20:5.2f} MiB"
                     + (f", xet {_pct(x['by_bytes'])}" if x else ""))
    return " | ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--part-size", type=int, default=64)
    ap.add_argument("--max-shard-bytes", type=int, default=2**20)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--formats", default="arrow,zstd,parquet")
    ap.add_argument("--dtypes", default="bfloat16,fp8_e4m3")
    ap.add_argument("--batches", default="row,4,default",
                    help="row: one row per record batch (writer_batch_bytes=1); <n>: n rows; default: the default budget")
    ap.add_argument("--quick", action="store_true", help="120 samples, parts of 32, arrow bf16 row batches only")
    ap.add_argument("--recapture", action="store_true", help="run the model for every build (no replay)")
    ap.add_argument("--shape", choices=("tiny", "llama8b", "kimi"), default="tiny",
                    help="llama8b, kimi: random weights at a real width, SGLang on a GPU (benchmarks/sglang_extraction.py)")
    ap.add_argument("--model", default=None, help="the --shape's checkpoint directory (default: made)")
    ap.add_argument("--ring-gib", type=float, default=16.0, help="SGLang's ring (GPU shapes)")
    ap.add_argument("--no-xet", dest="xet", action="store_false", help="leave out the real Xet client's count")
    ap.add_argument("--keep", action="store_true", help="keep the builds (and say where)")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.part_size, args.formats, args.dtypes, args.batches = 120, 32, "arrow", "bfloat16", "row"
    args.formats, args.dtypes, args.batches = (s.split(",") for s in (args.formats, args.dtypes, args.batches))
    if args.shape == "tiny":
        args.layers, args.backend, args.backend_options = LAYERS, "transformers", {"device": "cpu", "batch_tokens": 2048}
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import sglang_extraction as gpu  # deferred: the GPU shapes (their layers, the engine's arguments)

        args.layers = tuple(int(x) for x in gpu.SHAPES[args.shape]["layers"].split(","))
        args.backend, args.recapture = "sglang", True
        args.backend_options = {"ring_bytes": int(args.ring_gib * 2**30), "engine_args": dict(gpu.ENGINE_ARGS)}
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="reversions-"))
    try:
        report = run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"builds kept in {work}")
    # the target holds for one row per record batch (at a real width the default budget gives it)
    checked = {k: r["v2"]["data"]["by_chunks"] for k, r in report["results"].items()
               if k.endswith("-row") or args.shape != "tiny"}
    ok = all(v >= TARGET for v in checked.values())
    report["summary"] = {"target": TARGET, "checked": checked, "target_met": ok}
    print(f"SUMMARY: a 1%-changed v2 shares >= {_pct(TARGET).strip()} of its shard chunks with v1 in "
          f"{', '.join(checked) or 'no layout'}: {'yes' if ok else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

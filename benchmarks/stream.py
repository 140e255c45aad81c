#!/usr/bin/env python3
"""Train while it builds (issue 31): a build's tok/s with a trainer reading its stream, against the same
build with no trainer, and the trainer's wait for data.

One run, one machine, one backend kept across the builds (an SGLang engine starts once):
  plain    ``build()`` of the source, no stream
  alone    the same with a :class:`~hs_dataset.stream.StreamPublisher` and no trainer attached (what
           ``--stream`` costs when nobody reads)
  trainer  the same with a trainer process on this node reading ``open_stream(OUT)`` from its start:
           ``DataLoader(ds, batch_size=--batch, collate_fn=DrafterCollator())``, each batch copied to
           the GPU with ``--cuda`` (and synchronized), ``--step-ms`` of simulated training per batch
Each rep runs the three (the order rotates); tok/s is the best rep, ratios best over best, with the
spread. The build is timed from its first part (after the trainer attached), so all three time the
same work. The trainer reports its data wait: the seconds spent in ``next(loader)`` after its first
batch (before it, it waits for the engine to start), the delivery latency of the rows it took from
the spool (file written -> handed to its read-ahead), and where its rows came from; the build
reports the spool's peak bytes and how long it waited for the trainer (backpressure). Target:
trainer >= 0.95x plain.

    # on the device (SGLang): Kimi-K2.5's width, .gpu/make_kimi_width.py's model (or --model DIR)
    python benchmarks/stream.py --backend sglang --shape kimi --samples 128 --cuda --json $OUT/stream-kimi.json
    # CPU: Kimi-width rows from memory (no model run): the stream's host cost at that row size
    python benchmarks/stream.py --backend memory --samples 24
    # CPU: the tiny demo model on the transformers backend
    python benchmarks/stream.py --backend transformers --samples 96 --tokens 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

TARGET = 0.95


def trainer_main(a: argparse.Namespace) -> None:
    """The trainer process: one epoch of the stream in DrafterCollator batches; its figures to --result."""
    import torch
    from torch.utils.data import DataLoader

    from hs_dataset.read.collate import DrafterCollator
    from hs_dataset.stream import open_stream

    ds = open_stream(a.trainer, timeout=1800, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=a.batch, collate_fn=DrafterCollator(), num_workers=0)
    t0 = time.perf_counter()
    first: float | None = None
    wait = 0.0
    rows = batches = 0
    for_gpu = a.cuda and torch.cuda.is_available()
    it = iter(loader)
    while True:
        t = time.perf_counter()
        batch = next(it, None)
        if batch is None:
            break
        if first is None:
            first = time.perf_counter() - t0
        else:
            wait += time.perf_counter() - t
        if for_gpu:
            batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
            torch.cuda.synchronize()
        if a.step_ms:
            time.sleep(a.step_ms / 1000)
        rows += batch["input_ids"].shape[0]
        batches += 1
        del batch
    total = time.perf_counter() - t0
    Path(a.result).write_text(json.dumps({
        "rows": rows, "batches": batches, "first_batch_s": round(first or 0.0, 3),
        "wait_after_first_s": round(wait, 3), "after_first_s": round(total - (first or 0.0), 3),
        "stream": ds.stats}))


class Timed:
    """A sink that only notes when the build's first part starts (``plain``: no stream)."""

    def __init__(self) -> None:
        self.t0 = 0.0

    def start(self, out, parts, done) -> None:
        self.t0 = time.perf_counter()

    def row(self, part, index, sample_id, table) -> None:
        pass

    def generated(self, part, rows) -> None:
        pass

    def committed(self, part) -> None:
        pass

    def end(self, finished) -> None:
        pass


def publisher(budget: int, wait_for: int):
    from hs_dataset.stream import StreamPublisher

    class Attached(StreamPublisher):
        """Starts the build's parts once ``wait_for`` trainers are attached; ``t0`` is then."""

        def start(self, out, parts, done) -> None:
            super().start(out, parts, done)
            deadline = time.monotonic() + 600
            while len(list((self.spool / "readers").glob("*.json"))) < wait_for:
                if time.monotonic() > deadline:
                    raise RuntimeError("the trainer never attached to the stream")
                time.sleep(0.01)
            self.t0 = time.perf_counter()

    return Attached(budget_bytes=budget)


def make_backend(a: argparse.Namespace, work: Path) -> tuple[Any, str, tuple[int, ...], dict[str, Any]]:
    """(backend, model dir, layers, config fields) for --backend."""
    if a.backend == "memory":
        from storage import PrecomputedBackend, Shape, make_model_dir, make_states

        shape = Shape(a.hidden, 3, a.tokens, a.samples)
        model = make_model_dir(work / "model", a.hidden)
        layers = shape.layers()
        return PrecomputedBackend(model, layers, make_states(shape)), str(model), layers, {"backend": "transformers"}
    if a.backend == "transformers":
        from hs_dataset.capture.transformers import TransformersBackend
        from hs_dataset.demo.tiny import make_tiny_model_dir

        model = a.model or str(make_tiny_model_dir(work / "tiny-model", template="chatml", seed=0))
        layers = tuple(int(x) for x in (a.layers or "0,1,2").split(","))
        return (TransformersBackend(model, layers, device=a.device, batch_tokens=4096), model, layers,
                {"backend": "transformers"})
    from sglang_extraction import ENGINE_ARGS, SHAPES, make_8b_llama, make_kimi_width

    from hs_dataset.capture.sglang.backend import SGLangBackend

    shape = SHAPES[a.shape]
    model_dir = Path(a.model or shape["model"])
    model = str(make_8b_llama(model_dir) if a.shape == "llama8b" else make_kimi_width(model_dir))
    layers = tuple(int(x) for x in (a.layers or shape["layers"]).split(","))
    be = SGLangBackend(model, layers, max_inflight=a.max_inflight, ring_bytes=int(a.ring_gib * 2**30),
                       engine_args=ENGINE_ARGS)
    return be, model, layers, {"backend": "sglang"}


def spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values)), "median": round(statistics.median(values)), "max": round(max(values))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sglang", "transformers", "memory"), default="memory")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: made for the backend/shape)")
    ap.add_argument("--shape", choices=("kimi", "llama8b"), default="kimi", help="sglang: the model made")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--hidden", type=int, default=7168, help="memory: the states' width (Kimi-K2.5's)")
    ap.add_argument("--device", default="cpu", help="transformers: the device")
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--part-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="the trainer's batch size")
    ap.add_argument("--step-ms", type=float, default=0.0, help="the trainer's simulated work per batch")
    ap.add_argument("--cuda", action="store_true", help="the trainer copies each batch to the GPU")
    ap.add_argument("--stream-gib", type=float, default=4.0, help="the spool's budget")
    ap.add_argument("--max-inflight", type=int, default=64)
    ap.add_argument("--ring-gib", type=float, default=16.0)
    ap.add_argument("--work", default=None, help="build folder (default: $TMPDIR/hs-bench-stream)")
    ap.add_argument("--json", default=None, help="results (default: $OUT/stream.json when $OUT is set)")
    ap.add_argument("--trainer", default=None, help=argparse.SUPPRESS)  # the trainer process: the build to read
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainer:
        return trainer_main(a)
    a.json = a.json or (str(Path(os.environ["OUT"]) / "stream.json") if os.environ.get("OUT") else None)
    from storage import make_source

    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.write.driver import build

    work = Path(a.work or Path(os.environ.get("TMPDIR", "/tmp")) / "hs-bench-stream")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict[str, Any] = {"backend": a.backend, "samples": a.samples, "tokens": a.tokens, "batch": a.batch,
                           "step_ms": a.step_ms, "cuda": a.cuda, "stream_gib": a.stream_gib, "runs": []}

    def dump() -> None:
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))

    t = time.time()
    backend, model, layers, fields = make_backend(a, work)
    res["backend_start_s"], res["layers"] = round(time.time() - t, 1), list(layers)
    source = make_source(work / "source.jsonl", a.samples, a.tokens)
    cfg = HiddenStatesConfig(model=model, layers=layers, source=str(source), max_length=a.tokens, part_size=a.part_size,
                             max_shard_bytes=4 << 30, **fields)
    # warm up: the first build pays for imports, allocations, the kernels' first runs
    build(dataclasses.replace(cfg, max_samples=min(a.samples, 2 * a.part_size)), work / "warmup", backend=backend,
          progress=False)
    shutil.rmtree(work / "warmup")
    modes = ["plain", "alone", "trainer"]
    for rep in range(a.reps):
        for mode in modes[rep % 3:] + modes[:rep % 3]:
            out = work / f"{mode}-{rep}"
            proc = None
            if mode == "trainer":
                result = work / f"trainer-{rep}.json"
                cmd = [sys.executable, __file__, "--trainer", str(out), "--result", str(result), "--batch",
                       str(a.batch), "--step-ms", str(a.step_ms)] + (["--cuda"] if a.cuda else [])
                proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(  # keep the device's site
                    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])))
            sink = Timed() if mode == "plain" else publisher(int(a.stream_gib * 2**30), 1 if proc else 0)
            s = build(cfg, out, backend=backend, progress=False, sink=sink)  # type: ignore[arg-type]
            dt = time.perf_counter() - sink.t0
            run: dict[str, Any] = {"mode": mode, "rep": rep, "tok_s": round(s.counts.tokens_written / dt),
                                   "seconds": round(dt, 2), "written": s.counts.written}
            if mode != "plain":
                run["publisher"] = {k: round(v, 3) if isinstance(v, float) else v
                                    for k, v in vars(sink.stats).items()}
            if proc is not None:
                if proc.wait(timeout=1800) != 0:
                    raise RuntimeError(f"the trainer exited with {proc.returncode}")
                run["trainer"] = json.loads(result.read_text())
                run["trainer_got_every_row"] = run["trainer"]["rows"] == s.counts.written
            res["runs"].append(run)
            print(json.dumps(run), flush=True)
            shutil.rmtree(out, ignore_errors=True)
            dump()
    backend.close()
    best = {m: max(r["tok_s"] for r in res["runs"] if r["mode"] == m) for m in modes}
    res["tok_s"] = best
    res["spread"] = {m: spread([r["tok_s"] for r in res["runs"] if r["mode"] == m]) for m in modes}
    res["ratios"] = {"alone/plain": round(best["alone"] / best["plain"], 3),
                     "trainer/plain": round(best["trainer"] / best["plain"], 3)}
    res["target"] = {"trainer/plain": TARGET, "met": res["ratios"]["trainer/plain"] >= TARGET}
    tr = [r["trainer"] for r in res["runs"] if r["mode"] == "trainer"]
    res["trainer_wait_after_first_s"] = [t["wait_after_first_s"] for t in tr]
    res["trainer_after_first_s"] = [t["after_first_s"] for t in tr]
    dump()
    print(json.dumps({k: res[k] for k in ("tok_s", "spread", "ratios", "target", "trainer_wait_after_first_s",
                                          "trainer_after_first_s")}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Scale-out on the CPU (issue 17): the same build by 2 workers against 1, on the demo-sized model.

    python benchmarks/scaleout.py                       # 512 rows (the demo conversations repeated), parts of 32
    python benchmarks/scaleout.py --rows 1024 --ray     # also 2 Ray workers (pip install 'hs-dataset[ray]')
    python benchmarks/scaleout.py --json out.json

Each run is the real command line in fresh processes on the tiny demo model (random Llama, 4 layers,
hidden 64; transformers backend): one ``hs-dataset build``, then two workers at once the way
``torchrun --nproc-per-node 2`` starts them (``RANK``/``WORLD_SIZE``, ``--workers auto``; the last
one merges), and with ``--ray`` one ``--ray`` build on a new local Ray cluster. Reported: wall time
from start to the finished (merged) build, samples/s, and the ratio to one worker (ideal on 2 cores:
~2x; process start, model load and the merge are in the wall time, so with a start-up cost S and
work W the ideal is (S + W) / (S + W / 2)), best of ``--repeat`` runs (the runs alternate; a shared
VM swings single runs), and the CPU seconds the run's processes used over its wall time (the cores
it got; Ray's workers are not all counted). Each worker gets ``cores / workers`` torch threads (one
worker gets them all). The builds' shard checksums must be equal: the merged build holds the single
worker's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "builder_scripts" / "data" / "demo_conversations.jsonl"


def _script(d: Path, rows: int, part_size: int) -> Path:
    """A builder script of the demo config over ``rows`` rows (the demo conversations repeated)."""
    from hs_dataset.demo.tiny import make_tiny_model_dir

    lines = DEMO.read_text(encoding="utf-8").splitlines()
    source = d / "source.jsonl"
    source.write_text("".join(lines[i % len(lines)] + "\n" for i in range(rows)), encoding="utf-8")
    model = make_tiny_model_dir(d / "tiny-demo-llama", template="chatml", seed=0)
    cfg = {"model": str(model), "layers": [0, 1, 2], "max_length": 512, "source": str(source),
           "backend": "transformers", "backend_options": {"device": "cpu", "batch_tokens": 4096},
           "part_size": part_size}
    script = d / "bench_script.py"
    script.write_text(f"CONFIG = {cfg!r}\n")
    return script


def _run(commands: list[tuple[list[str], dict[str, str]]]) -> tuple[float, float]:
    """Start every command at once; -> (seconds until the last one ends, CPU seconds; each must succeed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in commands]
    outs = [p.communicate()[0] for p in procs]
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for p, o in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"{p.args} failed ({p.returncode}):\n{o}")
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _env(threads: int, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               OMP_NUM_THREADS=str(threads), **more)
    return env


def _checksums(out: Path) -> list[tuple[str, str]]:
    return [(s["name"], s["xxh3_128"]) for s in json.loads((out / "hs_dataset.json").read_text())["shards"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--part-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ray", action="store_true", help="also the same workers as Ray tasks on a new local cluster")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each, the best kept")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    py = [sys.executable, "-m", "hs_dataset.cli", "build"]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hs-scaleout-") as tmp:
        d = Path(tmp)
        script = _script(d, a.rows, a.part_size)
        base = [str(script), "--no-progress", "-o"]
        runs = {"1 worker": [(py + base + [str(d / "one")], _env(cores))]}
        per = max(1, cores // a.workers)
        runs[f"{a.workers} workers (torchrun-style)"] = [
            (py + base + [str(d / "many"), "--workers", "auto"],
             _env(per, RANK=str(r), WORLD_SIZE=str(a.workers), LOCAL_RANK=str(r))) for r in range(a.workers)]
        if a.ray:
            runs[f"{a.workers} Ray workers (local cluster)"] = [
                (py + base + [str(d / "ray"), "--ray", "--workers", str(a.workers)], _env(per))]
        outs = {"1 worker": d / "one", f"{a.workers} workers (torchrun-style)": d / "many",
                f"{a.workers} Ray workers (local cluster)": d / "ray"}
        for k in range(a.repeat):
            for name, commands in runs.items():
                if k:
                    shutil.rmtree(outs[name])
                seconds, cpu = _run(commands)
                if name not in results or seconds < results[name]["seconds"]:
                    results[name] = {"seconds": round(seconds, 2), "samples_per_s": round(a.rows / seconds, 1),
                                     "cores_used": round(cpu / seconds, 2)}
                if name != "1 worker" and _checksums(outs[name]) != _checksums(d / "one"):
                    raise SystemExit(f"{name}: the merged build's shards differ from the single worker's")
    one = results["1 worker"]["seconds"]
    print(f"{a.rows} rows, parts of {a.part_size}, tiny demo model (transformers, CPU), {cores} cores, "
          f"best of {a.repeat}")
    for name, r in results.items():
        r["ratio"] = round(one / r["seconds"], 2)
        print(f"  {name:34s} {r['seconds']:7.1f}s  {r['samples_per_s']:7.1f} samples/s  {r['ratio']:.2f}x  "
              f"({r['cores_used']:.2f} cores used)")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": a.rows, "part_size": a.part_size, "cores": cores,
                                            "repeat": a.repeat, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""How fast ``hs-dataset`` answers what needs no work (issue 28): ``--version``, a misspelt command,
``build --help`` (every config field and backend option), a configuration error; each against the raw
start of the interpreter, measured in the same run.

    python benchmarks/startup.py              # best of 5 per case
    python benchmarks/startup.py --reps 10

Each case is ``python -m hs_dataset.cli ...`` in a fresh process (wall time to its exit), interleaved
with the baselines ``python -c pass`` (the interpreter alone) and ``python -c "import torch"`` (what one
heavy import costs here); best of ``--reps``. The report (JSON, to ``benchmarks/results/`` and to
``$OUT`` when set) gives each case's seconds, its excess over ``python -c pass``, and which heavy
modules it imported (none is the goal: torch, datasets, transformers, pyarrow, numpy, huggingface_hub).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "datasets", "transformers", "pyarrow", "numpy", "huggingface_hub")
_IMPORTS = ("import json, sys\nfrom hs_dataset.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            f"    pass\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)")


def _timed(argv: list[str], env: dict) -> float:
    t = time.perf_counter()
    subprocess.run(argv, capture_output=True, env=env, cwd=str(ROOT), timeout=600)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "plain.py"  # no prepare() hook: the demo's makes its model (torch)
        script.write_text(f"CONFIG = {{'model': '/no/model', 'source': {str(ROOT / 'README.md')!r}, 'layers': [0]}}\n")
        cli = [sys.executable, "-m", "hs_dataset.cli"]
        cases = {
            "--version": ["--version"],
            "typo (biuld)": ["biuld"],
            "build --help": ["build", "--help"],
            "config error (--set max_lenght=5)": ["plan", str(script), "--set", "max_lenght=5"],
            "backend option error": ["build", str(script), "-o", str(Path(d) / "o"),
                                     "--set", "backend_options.batch_token=1"],
        }
        baselines = {"python -c pass": [sys.executable, "-c", "pass"],
                     "python -c 'import torch'": [sys.executable, "-c", "import torch"]}
        times: dict[str, list[float]] = {k: [] for k in [*baselines, *cases]}
        for _ in range(a.reps):
            for k, argv in baselines.items():
                times[k].append(_timed(argv, env))
            for k, args in cases.items():
                times[k].append(_timed(cli + args, env))
        heavy = {}
        for k, args in cases.items():
            r = subprocess.run([sys.executable, "-c", _IMPORTS, *args], capture_output=True, text=True, env=env,
                               cwd=str(ROOT), timeout=600)
            heavy[k] = json.loads(r.stderr.strip().splitlines()[-1])
    best = {k: min(v) for k, v in times.items()}
    raw = best["python -c pass"]
    report = {"benchmark": "startup", "date": dt.date.today().isoformat(), "reps": a.reps,
              "cores": len(os.sched_getaffinity(0)), "load_average": os.getloadavg(), "best_s": best,
              "excess_over_python_s": {k: best[k] - raw for k in cases}, "heavy_imports": heavy, "runs_s": times}
    for k in [*baselines, *cases]:
        extra = f"  (+{best[k] - raw:.3f}s over the interpreter, heavy imports: {heavy[k] or 'none'})" if k in cases else ""
        print(f"{k:40s} {best[k]:.3f}s{extra}")
    from save_report import save_report

    save_report(report, "startup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
